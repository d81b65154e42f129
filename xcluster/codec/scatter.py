"""Adding changes to raw bits at scattered positions, in place: ``bits[pos] += diff`` (or ``-=``,
to undo), wrapping, for unsigned arrays of one width.

numpy's fancy indexing reads every position once and writes it once more in a second pass; a
compiled loop (numba, codec/jit.py) does both in one and releases the GIL, which halves the cost
of patching a delta. Without numba the numpy expression gives the same result.
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


def _smoke(loops) -> None:
    """Run the compiled loops once (a broken numba fails here, not in the middle of a version)."""
    bits = np.array([0, 7, 0xFFFF], dtype=np.uint16)
    pos = np.array([0, 2], dtype=np.int64)
    loops[0](bits, pos, np.array([1, 3], dtype=np.uint16))
    loops[1](bits, pos[:1], np.array([2], dtype=np.uint16))
    if bits.tolist() != [0xFFFF, 7, 2]:
        raise RuntimeError("scatter loops disagree with wrapping arithmetic")


@jit.once
def _kernels():
    return jit.compile_loops(lambda c: (c(_add), c(_subtract)), _smoke)


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
