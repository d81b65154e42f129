"""One compressed stream: a zstd frame (or the raw bytes when zstd does not help).

The decoder is told the exact decoded size from the manifest and refuses anything else
before allocating more: a frame that declares a larger content size is a decompression bomb.
A stream is decoded whole (:func:`decompress`), or read front to back a piece at a time
(:class:`Reader`), which never holds more than a piece of it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import zstandard

from ..errors import DecodeError, DecompressionBombError
from ..format.zframe import frame_length, frame_size, inflate, inflate_error

ZSTD = "zstd"
RAW = "raw"
CODECS = (ZSTD, RAW)


MIN_FRAME = 10
"""Bytes of the smallest zstd frame holding any content (RFC 8878: 4 magic, a 1-byte frame header
descriptor, a 1-byte content size, a 3-byte block header and at least 1 byte of block), so content
of at most this many bytes is stored raw without trying."""

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level``: made once, since making one costs more than
    compressing a small piece (a compressor serves one frame at a time: one per thread)."""
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


class Incompressible(np.ndarray):
    """A piece an encoder already found zstd cannot shrink (a near-random field): a stream made
    only of such pieces is stored raw without trying again (:func:`incompressible`)."""


def incompressible(a: np.ndarray) -> np.ndarray:
    """``a`` marked :class:`Incompressible` (a view: no copy)."""
    return a.view(Incompressible)


def compress(pieces: Sequence[np.ndarray | bytes | memoryview], *, level: int) -> tuple[str, bytes]:
    """Compress the concatenation of ``pieces`` into one stream; returns ``(codec, payload)``."""
    total = sum(len(memoryview(p).cast("B")) if not isinstance(p, np.ndarray) else p.nbytes for p in pieces)
    if pieces and all(isinstance(p, Incompressible) for p in pieces):
        return RAW, _joined(pieces)
    payload = _frame(pieces, total, level)
    if payload is None or len(payload) >= total:
        return RAW, _joined(pieces)
    return ZSTD, payload


def stored_size(pieces: Sequence[np.ndarray], *, level: int) -> int:
    """The bytes :func:`compress` would store ``pieces`` in (without making the raw copy)."""
    total = sum(p.nbytes for p in pieces)
    if pieces and all(isinstance(p, Incompressible) for p in pieces):
        return total
    payload = _frame(pieces, total, level)
    return total if payload is None else min(total, len(payload))


def _frame(pieces: Sequence[np.ndarray | bytes | memoryview], total: int, level: int) -> bytes | None:
    """One zstd frame of the ``total`` bytes of ``pieces``; None where no frame can be smaller
    than them (at most :data:`MIN_FRAME` bytes), without trying."""
    if total <= MIN_FRAME:
        return None
    cobj = _compressor(level).compressobj(size=total)
    out = [cobj.compress(p) for p in pieces]
    out.append(cobj.flush())
    return b"".join(out)


def _joined(pieces: Sequence[np.ndarray | bytes | memoryview]) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) if not isinstance(p, np.ndarray) else p.tobytes() for p in pieces)


def _checked(codec: str, payload: bytes | memoryview, raw_len: int, *, where: str) -> bool:
    """Check what can be checked before inflating anything; True for a zstd frame, False for raw bytes."""
    if codec == RAW:
        if len(payload) != raw_len:
            raise DecodeError(f"{where}: raw stream holds {len(payload)} bytes, manifest says {raw_len}")
        return False
    if codec != ZSTD:
        raise DecodeError(f"{where}: unknown stream codec {codec!r}")
    declared = frame_size(payload, where=where)
    if declared != raw_len:
        cls = DecompressionBombError if declared > raw_len else DecodeError
        raise cls(f"{where}: zstd frame declares {declared} bytes, manifest says {raw_len}")
    return True


def decompress(codec: str, payload: bytes | memoryview, raw_len: int, *, where: str) -> np.ndarray:
    """Decode one stream to exactly ``raw_len`` bytes (a uint8 array) or raise a named error."""
    if not _checked(codec, payload, raw_len, where=where):
        return np.frombuffer(payload, dtype=np.uint8)
    return np.frombuffer(inflate(payload, raw_len, where=where), dtype=np.uint8)


class Reader:
    """One stream read front to back, ``take(k)`` bytes at a time: views of the stored bytes (raw)
    or of one buffer the zstd frame is inflated into, piece by piece — so a large stream is never
    held whole, and what is taken is still in the cache when it is used. A view is valid until the
    next ``take``. Checked as :func:`decompress` checks: the declared size before anything is
    inflated, nothing stored after the frame, and (``finish``) exactly ``raw_len`` bytes in all."""

    def __init__(self, codec: str, payload: bytes | memoryview, raw_len: int, *, where: str) -> None:
        self.where, self.raw_len, self.pos = where, raw_len, 0
        if not _checked(codec, payload, raw_len, where=where):
            self._raw: np.ndarray | None = np.frombuffer(payload, dtype=np.uint8)
            return
        if (end := frame_length(payload, where=where)) != len(payload):
            raise DecodeError(f"{where}: {len(payload) - end} bytes of unused data after the zstd frame")
        self._raw = None
        self._reader = zstandard.ZstdDecompressor().stream_reader(payload)
        self._buf = np.empty(0, dtype=np.uint8)

    @classmethod
    def over(cls, data: np.ndarray, *, where: str) -> Reader:
        """A reader of bytes already decoded."""
        return cls(RAW, data, data.size, where=where)

    def take(self, k: int) -> np.ndarray:
        """The next ``k`` bytes (a DecodeError past ``raw_len``)."""
        if self.pos + k > self.raw_len:
            raise DecodeError(f"{self.where}: the stream ends early")
        self.pos += k
        if self._raw is not None:
            return self._raw[self.pos - k:self.pos]
        if self._buf.size < k:
            self._buf = np.empty(k, dtype=np.uint8)
        out = self._buf[:k]
        view, got = memoryview(out), 0
        try:
            while got < k and (n := self._reader.readinto(view[got:])):
                got += n
        except zstandard.ZstdError as exc:
            raise inflate_error(exc, self.raw_len, where=self.where) from exc
        if got < k:
            raise DecodeError(f"{self.where}: the zstd frame inflates to fewer bytes than it declares")
        return out

    def left(self) -> int:
        """Bytes not taken yet."""
        return self.raw_len - self.pos

    def finish(self) -> None:
        """Every byte taken, and the frame (its checksum, if any, verified) ends there."""
        if self.pos != self.raw_len:
            raise DecodeError(f"{self.where}: {self.raw_len - self.pos} bytes left over in the stream")
        if self._raw is None:
            try:
                more = self._reader.read(1)
            except zstandard.ZstdError as exc:
                raise inflate_error(exc, self.raw_len, where=self.where) from exc
            if more:
                raise DecompressionBombError(f"{self.where}: zstd frame inflates past the {self.raw_len} bytes it declares")
