"""Reading one ``sparse-exp2`` segment (FORMAT.md §5a) in compiled code from end to end.

:class:`..encodings.sparse_exp2.SegmentReader` reads a segment in a dozen numpy steps around the compiled Rice
decoder and select (:mod:`.exprank`): parse the counts, check the Rice parameters, unpack the sign
bits, decode the magnitudes, put the values in element order. On real weights those steps cost
more than half as much as the select's pass over the range itself (per segment about 100 µs, per
change about 25 ns), and each holds the GIL while the other decode worker may wait for it. Here two compiled
loops take their place: the counts piece in, the groups with changes out; the sign piece and the
magnitudes (:mod:`.rans`) in, the values in element order out. A segment is five compiled calls,
the GIL released in each.

Every check of the numpy steps is made, but a failed one only makes :func:`read` return None:
the caller then reads the segment again the numpy way, which raises the precise
:class:`~xcluster.errors.DecodeError`. Without numba (or with it turned off) there are no loops
and the numpy steps do all the work, with the same results.
"""

from __future__ import annotations

import numpy as np

from . import exprank, jit, rans


def _counts(counts, at, ng, nnz):
    """The groups with changes, their numbers of changes, Rice parameters and first change
    (``starts``, one longer) from the counts piece at byte ``at``; ``ok`` False when the piece is
    short, a parameter is over 31 or set for a group without changes, or the counts do not add
    up to ``nnz``."""
    present = np.empty(ng, np.int64)
    ns = np.empty(ng, np.int64)
    ks = np.empty(ng, np.int64)
    starts = np.zeros(ng + 1, np.int64)
    if at + 5 * ng > counts.size:
        return present[:0], ns[:0], ks[:0], starts[:1], False
    j = 0
    for g in range(ng):
        n = (np.int64(counts[at + g]) | np.int64(counts[at + ng + g]) << 8
             | np.int64(counts[at + 2 * ng + g]) << 16 | np.int64(counts[at + 3 * ng + g]) << 24)
        k = np.int64(counts[at + 4 * ng + g])
        if (n == 0 and k != 0) or k > 31:
            return present[:0], ns[:0], ks[:0], starts[:1], False
        if n:
            present[j] = g
            ns[j] = n
            ks[j] = k
            starts[j + 1] = starts[j] + n
            j += 1
    return present[:j], ns[:j], ks[:j], starts[:j + 1], starts[j] == nnz


def _values(signs, scur, mag, nnz, width, idx, z):
    """The zigzag values of ``nnz`` changes (change order) from the sign piece at byte ``scur``
    and their magnitudes ``mag``, written to ``z`` in element order (``z[h]`` gets change
    ``idx[h]``'s). Returns 0, or -1 when the sign piece is short, a padding bit is set or a
    magnitude is out of range."""
    nb = (nnz + 7) >> 3
    if scur + nb > signs.size:
        return -1
    if nnz & 7 and signs[scur + nb - 1] >> (nnz & 7):
        return -1  # padding bits
    full = (np.int64(1) << (8 * width)) - 1
    zc = np.empty(nnz, np.int64)  # change order
    for i in range(nnz):
        s = np.int64(signs[scur + (i >> 3)] >> (i & 7)) & 1
        v = 2 * mag[i] - s
        if v > full:
            return -1
        zc[i] = v
    for h in range(nnz):
        z[h] = zc[idx[h]]
    return 0


def _smoke(loops) -> None:
    """One segment of two changes: group 0x7F (rank 1, z 2) and group 0x80 (rank 0, z 1)."""
    counts_, values = loops
    counts = np.zeros(5 * 256, np.uint8)
    counts[0x7F] = counts[0x80] = 1
    counts[4 * 256 + 0x7F] = counts[4 * 256 + 0x80] = 1
    present, ns, ks, starts, ok = counts_(counts, 0, 256, 2)
    z = np.zeros(2, np.uint16)
    # change order: z 2 (sign 0), z 1 (sign 1); in element order the second comes first
    bad = values(np.array([0b10], np.uint8), 0, np.ones(2, np.int64), 2, 2, np.array([1, 0], np.int64), z)
    if (not ok or present.tolist() != [0x7F, 0x80] or ns.tolist() != [1, 1] or ks.tolist() != [1, 1]
            or starts.tolist() != [0, 1, 2] or bad != 0 or z.tolist() != [1, 2]):
        raise RuntimeError("the compiled sparse-exp2 reader disagrees with FORMAT.md §5a")


@jit.once
def _kernels():
    return jit.compile_loops(lambda c: (c(_counts), c(_values)), _smoke)


def compiled() -> bool:
    """Whether the compiled reader is in use."""
    return _kernels() is not None and exprank.compiled() and rans.compiled()


def read(streams: list[np.ndarray], cursors: list[int], old: np.ndarray, nnz: int, shift: int, mask: int,
         width: int) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """One ``sparse-exp2`` segment of ``nnz`` changes whose pieces begin at ``cursors`` in the
    block's five decoded ``streams``, over the base range ``old`` (unsigned raw bits):
    ``(positions, z, cursors after it)``, positions relative and ascending, ``z`` the zigzag values
    in the same order. None when a check fails (the caller reads it again with numpy to say which)
    or when there is no compiled reader."""
    loops, kern = _kernels(), exprank.kernels()
    if loops is None or kern is None or not rans.compiled():
        return None
    ng = mask + 1
    present, n, k, starts, ok = loops[0](streams[0], cursors[0], ng, nnz)
    if not ok:
        return None
    ranks, uend, rend, err = kern.rice(streams[1], cursors[1], streams[2], cursors[2], n, k)
    if err:
        return None
    t = old.dtype.type
    select = exprank.select_loop(kern, nnz, old.size)
    pos, idx, ok = select(np.ascontiguousarray(old), present, starts, ranks, t(shift), t(mask), ng)
    if not ok:
        return None
    z = np.empty(nnz, dtype=old.dtype)
    mag, mend = rans.decode(streams[4], cursors[4], nnz, width)
    if mend < 0 or loops[1](streams[3], cursors[3], mag, nnz, width, idx, z) < 0:
        return None
    return pos, z, [cursors[0] + 5 * ng, uend, rend, cursors[3] + (nnz + 7) // 8, mend]
