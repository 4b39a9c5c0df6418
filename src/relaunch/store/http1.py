"""The little of HTTP/1.1 that etcd's gateway needs: JSON POSTs on a kept-alive connection, and
reading a streamed (chunked) reply line by line.

Why not ``http.client``: it parses every reply's headers with the ``email`` package, which costs
about 0.2 ms of CPU a request; a thousand nodes joining at once on one etcd pay for it in
seconds. This reads only the status line and the two headers that frame the body.
"""

from __future__ import annotations

import io
import socket
import ssl


class ProtocolError(OSError):
    """The server's reply is not HTTP/1.1 as expected (the connection is unusable)."""


class Response:
    """A reply: its ``status``, and its body read whole (``read``) or a line at a time."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        assert conn.file is not None
        self._file = conn.file
        status_line = self._file.readline(65537)
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise ProtocolError(f"not an HTTP reply: {status_line[:80]!r}")
        self.status = int(parts[1])
        self._length: int | None = None
        self._chunked = False
        keep_alive = parts[0] == b"HTTP/1.1"
        while True:
            line = self._file.readline(65537)
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise ProtocolError("the connection closed within the reply's headers")
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                self._length = int(value)
            elif name == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif name == b"connection":
                keep_alive = b"close" not in value.lower()
        self._keep_alive = keep_alive and (self._chunked or self._length is not None)
        self._buffer = b""
        self._done = False

    def read(self) -> bytes:
        """The whole body; the connection may then carry the next request."""
        if self._chunked:
            parts = [self._buffer]
            while (chunk := self._chunk()) is not None:
                parts.append(chunk)
            body = b"".join(parts)
        elif self._length is not None:
            body = self._file.read(self._length)
            if len(body) < self._length:
                raise ProtocolError("the connection closed within the reply's body")
        else:
            body = self._file.read()
        self._finish()
        return body

    def readline(self) -> bytes:
        """The next line of a streamed body (b"" at its end)."""
        if not self._chunked:
            return self._file.readline()
        while b"\n" not in self._buffer:
            chunk = self._chunk()
            if chunk is None:
                line, self._buffer = self._buffer, b""
                self._finish()
                return line
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line + b"\n"

    def _chunk(self) -> bytes | None:
        """The next chunk of a chunked body; None after the last one."""
        if self._done:
            return None
        size_line = self._file.readline(1026)
        if not size_line:
            raise ProtocolError("the connection closed within a chunked body")
        size = int(size_line.split(b";", 1)[0], 16)
        if size == 0:
            while self._file.readline(65537) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            self._done = True
            return None
        data = self._file.read(size + 2)
        if len(data) < size + 2:
            raise ProtocolError("the connection closed within a chunk")
        return data[:size]

    def _finish(self) -> None:
        self._done = True
        if not self._keep_alive:
            self._conn.close()


class Connection:
    """One kept-alive connection to ``host:port`` (TLS with ``context``), opened on first use;
    ``timeout`` bounds connecting and each read."""

    def __init__(
        self, host: str, port: int, timeout: float, context: ssl.SSLContext | None = None
    ) -> None:
        self.host, self.port, self._context = host, port, context
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self.file: io.BufferedReader | None = None  # while open
        self.interrupted = False  # by ``interrupt``
        self._host_header = f"Host: {host}:{port}\r\n".encode()

    @property
    def timeout(self) -> float:
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = value
        if self._sock is not None:
            self._sock.settimeout(value)

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send one POST with a JSON ``body``; its reply's status and headers read."""
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), self._timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._context is not None:
                sock = self._context.wrap_socket(sock, server_hostname=self.host)
            sock.settimeout(self._timeout)
            self._sock = sock
            self.file = sock.makefile("rb")
        head = [f"POST {path} HTTP/1.1\r\n".encode(), self._host_header]
        head += [f"{name}: {value}\r\n".encode() for name, value in headers.items()]
        head.append(f"Content-Length: {len(body)}\r\n\r\n".encode())
        try:
            self._sock.sendall(b"".join(head) + body)
            return Response(self)
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
            if self.file is not None:
                self.file.close()
            self._sock.close()
            self._sock = None
            self.file = None
