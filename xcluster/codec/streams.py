"""One compressed stream: a zstd frame (or the raw bytes when zstd does not help).

The decoder is told the exact decoded size from the manifest and refuses anything else
before allocating more: a frame that declares a larger content size is a decompression bomb.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import zstandard

from ..errors import DecodeError, DecompressionBombError
from ..zframe import frame_size, inflate

ZSTD = "zstd"
RAW = "raw"
CODECS = (ZSTD, RAW)


def compress(pieces: Sequence[np.ndarray | bytes | memoryview], *, level: int) -> tuple[str, bytes]:
    """Compress the concatenation of ``pieces`` into one stream; returns ``(codec, payload)``."""
    total = sum(len(memoryview(p).cast("B")) if not isinstance(p, np.ndarray) else p.nbytes for p in pieces)
    if total == 0:
        return RAW, b""
    cobj = zstandard.ZstdCompressor(level=level, write_content_size=True).compressobj(size=total)
    out = [cobj.compress(p) for p in pieces]
    out.append(cobj.flush())
    payload = b"".join(out)
    if len(payload) >= total:
        return RAW, b"".join(bytes(memoryview(p).cast("B")) if not isinstance(p, np.ndarray) else p.tobytes()
                             for p in pieces)
    return ZSTD, payload


def decompress(codec: str, payload: bytes | memoryview, raw_len: int, *, where: str) -> np.ndarray:
    """Decode one stream to exactly ``raw_len`` bytes (a uint8 array) or raise a named error."""
    if codec == RAW:
        if len(payload) != raw_len:
            raise DecodeError(f"{where}: raw stream holds {len(payload)} bytes, manifest says {raw_len}")
        return np.frombuffer(payload, dtype=np.uint8)
    if codec != ZSTD:
        raise DecodeError(f"{where}: unknown stream codec {codec!r}")
    declared = frame_size(payload, where=where)
    if declared != raw_len:
        cls = DecompressionBombError if declared > raw_len else DecodeError
        raise cls(f"{where}: zstd frame declares {declared} bytes, manifest says {raw_len}")
    return np.frombuffer(inflate(payload, raw_len, where=where), dtype=np.uint8)
