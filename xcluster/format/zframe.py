"""One zstd frame, read safely: its header's declared content size is read before anything is
inflated, and the frame must inflate to exactly that, with nothing after it.

Below both users: the codec's streams (codec/streams.py) and packed manifests
(manifest_object.py, on the torch- and numpy-free read path), so it imports neither.
"""

from __future__ import annotations

import zstandard

from ..errors import DecodeError, DecompressionBombError


def frame_size(payload: bytes | memoryview, *, where: str) -> int:
    """The content size a zstd frame declares in its header (read before anything is inflated);
    :class:`DecodeError` for anything but a frame that declares one (xcluster always writes it)."""
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"{where}: not a zstd frame ({exc})") from exc
    if declared < 0:
        raise DecodeError(f"{where}: zstd frame without a content size (xcluster always writes one)")
    return declared


def inflate(payload: bytes | memoryview, size: int, *, where: str) -> bytes:
    """The ``size`` bytes of the one frame ``payload`` (whose header declares ``size``): never
    more (:class:`DecompressionBombError`), nothing after the frame (:class:`DecodeError`)."""
    try:
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise inflate_error(exc, size, where=where) from exc
    if len(out) != size:
        raise DecodeError(f"{where}: decoded {len(out)} bytes, the frame declares {size}")
    return out


def inflate_error(exc: zstandard.ZstdError, size: int, *, where: str) -> DecodeError:
    """The named error for zstd's failure to inflate a frame declared to hold ``size`` bytes."""
    if "Destination buffer is too small" in str(exc):  # ZSTD_error_dstSize_tooSmall: it inflates past size
        return DecompressionBombError(f"{where}: zstd frame declares {size} bytes but inflates past them "
                                      "(its header lies): a decompression bomb")
    return DecodeError(f"{where}: corrupt zstd frame ({exc})")


def frame_length(payload: bytes | memoryview, *, where: str) -> int:
    """The stored length of the zstd frame that starts ``payload`` (RFC 8878 §3.1.1: its header,
    then blocks of 3-byte headers — last-block bit, type, size — up to the last block, then the
    content checksum if the header says so), found without inflating anything. A truncated frame or
    a reserved block type is a :class:`DecodeError`."""
    mv = memoryview(payload).cast("B")
    try:
        pos = zstandard.frame_header_size(mv)
        checksum = zstandard.get_frame_parameters(mv).has_checksum
    except zstandard.ZstdError as exc:
        raise DecodeError(f"{where}: not a zstd frame ({exc})") from exc
    while True:
        if pos + 3 > len(mv):
            raise DecodeError(f"{where}: zstd frame cut short")
        header = mv[pos] | (mv[pos + 1] << 8) | (mv[pos + 2] << 16)
        kind, size = (header >> 1) & 3, header >> 3
        if kind == 3:
            raise DecodeError(f"{where}: zstd block of the reserved type")
        pos += 3 + (1 if kind == 1 else size)  # an RLE block stores one byte
        if header & 1:
            pos += 4 if checksum else 0
            if pos > len(mv):
                raise DecodeError(f"{where}: zstd frame cut short")
            return pos
