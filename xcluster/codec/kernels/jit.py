"""Compiling the codec's loops with numba, when it is there and works.

numba is imported lazily and is optional: every compiled loop has a fallback that gives the same
results (numpy, or the same function run by Python), used where numba is missing, broken, or
turned off with ``XCLUSTER_NO_NUMBA=1``.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

NO_COMPILE_ENV = "XCLUSTER_NO_NUMBA"
"""Set to 1 to run the fallbacks instead of compiled loops (the same results, slower)."""


def disabled() -> bool:
    """Whether compiled loops are turned off (``XCLUSTER_NO_NUMBA``): the one place it is read."""
    return os.environ.get(NO_COMPILE_ENV, "") not in ("", "0")


def compile_loops(build: Callable[[Callable], Any], smoke: Callable[[Any], None]) -> Any | None:
    """``build(jit)`` with ``jit`` compiling one function (nogil, no bounds checks), after ``smoke``
    ran the result once; None when numba is missing, broken or turned off. Compiled code is cached
    on disk next to the module where that is writable, else compiled in memory."""
    if disabled():
        return None
    try:
        from numba import njit
    except ImportError:
        return None
    for cache in (True, False):
        try:
            opts = dict(nogil=True, cache=cache, boundscheck=False, error_model="numpy")
            loops = build(lambda f: njit(**opts)(f))
            smoke(loops)
            return loops
        except Exception:
            continue
    return None


def once(build: Callable[[], T]) -> Callable[[], T]:
    """``build`` run once, its result kept (like ``functools.cache``), and callers that come while
    it runs wait for that result instead of compiling a second time: the follow daemon warms the
    loops up on a thread of its own while its first version may already be decoding."""
    lock = threading.Lock()
    cached = functools.cache(build)

    @functools.wraps(build)
    def get() -> T:
        with lock:
            return cached()

    get.cache_clear = cached.cache_clear  # type: ignore[attr-defined]  # tests switch numba off and on
    return get
