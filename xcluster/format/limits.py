"""limits: see docs/FORMAT.md."""

from __future__ import annotations






MAX_PARTS = 1 << 16
"""At most this many parts per tensor."""
MAX_MANIFEST_BYTES = 64 << 20
MAX_HEAD_BYTES = 64 << 10
MAX_DIMS = 32
MAX_TENSOR_ELEMENTS = 1 << 44
MAX_STREAMS = 64
"""Streams of one block, at most (every encoding has far fewer)."""
MAX_SEGMENT_ELEMENTS = 1 << 31
MAX_CHUNK_BYTES = 1 << 36
MAX_VERSION = (1 << 53) - 1
MAX_CHAIN = 4096
"""A delta's chain back to its keyframe holds at most this many versions (keyframe included):
writers keep ``version - keyframe_version < MAX_CHAIN``, readers may refuse longer chains."""
MAX_FILE_BYTES = 256 << 20
MAX_FILES = 1024
MAX_FILES_TOTAL_BYTES = 1 << 30
"""The non-weight files of one manifest add up to at most this many bytes (the sum of ``size``
over every listed name: an object listed under two names is written twice)."""
MAX_LEASE_BYTES = 64 << 10
