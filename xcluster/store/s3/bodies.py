"""Request and response bodies that copy nothing: a file over a memoryview for uploads, reads
straight into a caller's buffer for downloads, and the Content-Range of a ranged GET."""

from __future__ import annotations

import io
from typing import Any

from ...errors import ShortReadError, StoreError

_READ_PIECE = 1 << 20  # urllib3's readinto reads into a temporary of the size asked for: keep it small


def content_range(response: dict, what: str) -> tuple[int, int, int]:
    """``(first, last, total)`` from a 206 response's Content-Range."""
    value = response.get("ContentRange") or ""
    try:
        unit, rest = value.split(" ", 1)
        span, total = rest.split("/", 1)
        first, last = span.split("-", 1)
        assert unit == "bytes"
        return int(first), int(last), int(total)
    except (ValueError, AssertionError):
        raise StoreError(f"{what}: the server answered a ranged GET without a valid Content-Range "
                         f"({value!r}); it does not support Range requests") from None


def read_into(body: Any, out: memoryview, what: str) -> None:
    """Fill ``out`` from a streaming body, a MiB at a time; fewer bytes than ``len(out)`` is a short read."""
    filled = 0
    try:
        while filled < len(out):
            n = body.readinto(out[filled:filled + _READ_PIECE])
            if not n:
                break
            filled += n
    finally:
        body.close()
    if filled != len(out):
        raise ShortReadError(f"{what}: body ended after {filled} of {len(out)} bytes")


class ViewReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview: botocore reads a request body from it a
    piece at a time (hashing, signing, sending), so the caller's buffer is never copied whole."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._view)

    def __bool__(self) -> bool:  # an empty body is still a body
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def request_body(data: Any, view: memoryview) -> Any:
    """A request body for ``data`` that copies nothing: bytes-like objects botocore takes as they
    are, anything else (a memoryview, a slice of one) as a :class:`ViewReader` over it."""
    return data if isinstance(data, (bytes, bytearray)) else ViewReader(view)
