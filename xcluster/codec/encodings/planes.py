"""``planes`` (core, fill): the raw bits of whole values as ``width`` byte planes (FORMAT.md §5a).

Stream ``i`` holds byte ``i`` (little-endian) of every element of the block's segments, in order;
each plane decodes to exactly one byte per element.
"""

from __future__ import annotations

import numpy as np

from ..encoding import FILL, BlockStreams, Core, DecodeInput, Fill, Op, register
from ..kernels.changes import split_planes

NAME = "planes"


class Planes(Core):
    name, kind = NAME, FILL

    def stream_lengths(self, width, segments, dtypes):
        return [(sum(s.count for s in segments), True)] * width

    def memory(self, block) -> int:
        return sum(s.raw for s in block.streams)  # the planes themselves, applied as views

    @staticmethod
    def encode(bits: np.ndarray) -> list[np.ndarray]:
        """The pieces of one range of whole values (unsigned raw bits)."""
        return split_planes(bits)

    def decode(self, streams: BlockStreams, d: DecodeInput) -> list[Op]:
        planes = [streams.stream(i) for i in range(streams.block.width)]
        ops: list[Op] = []
        cursor = 0
        for seg in streams.block.segments:
            ops.append(Fill(seg.tensor, seg.start, [p[cursor:cursor + seg.count] for p in planes]))
            cursor += seg.count
        return ops


ENCODING = register(Planes())
