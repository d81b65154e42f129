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
from dataclasses import dataclass

import numpy as np
import torch

from .dtypes import UINT, np_bits, np_bytes
from ..errors import DecodeError
from ..format import DENSE_SUB, FULL_EXP, GAP_WIDTH, PLANES, SPARSE_EXP2, SPARSE_SUB, BlockEntry, TensorEntry
from . import expgroup, fullexp, streams
from .changes import unzigzag
from .scatter import PIECE, scatter_add, scatter_gaps



@dataclass(slots=True)
class Fill:
    """Raw values for elements ``[start, start + count)`` of a tensor built from scratch: the byte
    planes of their raw bits, or (one array of the tensor's width) the raw bits themselves."""

    tensor: int
    start: int
    planes: list[np.ndarray]


@dataclass(slots=True)
class Patch:
    """Add ``diff`` (wrapping) to the raw bits of elements from ``start`` on: the dense range
    ``[start, start + diff.size)`` when ``gaps`` is None, else the positions the gaps give
    (``p_0 = start + gaps[0]``, ``p_k = p_(k-1) + gaps[k] + 1``)."""

    tensor: int
    start: int
    gaps: np.ndarray | None
    diff: np.ndarray


@dataclass(slots=True)
class Scatter:
    """Add ``diff`` (wrapping) to the raw bits of elements ``positions`` (absolute, distinct)."""

    tensor: int
    positions: np.ndarray
    diff: np.ndarray


def block_memory(block: BlockEntry) -> int:
    """Bytes decoding ``block`` holds at its peak (from the manifest's checked sizes alone)."""
    raw = [s.raw for s in block.streams]
    if block.encoding == SPARSE_EXP2:
        # the streams and the unpacked quotient bits; per segment its groups, a group's membership
        # mask and bitmap with prefix counts (3 bytes per element); per change about 10 int64
        # temporaries, the values, its remainder bits unpacked (at most 31) and a 64-byte word
        # unpacked three times while its rank is selected (192)
        nnz = sum(s.nnz for s in block.segments)
        longest = max(s.count for s in block.segments)
        return sum(raw) + 8 * raw[1] + 3 * longest + nnz * (80 + 3 * block.width + 31 + 192)
    if block.encoding == PLANES:
        return sum(raw)  # the planes themselves, applied as views
    if block.encoding == FULL_EXP:
        # the streams, the decoded values (held until the block is applied) and a segment's tables
        return sum(raw) + block.width * sum(s.count for s in block.segments) + 64 * 1024
    n = raw[-1]  # elements carried: count (dense) or nnz (sparse)
    held = n * block.width + (n * GAP_WIDTH if block.encoding == SPARSE_SUB else 0)
    return held + max(raw) + 16 * min(n, PIECE)  # + one plane in flight + a piece's positions


def decode_block(block: BlockEntry, chunk: bytes | memoryview, tensors: Sequence[TensorEntry],
                 *, where: str, base: Sequence[torch.Tensor | None] = (),
                 into: Mapping[int, torch.Tensor] | None = None) -> list[Fill | Patch | Scatter]:
    """Decode one block from its chunk's bytes (checksum already verified). ``base[i]`` is the
    tensor the reader holds for tensor ``i`` of the manifest (the base version's, before this
    version's patches land on the block's ranges): ``sparse-exp2`` groups its elements by it.

    ``into[i]``, where given, is the (contiguous, host) tensor that tensor ``i`` is being built
    in from scratch: ``full-exp`` segments of it are decoded straight into it,
    saving a copy, and give no operation. Only for tensors nobody reads yet: a block that fails
    may have written part of them."""
    mv = memoryview(chunk)
    offsets = [block.offset]
    for s in block.streams:
        offsets.append(offsets[-1] + s.stored)

    def stream(i: int) -> np.ndarray:
        s = block.streams[i]
        return streams.decompress(s.codec, mv[offsets[i]:offsets[i + 1]], s.raw, where=f"{where} stream {i}")

    def joined(first: int, width: int, dtype) -> np.ndarray:
        """Streams ``first … first+width-1`` as byte planes of one new array of ``dtype``."""
        n = block.streams[first].raw
        out = np.empty(n, dtype=dtype)
        lanes = out.view(np.uint8).reshape(n, width)
        for i in range(width):
            lanes[:, i] = stream(first + i)  # one decompressed plane alive at a time
        return out

    w = block.width
    udt = UINT[w]
    ops: list[Fill | Patch] = []
    cursor = 0
    if block.encoding == PLANES:
        planes = [stream(i) for i in range(w)]
        for seg in block.segments:
            ops.append(Fill(seg.tensor, seg.start, [p[cursor:cursor + seg.count] for p in planes]))
            cursor += seg.count
        return ops
    if block.encoding == FULL_EXP:  # the symbols inflated a piece at a time, as they are joined
        sym = block.streams[1]
        reader = fullexp.SegmentReader([stream(0), streams.Reader(sym.codec, mv[offsets[1]:offsets[2]], sym.raw,
                                                                  where=f"{where} stream 1"),
                                        stream(2), stream(3)], where=where)
        for seg in block.segments:
            dst = into.get(seg.tensor) if into is not None else None
            if dst is None:
                ops.append(Fill(seg.tensor, seg.start, [reader.segment(seg.count, tensors[seg.tensor].name)]))
            else:
                reader.segment(seg.count, tensors[seg.tensor].name, out=np_bits(dst)[seg.start:seg.start + seg.count])
        reader.finish()
        return ops
    if block.encoding == DENSE_SUB:
        diff = _unzigzag_inplace(joined(0, w, udt))
        for seg in block.segments:
            ops.append(Patch(seg.tensor, seg.start, None, diff[cursor:cursor + seg.count]))
            cursor += seg.count
        return ops
    if block.encoding == SPARSE_EXP2:
        reader = expgroup.SegmentReader([stream(i) for i in range(len(block.streams))], w, where)
        for seg in block.segments:
            t = base[seg.tensor] if seg.tensor < len(base) else None
            if t is None:
                raise DecodeError(f"{where}: {block.encoding} needs the base of {tensors[seg.tensor].name}")
            old = np_bits(t)[seg.start:seg.start + seg.count]
            pos, z = reader.segment(old, seg.nnz, tensors[seg.tensor].dtype, udt)
            pos += seg.start
            ops.append(Scatter(seg.tensor, pos, unzigzag(z)))
        reader.finish()
        return ops
    if block.encoding != SPARSE_SUB:  # pragma: no cover - format validation rejects it
        raise DecodeError(f"{where}: unknown encoding {block.encoding!r}")
    gaps = joined(0, GAP_WIDTH, np.uint32)
    for seg in block.segments:  # every position inside its segment, before any is applied
        last = int(gaps[cursor:cursor + seg.nnz].sum(dtype=np.uint64)) + seg.nnz - 1
        if last >= seg.count:
            raise DecodeError(f"{where}: changed position {seg.start + last} of {tensors[seg.tensor].name} lies "
                              f"outside its segment [{seg.start}, {seg.start + seg.count})")
        cursor += seg.nnz
    diff = _unzigzag_inplace(joined(GAP_WIDTH, w, udt))
    cursor = 0
    for seg in block.segments:
        ops.append(Patch(seg.tensor, seg.start, gaps[cursor:cursor + seg.nnz], diff[cursor:cursor + seg.nnz]))
        cursor += seg.nnz
    return ops


def _unzigzag_inplace(z: np.ndarray) -> np.ndarray:
    for s in range(0, z.size, PIECE):
        z[s:s + PIECE] = unzigzag(z[s:s + PIECE])
    return z


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
