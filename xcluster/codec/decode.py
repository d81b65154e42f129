"""Decoding blocks into operations, and applying them (in place, reversibly) to tensors.

Decoding validates everything (stream sizes, positions in range) before any tensor is touched;
applying a delta is ``bits[pos] += diff`` on unsigned views, so it is undone exactly by
``bits[pos] -= diff`` if a later check fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..dtypes import UINT, np_bits, np_bytes
from ..errors import DecodeError
from ..format import DENSE_SUB, GAP_WIDTH, PLANES, SPARSE_SUB, BlockEntry, TensorEntry
from . import streams
from .changes import join_planes, unzigzag


@dataclass(slots=True)
class Fill:
    """Raw values for elements ``[start, start + count)`` of a tensor built from scratch."""

    tensor: int
    start: int
    planes: list[np.ndarray]


@dataclass(slots=True)
class Patch:
    """Add ``diff`` (wrapping) to the raw bits at ``positions`` (absolute), or, when
    ``positions`` is None, to the dense range starting at ``start``."""

    tensor: int
    start: int
    positions: np.ndarray | None
    diff: np.ndarray


def decode_block(block: BlockEntry, chunk: bytes | memoryview, tensors: Sequence[TensorEntry],
                 *, where: str) -> list[Fill | Patch]:
    """Decode one block from its chunk's bytes (checksum already verified)."""
    mv = memoryview(chunk)
    decoded: list[np.ndarray] = []
    off = block.offset
    for i, s in enumerate(block.streams):
        decoded.append(streams.decompress(s.codec, mv[off:off + s.stored], s.raw, where=f"{where} stream {i}"))
        off += s.stored
    w = block.width
    udt = UINT[w]
    ops: list[Fill | Patch] = []
    cursor = 0
    for seg in block.segments:
        name = tensors[seg.tensor].name
        if block.encoding == PLANES:
            ops.append(Fill(seg.tensor, seg.start, [p[cursor:cursor + seg.count] for p in decoded]))
            cursor += seg.count
        elif block.encoding == DENSE_SUB:
            z = join_planes([p[cursor:cursor + seg.count] for p in decoded], udt)
            ops.append(Patch(seg.tensor, seg.start, None, unzigzag(z)))
            cursor += seg.count
        elif block.encoding == SPARSE_SUB:
            n = seg.nnz
            gaps = join_planes([p[cursor:cursor + n] for p in decoded[:GAP_WIDTH]], np.uint32)
            pos = np.cumsum(gaps.astype(np.int64) + 1) - 1 + seg.start
            if pos[-1] >= seg.start + seg.count:
                raise DecodeError(f"{where}: changed position {int(pos[-1])} of {name} lies outside its "
                                  f"segment [{seg.start}, {seg.start + seg.count})")
            z = join_planes([p[cursor:cursor + n] for p in decoded[GAP_WIDTH:]], udt)
            ops.append(Patch(seg.tensor, seg.start, pos, unzigzag(z)))
            cursor += n
        else:  # pragma: no cover - format validation rejects it
            raise DecodeError(f"{where}: unknown encoding {block.encoding!r}")
    return ops


def fill(target: torch.Tensor, op: Fill) -> None:
    w = target.element_size()
    dst = np_bytes(target).reshape(-1, w)
    count = op.planes[0].size
    for i, plane in enumerate(op.planes):
        dst[op.start:op.start + count, i] = plane


def patch(target: torch.Tensor, op: Patch, *, undo: bool = False) -> None:
    bits = np_bits(target)
    if op.positions is None:
        view = bits[op.start:op.start + op.diff.size]
        if undo:
            view -= op.diff
        else:
            view += op.diff
    else:
        bits[op.positions] = bits[op.positions] - op.diff if undo else bits[op.positions] + op.diff
