"""The little of HTTP/1.1 that etcd's gateway needs: JSON POSTs on a kept-alive connection, and
reading a streamed (chunked) reply line by line.

Why not ``http.client``: it parses every reply's headers with the ``email`` package, which costs
about 0.2 ms of CPU a request; a thousand nodes joining at once on one etcd pay for it in
seconds. This reads only the status line and the two headers that frame the body.

Every request is bounded as a whole by a ``deadline.Deadline``: connecting, sending, the status
line and headers, and the body (``Response.read``); a member that trickles its reply a byte at a
time runs out of time like one that says nothing. A streamed body is read a line at a time, each
line within the connection's ``timeout`` (its idle time) unless told otherwise.
"""

from __future__ import annotations

import socket
import ssl

from relaunch.store.deadline import Deadline, Reader, connect, sendall

#: The longest status, header or chunk-size line read.
MAX_LINE = 65536
#: The largest body read whole: far above any reply relaunch asks etcd for (a 4,096-node job's
#: notes are a few MiB), so that a broken or hostile member cannot fill the memory.
MAX_BODY = 256 << 20


class ProtocolError(OSError):
    """The server's reply is not HTTP/1.1 as expected (the connection is unusable)."""


def _int(text: bytes, base: int, what: str) -> int:
    try:
        value = int(text.strip()[:32], base)
    except ValueError:
        raise ProtocolError(f"not an HTTP reply: bad {what} {text[:40]!r}") from None
    if value < 0:
        raise ProtocolError(f"not an HTTP reply: bad {what} {text[:40]!r}")
    return value


class Response:
    """A reply: its ``status``, and its body read whole (``read``) or a line at a time."""

    def __init__(self, conn: Connection, deadline: Deadline) -> None:
        self._conn = conn
        assert conn.reader is not None
        self._reader = reader = conn.reader
        self._deadline = deadline
        status_line = reader.readline(MAX_LINE, deadline)
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise ProtocolError(f"not an HTTP reply: {status_line[:80]!r}")
        self.status = _int(parts[1], 10, "status")
        self._length: int | None = None
        self._chunked = False
        keep_alive = parts[0] == b"HTTP/1.1"
        while True:
            line = reader.readline(MAX_LINE, deadline)
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise ProtocolError("the connection closed within the reply's headers")
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                self._length = _int(value, 10, "Content-Length")
                if self._length > MAX_BODY:
                    raise ProtocolError(f"a body of {self._length} bytes (at most {MAX_BODY})")
            elif name == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif name == b"connection":
                keep_alive = b"close" not in value.lower()
        self._keep_alive = keep_alive and (self._chunked or self._length is not None)
        self._buffer = b""
        self._chunk_size: int | None = None  # of a chunk whose size line was read, not its data
        self._done = False

    def read(self) -> bytes:
        """The whole body, within the request's deadline; the connection may then carry the
        next request."""
        deadline = self._deadline
        if self._chunked:
            parts = [self._buffer]
            size = len(self._buffer)
            while (chunk := self._chunk(deadline)) is not None:
                size += len(chunk)
                if size > MAX_BODY:
                    raise ProtocolError(f"a body of more than {MAX_BODY} bytes")
                parts.append(chunk)
            body = b"".join(parts)
        elif self._length is not None:
            body = self._reader.read(self._length, deadline)
            if len(body) < self._length:
                raise ProtocolError("the connection closed within the reply's body")
        else:
            try:
                body = self._reader.read_to_end(MAX_BODY, deadline)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
        self._finish()
        return body

    def readline(self, deadline: Deadline | None = None) -> bytes:
        """The next line of a streamed body (b"" at its end), within ``deadline`` (default:
        the connection's ``timeout`` from now). A ``TimeoutError`` loses nothing: the next
        call goes on from the bytes already received."""
        if deadline is None:
            deadline = Deadline(self._conn.timeout)
        if not self._chunked:
            return self._reader.readline(MAX_BODY, deadline)
        while b"\n" not in self._buffer:
            chunk = self._chunk(deadline)
            if chunk is None:
                line, self._buffer = self._buffer, b""
                self._finish()
                return line
            self._buffer += chunk
            if len(self._buffer) > MAX_BODY:
                raise ProtocolError(f"a line of more than {MAX_BODY} bytes")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line + b"\n"

    def _chunk(self, deadline: Deadline) -> bytes | None:
        """The next chunk of a chunked body; None after the last one."""
        if self._done:
            return None
        if self._chunk_size is None:
            size_line = self._reader.readline(1026, deadline)
            if not size_line:
                raise ProtocolError("the connection closed within a chunked body")
            size = _int(size_line.split(b";", 1)[0], 16, "chunk size")
            if size > MAX_BODY:
                raise ProtocolError(f"a chunk of {size} bytes (at most {MAX_BODY})")
            if size == 0:
                while self._reader.readline(MAX_LINE, deadline) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                self._done = True
                return None
            self._chunk_size = size
        size = self._chunk_size
        data = self._reader.read(size + 2, deadline)
        if len(data) < size + 2:
            raise ProtocolError("the connection closed within a chunk")
        self._chunk_size = None
        return data[:size]

    def _finish(self) -> None:
        self._done = True
        if not self._keep_alive:
            self._conn.close()


class Connection:
    """One kept-alive connection to ``host:port`` (TLS with ``context``), opened on first use.
    ``timeout``: what a request may take when the caller gives no deadline, and how long a
    streamed body's line may take to arrive."""

    def __init__(
        self, host: str, port: int, timeout: float, context: ssl.SSLContext | None = None
    ) -> None:
        self.host, self.port, self._context = host, port, context
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self.reader: Reader | None = None  # while open
        self.interrupted = False  # by ``interrupt``
        self._host_header = f"Host: {host}:{port}\r\n".encode()

    def post(
        self, path: str, body: bytes, headers: dict[str, str], deadline: Deadline | None = None
    ) -> Response:
        """Send one POST with a JSON ``body``; its reply's status and headers read. The whole
        request, ``Response.read`` included, ends by ``deadline`` (default: ``timeout``)."""
        if deadline is None:
            deadline = Deadline(self.timeout)
        head = [f"POST {path} HTTP/1.1\r\n".encode(), self._host_header]
        head += [f"{name}: {value}\r\n".encode() for name, value in headers.items()]
        head.append(f"Content-Length: {len(body)}\r\n\r\n".encode())
        try:
            if self._sock is None:
                sock = connect(self.host, self.port, deadline)
                self._sock = sock
                if self._context is not None:
                    sock.settimeout(deadline.timeout())  # bounds the handshake as a whole
                    self._sock = self._context.wrap_socket(sock, server_hostname=self.host)
                self.reader = Reader(self._sock)
            sendall(self._sock, b"".join(head) + body, deadline)
            return Response(self, deadline)
        except BaseException:
            self.close()
            raise

    def interrupt(self) -> None:
        """Wake a thread blocked reading this connection, from another thread: its read ends
        as if the server had closed the connection (the reading thread still closes it)."""
        self.interrupted = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.reader = None
