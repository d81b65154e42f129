"""Finding changed elements and the reversible per-element transform of a change.

A change is carried as ``zigzag(new - old mod 2**bits)`` of the raw bits viewed as unsigned
integers: the usual RL step moves a bf16 weight by one ulp, which makes the difference ±1 and
its zigzag 1 or 2 — a much smaller alphabet than the XOR of the bits (1, 3, 7, …).
"""

from __future__ import annotations

import numpy as np

from . import jit

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
"""The unsigned integer type of each element width: how raw bits are handled (torch-free)."""


SCAN_ELEMENTS = 1 << 20
"""Elements compared per pass: both operands of a pass stay in cache for the second look."""


def find_changes(old: np.ndarray, new: np.ndarray, *, numpy: bool = False
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the unsigned bit views ``old`` and ``new`` differ: sorted int64 positions and the
    old and new values there.

    Compared eight bytes at a time (one uint64 word holds 8/width elements): by one compiled
    pass that tests eight words at once and reads the lanes of those that differ without a
    branch per lane (bf16, 8M elements: 0.4 ns per element at 1% changed, 35-40% less than
    numpy; about 20% less at 25%; as fast as numpy at 0.01-0.1% and 4-10%), or with numpy
    (``numpy``, or without numba), where the mask and the nonzero scan are 8/width times
    smaller than per element and the few differing words are gathered once and their lanes
    read from that compact copy.
    """
    k = None if numpy else _kernels()
    if k is not None and old.size:
        return _find_compiled(k[1], old, new)
    parts = [_scan(old[s:s + SCAN_ELEMENTS], new[s:s + SCAN_ELEMENTS], s)
             for s in range(0, old.size, SCAN_ELEMENTS)]
    parts = [p for p in parts if p[0].size]
    if not parts:
        return np.empty(0, dtype=np.int64), old[:0].copy(), new[:0].copy()
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def _scan(old: np.ndarray, new: np.ndarray, offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    w = old.itemsize
    per = 8 // w
    main = old.size - old.size % per if per > 1 else 0
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    if main:
        o64, n64 = old[:main].view(np.uint64), new[:main].view(np.uint64)
        wi = np.flatnonzero(o64 != n64)
        if wi.size:
            ow, nw = o64[wi].view(old.dtype), n64[wi].view(old.dtype)
            idx = np.flatnonzero(ow != nw)
            parts.append((wi[idx // per] * per + idx % per + offset, ow[idx], nw[idx]))
    if main < old.size:
        idx = np.flatnonzero(old[main:] != new[main:])
        parts.append((idx + main + offset, old[main:][idx], new[main:][idx]))
    if not parts:
        return np.empty(0, dtype=np.int64), old[:0], new[:0]
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def _find(o64, n64, o, n, per, start, pos, ov, nv, k):
    """Changes from word ``start`` on, written at ``pos``/``ov``/``nv[k:]``; returns the word it
    stopped at (``o64.size``: done; less: the outputs may not hold that word's changes) and the
    new ``k``. Eight words are tested at once: at 1% of bf16 elements changed, three in four
    such groups hold no change. A differing word's lanes are all written and ``k`` advanced by
    those that changed (a branch per lane mispredicts once changes are dense)."""
    cap = pos.size
    nw = o64.size
    i = start
    nb = nw - nw % 8
    while i < nb:
        x = ((o64[i] ^ n64[i]) | (o64[i + 1] ^ n64[i + 1]) | (o64[i + 2] ^ n64[i + 2]) | (o64[i + 3] ^ n64[i + 3])
             | (o64[i + 4] ^ n64[i + 4]) | (o64[i + 5] ^ n64[i + 5]) | (o64[i + 6] ^ n64[i + 6])
             | (o64[i + 7] ^ n64[i + 7]))
        if x == 0:
            i += 8
            continue
        if k + 8 * per > cap:
            return i, k
        for w in range(i, i + 8):
            if o64[w] != n64[w]:
                for j in range(w * per, w * per + per):  # branch-free: every lane written, changed ones kept
                    pos[k] = j
                    ov[k] = o[j]
                    nv[k] = n[j]
                    k += o[j] != n[j]
        i += 8
    while i < nw:
        if o64[i] != n64[i]:
            if k + per > cap:
                return i, k
            for j in range(i * per, i * per + per):
                if o[j] != n[j]:
                    pos[k] = j
                    ov[k] = o[j]
                    nv[k] = n[j]
                    k += 1
        i += 1
    return i, k


def _find_compiled(find, old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`find_changes` by the compiled loop ``find``: outputs sized for 1/64 of the elements
    changed, doubled (up to all of them) whenever the loop fills them."""
    per = 8 // old.itemsize
    main = old.size - old.size % per
    o64, n64 = old[:main].view(np.uint64), new[:main].view(np.uint64)
    cap = min(old.size, max(1024, old.size >> 6))
    pos, ov, nv = np.empty(cap, np.int64), np.empty(cap, old.dtype), np.empty(cap, old.dtype)
    i, k = find(o64, n64, old, new, per, 0, pos, ov, nv, 0)
    while i < o64.size:
        cap = min(old.size, 2 * cap)
        pos, ov, nv = (np.concatenate([a[:k], np.empty(cap - k, a.dtype)]) for a in (pos, ov, nv))
        i, k = find(o64, n64, old, new, per, i, pos, ov, nv, k)
    if main < old.size:  # the last elements, short of a word
        t = np.flatnonzero(old[main:] != new[main:])
        if t.size:
            return (np.concatenate([pos[:k], t + main]), np.concatenate([ov[:k], old[main:][t]]),
                    np.concatenate([nv[:k], new[main:][t]]))
    return pos[:k], ov[:k], nv[:k]


def gaps_of(pos: np.ndarray) -> np.ndarray:
    """The gaps of sorted positions inside one range (< 2**32 elements): ``pos[0]``, then
    ``pos[k] - pos[k-1] - 1``, as uint32. Written into the result by ufuncs, which release the GIL
    (``np.diff`` with ``prepend`` holds it while it joins and copies)."""
    gaps = np.empty(pos.size, dtype=np.uint32)
    if pos.size:
        gaps[0] = pos[0]
        np.subtract(pos[1:], pos[:-1], out=gaps[1:], casting="unsafe")
        gaps[1:] -= np.uint32(1)
    return gaps


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


def _sub_pieces(pos, ov, nv, width):
    """Gap planes (4 × m bytes), zigzag planes (width × m bytes) and the zigzag values themselves."""
    m = pos.size
    gp = np.empty(4 * m, np.uint8)
    zp = np.empty(width * m, np.uint8)
    z = np.empty(m, ov.dtype)
    full = (np.int64(1) << (8 * width)) - 1
    top = 8 * width - 1
    prev = np.int64(-1)
    for i in range(m):
        g = np.int64(pos[i]) - prev - 1
        prev = np.int64(pos[i])
        gp[i] = g & 0xFF
        gp[m + i] = (g >> 8) & 0xFF
        gp[2 * m + i] = (g >> 16) & 0xFF
        gp[3 * m + i] = (g >> 24) & 0xFF
        d = (np.int64(nv[i]) - np.int64(ov[i])) & full
        zz = ((d << 1) & full) ^ (full if d >> top else 0)
        z[i] = zz
        for b in range(width):
            zp[b * m + i] = (zz >> (8 * b)) & 0xFF
    return gp, zp, z


def _smoke(loops) -> None:
    gp, zp, z = loops[0](np.array([3, 300], np.int64), np.array([5, 0], np.uint16), np.array([4, 1], np.uint16), 2)
    if gp.tolist() != [3, 40, 0, 1, 0, 0, 0, 0] or z.tolist() != [1, 2] or zp.tolist() != [1, 2, 0, 0]:
        raise RuntimeError("the compiled sparse-sub pieces disagree with gaps_of and zigzag_diff")
    old = np.zeros(40, np.uint16)
    new = old.copy()
    new[[3, 38]] = 1
    pos, ov, nv = _find_compiled(loops[1], old, new)
    if pos.tolist() != [3, 38] or ov.tolist() != [0, 0] or nv.tolist() != [1, 1]:
        raise RuntimeError("the compiled change finder disagrees with numpy")


@jit.once
def _kernels():
    return jit.compile_loops(lambda c: (c(_sub_pieces), c(_find)), _smoke)


def sparse_sub_pieces(pos: np.ndarray, ov: np.ndarray, nv: np.ndarray, *, numpy: bool = False
                      ) -> tuple[list[np.ndarray], np.ndarray]:
    """A ``sparse-sub`` segment's pieces (the byte planes of :func:`gaps_of` of the sorted range
    positions ``pos``, then those of :func:`zigzag_diff` of the old and new values there) and the
    zigzag values: one compiled pass for elements of 1, 2 or 4 bytes, numpy otherwise."""
    k = None if numpy or ov.itemsize == 8 else _kernels()
    if k is None:
        z = zigzag_diff(ov, nv)
        return split_planes(gaps_of(pos)) + split_planes(z), z
    m = pos.size
    gp, zp, z = k[0](np.ascontiguousarray(pos), np.ascontiguousarray(ov), np.ascontiguousarray(nv), ov.itemsize)
    return [gp[i * m:(i + 1) * m] for i in range(4)] + [zp[i * m:(i + 1) * m] for i in range(ov.itemsize)], z
