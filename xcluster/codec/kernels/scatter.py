"""Adding changes to raw bits at scattered positions, in place: ``bits[pos] += diff`` (or ``-=``,
to undo), wrapping, for unsigned arrays of one width; the positions given as such, or as the gaps
between them (``sparse-sub``).

numpy's fancy indexing reads every position once and writes it once more in a second pass; a
compiled loop (numba, codec/kernels/jit.py) does both in one and releases the GIL, which halves the cost
of patching a delta. From gaps, the loop also saves the positions array and four numpy calls
(about 20 µs) per segment: a delta of small tensors has hundreds of segments. Without numba the
numpy expressions give the same result.
"""

from __future__ import annotations

import numpy as np

from . import jit


def _add(bits, pos, diff):
    for i in range(pos.size):
        bits[pos[i]] += diff[i]


def _subtract(bits, pos, diff):
    for i in range(pos.size):
        bits[pos[i]] -= diff[i]


def _add_gaps(bits, first, gaps, diff):
    p = first - 1
    for i in range(gaps.size):
        p += np.int64(gaps[i]) + 1
        bits[p] += diff[i]


def _subtract_gaps(bits, first, gaps, diff):
    p = first - 1
    for i in range(gaps.size):
        p += np.int64(gaps[i]) + 1
        bits[p] -= diff[i]


def _smoke(loops) -> None:
    """Run the compiled loops once (a broken numba fails here, not in the middle of a version)."""
    bits = np.array([0, 7, 0xFFFF], dtype=np.uint16)
    pos = np.array([0, 2], dtype=np.int64)
    loops[0](bits, pos, np.array([1, 3], dtype=np.uint16))
    loops[1](bits, pos[:1], np.array([2], dtype=np.uint16))
    loops[2](bits, 1, np.array([0, 0], dtype=np.uint32), np.array([1, 2], dtype=np.uint16))  # elements 1, 2
    loops[3](bits, 2, np.array([0], dtype=np.uint32), np.array([4], dtype=np.uint16))
    if bits.tolist() != [0xFFFF, 8, 0]:
        raise RuntimeError("scatter loops disagree with wrapping arithmetic")


@jit.once
def _kernels():
    return jit.compile_loops(lambda c: (c(_add), c(_subtract), c(_add_gaps), c(_subtract_gaps)), _smoke)


def compiled() -> bool:
    """Whether the compiled loops are in use."""
    return _kernels() is not None


def scatter_add(bits: np.ndarray, pos: np.ndarray, diff: np.ndarray, *, subtract: bool = False,
                numpy: bool = False) -> None:
    """``bits[pos] += diff`` (``subtract``: ``-=``) in place, wrapping; ``pos`` distinct and in
    range (the decoder checked them), ``diff`` of ``bits``' dtype."""
    k = None if numpy else _kernels()
    if k is None or pos.dtype.kind not in "iu":
        bits[pos] = bits[pos] - diff if subtract else bits[pos] + diff
        return
    k[1 if subtract else 0](bits, pos, diff)


PIECE = 1 << 18
"""Changed elements expanded to int64 positions (and unzigzagged, by the decoder) at a time
where there is no compiled loop."""


def scatter_gaps(bits: np.ndarray, start: int, gaps: np.ndarray, diff: np.ndarray, *, subtract: bool = False,
                 numpy: bool = False) -> None:
    """``bits[p_k] += diff[k]`` (``subtract``: ``-=``) in place, wrapping, at the positions the
    uint32 ``gaps`` give: ``p_0 = start + gaps[0]``, ``p_k = p_(k-1) + gaps[k] + 1`` (the decoder
    checked that they stay inside ``bits``)."""
    k = None if numpy else _kernels()
    if k is not None:
        k[3 if subtract else 2](bits, start, gaps, diff)
        return
    last = start - 1  # the position before this piece's first
    for s in range(0, gaps.size, PIECE):
        # gap + 1 fits in uint32: the decoder checked sum(gaps) + nnz <= count <= 2**31
        pos = np.cumsum(gaps[s:s + PIECE] + np.uint32(1), dtype=np.int64)
        pos += last
        last = int(pos[-1])
        scatter_add(bits, pos, diff[s:s + PIECE], subtract=subtract, numpy=True)
