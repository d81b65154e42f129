"""``dense-sub`` (core, dense): the zigzag of ``new - old`` (wrapping, on the raw bits) of every
element of a range, as ``width`` byte planes (FORMAT.md §5c). Written where a range's changed
fraction reaches ``CodecConfig.dense_threshold``.
"""

from __future__ import annotations

import numpy as np

from ..kernels.changes import UINT
from ..encoding import DENSE, BlockStreams, Core, DecodeInput, Op, Patch, register
from ..kernels.changes import split_planes, zigzag_diff
from ..kernels.scatter import PIECE
from .sparse_sub import unzigzag_inplace

NAME = "dense-sub"


class DenseSub(Core):
    name, kind = NAME, DENSE

    def stream_lengths(self, width, segments, dtypes):
        return [(sum(s.count for s in segments), True)] * width

    def memory(self, block) -> int:
        n = block.streams[-1].raw
        return n * block.width + max(s.raw for s in block.streams) + 16 * min(n, PIECE)

    @staticmethod
    def encode(old: np.ndarray, new: np.ndarray) -> list[np.ndarray]:
        """The pieces of one range from its old and new raw bits."""
        return split_planes(zigzag_diff(old, new))

    def decode(self, streams: BlockStreams, d: DecodeInput) -> list[Op]:
        w = streams.block.width
        diff = unzigzag_inplace(streams.joined(0, w, UINT[w]))
        ops: list[Op] = []
        cursor = 0
        for seg in streams.block.segments:
            ops.append(Patch(seg.tensor, seg.start, None, diff[cursor:cursor + seg.count]))
            cursor += seg.count
        return ops


ENCODING = register(DenseSub())
