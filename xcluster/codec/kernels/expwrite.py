"""Writing one ``sparse-exp2`` segment (FORMAT.md §5a) in compiled code from end to end.

:func:`..encodings.sparse_exp2.build` writes a segment in numpy steps around the compiled ranks pass and Rice
coder (:mod:`.exprank`): sort the changes by group, count them, derive the Rice parameters, split
the counts into byte planes, pack the sign bits, take the magnitudes. Per segment that is
about 25 numpy calls, each holding the GIL while the other scan worker may wait for it. Here one
compiled loop takes their place (the changes in position order in; the counts piece, the ranks
in change order, the sign piece and the magnitudes out), so a segment is four compiled calls:
ranks, this, the Rice coder and the magnitude coder (:mod:`.rans`). The bytes are the numpy steps' exactly; without numba (or with it turned off)
those steps do the work.
"""

from __future__ import annotations

import numpy as np

from ..streams import incompressible
from . import exprank, jit, rans


def _pack(grp, rank, sizes, z, ng):
    """For changes in position order (their groups ``grp``, ranks ``rank``, zigzag values ``z``)
    and the group sizes ``sizes``: ``(counts piece, ranks in change order, changes per present
    group, their Rice parameters, sign piece, magnitudes in change order)``."""
    m = grp.size
    counts = np.zeros(ng, np.int64)
    for j in range(m):
        counts[grp[j]] += 1
    nxt = np.zeros(ng, np.int64)  # each group's next slot in change order
    present = 0
    for g in range(ng):
        if counts[g]:
            present += 1
        if g + 1 < ng:
            nxt[g + 1] = nxt[g] + counts[g]
    piece = np.zeros(5 * ng, np.uint8)
    n = np.empty(present, np.int64)
    k = np.empty(present, np.int64)
    i = 0
    for g in range(ng):
        c = counts[g]
        for b in range(4):
            piece[b * ng + g] = (c >> (8 * b)) & 0xFF
        if c:  # rice_k: the bit length of floor(size · 31537 / (n · 65536))
            x = (sizes[g] * 31537) // (c * 65536)
            kg = 0
            while x:
                x >>= 1
                kg += 1
            piece[4 * ng + g] = kg
            n[i] = c
            k[i] = kg
            i += 1
    ranks = np.empty(m, np.int64)
    zc = np.empty(m, np.int64)
    for j in range(m):  # position order within each group: ranks ascend
        s = nxt[grp[j]]
        nxt[grp[j]] = s + 1
        ranks[s] = rank[j]
        zc[s] = z[j]
    nb = (m + 7) >> 3
    sign = np.zeros(nb, np.uint8)
    mag = np.empty(m, np.int64)
    for s in range(m):
        v = zc[s]
        sign[s >> 3] |= np.uint8((v & 1) << (s & 7))
        mag[s] = (v + 1) >> 1
    return piece, ranks, n, k, sign, mag


def _smoke(loops) -> None:
    """Changes at ranks 1 (group 0x7F, z 2) and 0 (group 0x80, z 1), position order reversed."""
    sizes = np.zeros(256, np.int64)
    sizes[0x7F] = sizes[0x80] = 2
    piece, ranks, n, k, sign, mag = loops[0](np.array([0x80, 0x7F], np.int64), np.array([0, 1], np.int64),
                                             sizes, np.array([1, 2], np.uint16), 256)
    if (piece[0x7F] != 1 or piece[0x80] != 1 or piece.sum() != 2 or ranks.tolist() != [1, 0]
            or n.tolist() != [1, 1] or k.tolist() != [0, 0] or sign.tolist() != [0b10] or mag.tolist() != [1, 1]):
        raise RuntimeError("the compiled sparse-exp2 writer disagrees with FORMAT.md §5a")


@jit.once
def _kernels():
    return jit.compile_loops(lambda c: (c(_pack),), _smoke)


def compiled() -> bool:
    """Whether the compiled writer is in use."""
    return _kernels() is not None and exprank.compiled() and rans.compiled()


def build(old: np.ndarray, pos: np.ndarray, z: np.ndarray, shift: int, mask: int) -> list[np.ndarray] | None:
    """The five ``sparse-exp2`` pieces of one segment: the base range ``old`` (unsigned raw bits),
    the sorted relative positions of its changes and their zigzag values (position order); None
    without the compiled writer."""
    loops, kern = _kernels(), exprank.kernels()
    if loops is None or kern is None or not rans.compiled():
        return None
    t = old.dtype.type
    grp, rank, sizes = kern.ranks(np.ascontiguousarray(old), np.ascontiguousarray(pos, dtype=np.int64), t(shift),
                                  t(mask), mask + 1)
    piece, ranks, n, k, sign, mag = loops[0](grp, rank, sizes, np.ascontiguousarray(z), mask + 1)
    unary, rem = kern.rice_code(ranks, n, k)
    return [piece, unary, rem, sign, incompressible(rans.encode(mag, old.dtype.itemsize))]
