"""Decoding blocks into operations, and applying them (in place, reversibly) to tensors.

Decoding validates everything (stream sizes, positions in range) before any tensor is touched;
applying a delta is ``bits[pos] += diff`` on unsigned views, so it is undone exactly by
``bits[pos] -= diff`` if a later check fails.

Memory: a block's byte planes are joined into one array as each is decompressed (one plane
in flight), sparse positions stay as their uint32 gaps (a compiled loop patches from them;
numpy expands them to int64 ``PIECE`` at a time), so decoding a block needs about :func:`block_memory` bytes,
a small multiple of the tensor bytes it covers (``FORMAT.md`` bounds a sparse segment's nnz to
half its count).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import torch

from .dtypes import np_bits, np_bytes
from ..format import BlockEntry, TensorEntry
from .encoding import BlockStreams, DecodeInput, Fill, Op, Patch, Scatter, check_block, get
from .kernels.scatter import scatter_add, scatter_gaps

__all__ = ["Fill", "Patch", "Scatter", "block_memory", "decode_block", "fill", "patch"]


def block_memory(block: BlockEntry) -> int:
    """Bytes decoding ``block`` holds at its peak (from the manifest's checked sizes alone)."""
    return get(block.encoding).memory(block)


def decode_block(block: BlockEntry, chunk: bytes | memoryview, tensors: Sequence[TensorEntry],
                 *, where: str, base: Sequence[torch.Tensor | None] = (),
                 into: Mapping[int, torch.Tensor] | None = None) -> list[Op]:
    """Decode one block from its chunk's bytes (checksum already verified), with the encoding the
    block names (codec/encoding.py). ``base[i]`` is the tensor the reader holds for tensor ``i`` of
    the manifest (the base version's, before this version's patches land on the block's ranges):
    ``sparse-exp2`` groups its elements by it.

    ``into[i]``, where given, is the (contiguous, host) tensor that tensor ``i`` is being built
    in from scratch: ``full-exp`` segments of it are decoded straight into it,
    saving a copy, and give no operation. Only for tensors nobody reads yet: a block that fails
    may have written part of them."""
    check_block(block, tensors, where=where)  # whoever parsed the manifest: nothing is allocated unchecked
    d = DecodeInput(tensors, where, _Bits(base), None if into is None else _BitsOf(into))
    return get(block.encoding, where=where).decode(BlockStreams(block, chunk, where), d)


class _Bits(Sequence):
    """The raw bits of each tensor of ``ts`` (or None), viewed when an encoding asks."""

    def __init__(self, ts: Sequence[torch.Tensor | None]) -> None:
        self._ts = ts

    def __len__(self) -> int:
        return len(self._ts)

    def __getitem__(self, i):
        t = self._ts[i]
        return None if t is None else np_bits(t)


class _BitsOf(Mapping):
    """``_Bits`` for a mapping of tensors."""

    def __init__(self, ts: Mapping[int, torch.Tensor]) -> None:
        self._ts = ts

    def __getitem__(self, i):
        return np_bits(self._ts[i])

    def __iter__(self):
        return iter(self._ts)

    def __len__(self) -> int:
        return len(self._ts)


def fill(target: torch.Tensor, op: Fill) -> None:
    w = target.element_size()
    if len(op.planes) == 1 and op.planes[0].itemsize == w > 1:  # the raw bits themselves
        np_bits(target)[op.start:op.start + op.planes[0].size] = op.planes[0]
        return
    dst = np_bytes(target).reshape(-1, w)
    count = op.planes[0].size
    for i, plane in enumerate(op.planes):
        dst[op.start:op.start + count, i] = plane


def patch(target: torch.Tensor, op: Patch | Scatter, *, undo: bool = False) -> None:
    bits = np_bits(target)
    if isinstance(op, Scatter):
        scatter_add(bits, op.positions, op.diff, subtract=undo)
        return
    if op.gaps is None:
        view = bits[op.start:op.start + op.diff.size]
        if undo:
            view -= op.diff
        else:
            view += op.diff
        return
    scatter_gaps(bits, op.start, op.gaps, op.diff, subtract=undo)  # decode_block checked the positions
