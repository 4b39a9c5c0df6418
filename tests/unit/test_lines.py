from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from relaunch.core.output.lines import LineFramer, prefix_lines


def frame(chunks: list[bytes], max_partial: int = 1 << 20) -> list[bytes]:
    framer = LineFramer(max_partial)
    out = [framer.feed(chunk) for chunk in chunks]
    out.append(framer.flush())
    return out


@given(st.lists(st.binary(max_size=40), max_size=30))
def test_any_chunking_yields_the_stream_as_whole_lines(chunks: list[bytes]) -> None:
    stream = b"".join(chunks)
    outputs = frame(chunks)
    joined = b"".join(outputs)
    expected = stream if not stream or stream.endswith(b"\n") else stream + b"\n"
    assert joined == expected
    # Every output is made of complete lines only.
    assert all(not piece or piece.endswith(b"\n") for piece in outputs)


@given(st.lists(st.binary(min_size=1, max_size=20), min_size=1, max_size=30))
def test_a_long_partial_line_is_released_rather_than_held(chunks: list[bytes]) -> None:
    outputs = frame([chunk.replace(b"\n", b"x") for chunk in chunks], max_partial=16)
    for piece in outputs[:-1]:
        assert piece == b"" or len(piece) >= 17


def test_partial_line_is_held_until_its_newline() -> None:
    framer = LineFramer()
    assert framer.feed(b"abc") == b""
    assert framer.feed(b"def\ngh") == b"abcdef\n"
    assert framer.flush() == b"gh\n"
    assert framer.flush() == b""


def test_prefix_lines() -> None:
    assert prefix_lines(b"a\nb\n", b"[w0]:") == b"[w0]:a\n[w0]:b\n"
    assert prefix_lines(b"\n", b"P") == b"P\n"
    assert prefix_lines(b"", b"P") == b""


def test_prefix_lines_progress_safe_clears_the_bar_line() -> None:
    assert prefix_lines(b"a\nb\n", b"P", progress_safe=True) == b"\rPa\033[K\n\rPb\033[K\n"


def test_undecodable_bytes_pass_through() -> None:
    framer = LineFramer()
    assert prefix_lines(framer.feed(b"\xff\xfe ok\n"), b"P") == b"P\xff\xfe ok\n"
