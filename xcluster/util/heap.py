"""Giving the heap memory a version freed back to the operating system (glibc's malloc_trim).

glibc keeps what a process frees. Once a large block is freed it raises its mmap threshold (up
to 32 MiB) and its trim threshold with it, so the MiB-sized temporaries of an encode and an upload
(byte planes, zstd output, change positions, request-body pieces) come from the heap arenas, one
per thread that allocates, and stay resident once freed: 0.1-0.2x of the model after a version,
on top of the caller's weights and the base (bench/memory.py). :func:`release` returns the free
pages (``malloc_trim(0)``); the publisher calls it once a version's temporaries are gone and
before it allocates a model-sized base. Elsewhere (musl, macOS, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

__all__ = ["release"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim  # the process's own symbols: glibc's, if it runs on glibc
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release() -> bool:
    """Return the heap's free pages to the OS; True if any were (False: none, or not glibc)."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
