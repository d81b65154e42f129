"""One zstd frame, read safely: its header's declared content size is read before anything is
inflated, and the frame must inflate to exactly that, with nothing after it.

Below both users: the codec's streams (codec/streams.py) and packed manifests
(manifest_object.py, on the torch- and numpy-free read path), so it imports neither.
"""

from __future__ import annotations

import zstandard

from .errors import DecodeError, DecompressionBombError


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
        if "Destination buffer is too small" in str(exc):  # ZSTD_error_dstSize_tooSmall: it inflates past size
            raise DecompressionBombError(f"{where}: zstd frame declares {size} bytes but inflates past them "
                                         "(its header lies): a decompression bomb") from exc
        raise DecodeError(f"{where}: corrupt zstd frame ({exc})") from exc
    if len(out) != size:
        raise DecodeError(f"{where}: decoded {len(out)} bytes, the frame declares {size}")
    return out
