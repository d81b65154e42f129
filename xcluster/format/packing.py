"""How a manifest's canonical bytes are stored as an object (docs/FORMAT.md §3a).

``manifest-<attempt>.json.zst`` holds the canonical JSON as one zstd frame that declares its
content size: about a fifth of the bytes (tensor names and the JSON around them repeat; the
digests do not). Hashes, links and signatures always cover the canonical JSON, never the stored
bytes.

Reading is bounded (zframe.py): at most ``MAX_MANIFEST_BYTES + 1`` stored bytes are fetched, and a frame must
declare a content size of at most ``MAX_MANIFEST_BYTES`` before anything is decompressed, and
inflate to exactly that (one frame, nothing after it). Torch-free, like the rest of the read path.
"""

from __future__ import annotations

import zstandard

from ..errors import DecompressionBombError, FormatError
from . import MAX_MANIFEST_BYTES
from .zframe import frame_size, inflate

_SMALL = 1 << 20
"""Manifests up to this size are compressed at level 19 (≈10% smaller than level 3, a few ms at
this size); bigger ones at level 3, so a huge manifest never costs seconds at commit."""


def pack(canonical: bytes) -> bytes:
    """The bytes to store at a manifest object for the manifest ``canonical``."""
    level = 19 if len(canonical) <= _SMALL else 3
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False).compress(canonical)


def unpack(stored: bytes, *, where: str) -> bytes:
    """The canonical manifest bytes held by a manifest object whose bytes are ``stored``.

    Raises :class:`FormatError` for an object over the manifest limit, :class:`DecodeError` for
    anything but one well-formed frame (corruption: a reader re-reads it), and
    :class:`DecompressionBombError` for a frame that declares more than the manifest limit or
    inflates past what it declares."""
    if len(stored) > MAX_MANIFEST_BYTES:  # not damage in transit: no re-read helps
        raise FormatError(f"{where}: {len(stored)} bytes is over the {MAX_MANIFEST_BYTES}-byte limit")
    declared = frame_size(stored, where=where)
    if declared > MAX_MANIFEST_BYTES:
        raise DecompressionBombError(f"{where}: zstd frame declares {declared} bytes, over the "
                                     f"{MAX_MANIFEST_BYTES}-byte manifest limit")
    return inflate(stored, declared, where=where)
