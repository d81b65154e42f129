"""``sparse-sub`` (core, sparse): a range's changed positions as uint32 gaps (4 byte planes) and
the zigzag of ``new - old`` at each as ``width`` byte planes (FORMAT.md §5b).

Gap ``k`` of a segment is ``p_k - p_(k-1) - 1`` (``p_(-1) = -1``, positions relative to the
segment's start); every position must fall inside its segment.
"""

from __future__ import annotations

import numpy as np

from ...errors import DecodeError
from ..kernels.changes import UINT
from ..encoding import SPARSE, BlockStreams, Core, DecodeInput, Op, Patch, register
from ..kernels.changes import join_planes, sparse_sub_pieces, unzigzag
from ..kernels.scatter import PIECE

NAME = "sparse-sub"
GAP_WIDTH = 4
"""Gaps are uint32: 4 byte planes."""


def unzigzag_inplace(z: np.ndarray) -> np.ndarray:
    for s in range(0, z.size, PIECE):
        z[s:s + PIECE] = unzigzag(z[s:s + PIECE])
    return z


class SparseSub(Core):
    name, kind = NAME, SPARSE

    def stream_lengths(self, width, segments, dtypes):
        nnz = sum(s.nnz for s in segments)
        return [(nnz, True)] * (GAP_WIDTH + width)

    def memory(self, block) -> int:
        n = block.streams[-1].raw  # the changes carried
        return n * (block.width + GAP_WIDTH) + max(s.raw for s in block.streams) + 16 * min(n, PIECE)

    @staticmethod
    def diffs(pieces: list[np.ndarray], width: int) -> np.ndarray:
        """The zigzag differences of a range from its pieces."""
        return join_planes(pieces[GAP_WIDTH:], UINT[width])

    @staticmethod
    def encode(pos: np.ndarray, ov: np.ndarray, nv: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """The pieces of one range from its changed positions (relative) and old and new values
        there, and the zigzag differences (which other sparse encodings start from)."""
        return sparse_sub_pieces(pos, ov, nv)

    def decode(self, streams: BlockStreams, d: DecodeInput) -> list[Op]:
        block = streams.block
        gaps = streams.joined(0, GAP_WIDTH, np.uint32)
        cursor = 0
        for seg in block.segments:  # every position inside its segment, before any is applied
            last = int(gaps[cursor:cursor + seg.nnz].sum(dtype=np.uint64)) + seg.nnz - 1
            if last >= seg.count:
                raise DecodeError(f"{d.where}: changed position {seg.start + last} of {d.tensors[seg.tensor].name} "
                                  f"lies outside its segment [{seg.start}, {seg.start + seg.count})")
            cursor += seg.nnz
        w = block.width
        diff = unzigzag_inplace(streams.joined(GAP_WIDTH, w, UINT[w]))
        ops: list[Op] = []
        cursor = 0
        for seg in block.segments:
            ops.append(Patch(seg.tensor, seg.start, gaps[cursor:cursor + seg.nnz], diff[cursor:cursor + seg.nnz]))
            cursor += seg.nnz
        return ops


ENCODING = register(SparseSub())
