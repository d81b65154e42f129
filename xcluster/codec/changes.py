"""Finding changed elements and the reversible per-element transform of a change.

A change is carried as ``zigzag(new - old mod 2**bits)`` of the raw bits viewed as unsigned
integers: the usual RL step moves a bf16 weight by one ulp, which makes the difference ±1 and
its zigzag 1 or 2 — a much smaller alphabet than the XOR of the bits (1, 3, 7, …).
"""

from __future__ import annotations

import numpy as np


SCAN_ELEMENTS = 1 << 20
"""Elements compared per pass: both operands of a pass stay in cache for the second look."""


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted int64 positions where the unsigned bit views ``old`` and ``new`` differ.

    Elements narrower than 8 bytes are compared eight bytes at a time first (one uint64 word
    holds 8/width elements), so the mask and the nonzero scan are 8/width times smaller; only
    the few differing words are looked at lane by lane.
    """
    parts = [_scan(old[s:s + SCAN_ELEMENTS], new[s:s + SCAN_ELEMENTS]) + s
             for s in range(0, old.size, SCAN_ELEMENTS)]
    parts = [p for p in parts if p.size]
    if not parts:
        return np.empty(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _scan(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    w = old.itemsize
    per = 8 // w
    main = old.size - old.size % per if per > 1 else 0
    parts: list[np.ndarray] = []
    if main:
        o64, n64 = old[:main].view(np.uint64), new[:main].view(np.uint64)
        wi = np.flatnonzero(o64 != n64)
        if wi.size:
            x = o64[wi] ^ n64[wi]
            rows, lanes = np.nonzero(x.view(old.dtype).reshape(-1, per))
            parts.append(wi[rows] * per + lanes)
    if main < old.size:
        parts.append(np.flatnonzero(old[main:] != new[main:]) + main)
    if not parts:
        return np.empty(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def zigzag_diff(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``zigzag(new - old)`` elementwise for unsigned arrays of one width (wrapping)."""
    d = new - old
    bits = d.dtype.itemsize * 8
    return (d << d.dtype.type(1)) ^ (0 - (d >> d.dtype.type(bits - 1)))


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of the zigzag: the wrapped difference ``new - old``."""
    return (z >> z.dtype.type(1)) ^ (0 - (z & z.dtype.type(1)))


def split_planes(values: np.ndarray) -> list[np.ndarray]:
    """Byte planes of an unsigned array: plane i holds byte i (little-endian) of every element."""
    w = values.dtype.itemsize
    if w == 1:
        return [values.view(np.uint8)]
    b = values.view(np.uint8).reshape(-1, w)
    return [np.ascontiguousarray(b[:, i]) for i in range(w)]


def join_planes(planes: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`split_planes`."""
    if len(planes) == 1:
        return planes[0].view(dtype)
    return np.stack(planes, axis=1).view(dtype).reshape(-1)
