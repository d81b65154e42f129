"""Encoding one version: tensors -> blocks of compressed streams -> bounded chunks.

Pure computation: chunks are handed to a callback as soon as they are sealed, so the caller can
upload while the rest is still being encoded; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ..dtypes import dtype_name, flat_bits, np_bits
from ..errors import ConfigError
from ..format import (DENSE_SUB, INIT_BASE, INIT_NONE, PLANES, SPARSE_SUB, BlockEntry, ChunkEntry, Segment,
                      StreamEntry, TensorEntry, xxh3_128)
from . import streams
from .changes import find_changes, split_planes, zigzag_diff


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """How versions are encoded. Readers need none of this: the manifest says everything."""

    zstd_level: int = 1
    """zstd level for every stream (1-22). On byte planes level 1 is as small as 3 and twice as
    fast; 19 saves ~4% on delta streams at ~100x the time."""
    block_bytes: int = 16 << 20
    """Target decoded bytes per block (the unit decoded independently, in parallel)."""
    chunk_bytes: int = 64 << 20
    """Target size of a chunk object; a chunk holds whole blocks and is sealed once it reaches this."""
    dense_threshold: float = 0.25
    """A range whose fraction of changed elements reaches this is carried densely, not as
    positions. At most 1/2: readers refuse sparse ranges with more changed elements than that."""
    workers: int = 2
    """Threads compressing blocks (zstd releases the GIL)."""

    def __post_init__(self) -> None:
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError(f"zstd_level must be in 1..22, got {self.zstd_level}")
        if not 4096 <= self.block_bytes <= 1 << 30:
            raise ConfigError(f"block_bytes must be in [4096, 2**30] (a segment holds at most 2**31 elements), "
                              f"got {self.block_bytes}")
        if self.chunk_bytes > 1 << 34:
            raise ConfigError(f"chunk_bytes must be <= 2**34 (readers accept chunks up to 2**36), "
                              f"got {self.chunk_bytes}")
        if self.chunk_bytes < self.block_bytes:
            raise ConfigError(f"chunk_bytes ({self.chunk_bytes}) must be >= block_bytes ({self.block_bytes}): "
                              "a chunk holds whole blocks")
        if not 0.0 < self.dense_threshold <= 0.5:
            raise ConfigError(f"dense_threshold must be in (0, 0.5] (readers refuse a sparse range with more "
                              f"than half its elements changed), got {self.dense_threshold}")
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")


@dataclass(slots=True)
class _Seg:
    seg: Segment
    streams: list[np.ndarray]


@dataclass
class BaseUpdate:
    """What changed, so the publisher can bring its copy of the base up to date cheaply."""

    full: list[str] = field(default_factory=list)                       # copy whole tensor
    ranges: list[tuple[str, int, int]] = field(default_factory=list)   # copy [start, end)
    points: list[tuple[str, np.ndarray]] = field(default_factory=list)  # copy these positions


@dataclass
class EncodedVersion:
    tensors: list[TensorEntry]
    blocks: list[BlockEntry]
    chunks: list[ChunkEntry]
    changed_elements: int
    update: BaseUpdate


def _range_len(width: int, block_bytes: int) -> int:
    return max(4096, (block_bytes // width) // 8 * 8)


class _Packer:
    """Groups segments into blocks per (encoding, width), compresses blocks on a pool and packs
    them, in order, into chunks."""

    def __init__(self, config: CodecConfig, emit: Callable[[ChunkEntry, bytes], None], chunk_prefix: str) -> None:
        self.cfg = config
        self.chunk_prefix = chunk_prefix
        self.emit = emit
        self.pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="xc-encode")
        self.open: dict[tuple[str, int], list[_Seg]] = {}
        self.open_bytes: dict[tuple[str, int], int] = {}
        self.pending: list[tuple[str, int, list[Segment], Future]] = []
        self.blocks: list[BlockEntry] = []
        self.chunks: list[ChunkEntry] = []
        self.cur: list[bytes] = []
        self.cur_size = 0

    def add(self, encoding: str, width: int, seg: _Seg) -> None:
        key = (encoding, width)
        self.open.setdefault(key, []).append(seg)
        self.open_bytes[key] = self.open_bytes.get(key, 0) + sum(s.nbytes for s in seg.streams)
        if self.open_bytes[key] >= self.cfg.block_bytes:
            self._flush(key)

    def _flush(self, key: tuple[str, int]) -> None:
        segs = self.open.pop(key)
        self.open_bytes.pop(key)
        n_streams = len(segs[0].streams)
        level = self.cfg.zstd_level

        def work() -> list[tuple[str, bytes, int]]:
            out = []
            for i in range(n_streams):
                pieces = [s.streams[i] for s in segs]
                codec, payload = streams.compress(pieces, level=level)
                out.append((codec, payload, sum(p.nbytes for p in pieces)))
            return out

        self.pending.append((key[0], key[1], [s.seg for s in segs], self.pool.submit(work)))
        # keep memory bounded: collect finished blocks in order once a few are queued
        while len(self.pending) > 2 * self.cfg.workers:
            self._collect_one()

    def _collect_one(self) -> None:
        encoding, width, segs, fut = self.pending.pop(0)
        parts = fut.result()
        size = sum(len(p) for _, p, _ in parts)
        if self.cur and self.cur_size + size > self.cfg.chunk_bytes:
            self._seal()
        self.blocks.append(BlockEntry(len(self.chunks), self.cur_size, encoding, width,
                                      tuple(StreamEntry(c, len(p), raw) for c, p, raw in parts), tuple(segs)))
        self.cur.extend(p for _, p, _ in parts)
        self.cur_size += size

    def _seal(self) -> None:
        data = b"".join(self.cur)
        entry = ChunkEntry(f"{self.chunk_prefix}-{len(self.chunks):06d}.xc", len(data), xxh3_128(data))
        self.chunks.append(entry)
        self.cur, self.cur_size = [], 0
        self.emit(entry, data)

    def finish(self) -> None:
        try:
            for key in sorted(self.open):
                self._flush(key)
            while self.pending:
                self._collect_one()
            if self.cur:
                self._seal()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def abort(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@dataclass(slots=True)
class _Range:
    t_idx: int
    name: str
    start: int
    end: int
    full: bool  # carried as planes (new tensor, or keyframe)


def _encode_range(r: _Range, new: torch.Tensor, old: torch.Tensor | None, dense_threshold: float):
    """Scan and transform one range. Returns ``(encoding, width, seg, nnz, positions)`` or None."""
    w = new.element_size()
    nnp = np_bits(new)[r.start:r.end]
    count = r.end - r.start
    if r.full:
        return PLANES, w, _Seg(Segment(r.t_idx, r.start, count, count), split_planes(nnp)), count, None
    assert old is not None
    onp = np_bits(old)[r.start:r.end]
    pos, ov, nv = find_changes(onp, nnp)
    nnz = int(pos.size)
    if nnz == 0:
        return None
    if nnz >= dense_threshold * count:
        z = zigzag_diff(onp, nnp)
        return DENSE_SUB, w, _Seg(Segment(r.t_idx, r.start, count, count), split_planes(z)), nnz, None
    gaps = (np.diff(pos, prepend=-1) - 1).astype(np.uint32)
    z = zigzag_diff(ov, nv)
    seg = _Seg(Segment(r.t_idx, r.start, count, nnz), split_planes(gaps) + split_planes(z))
    return SPARSE_SUB, w, seg, nnz, pos + r.start


def encode_version(new: Mapping[str, torch.Tensor], digests: Mapping[str, str],
                   base: Mapping[str, torch.Tensor] | None, config: CodecConfig,
                   emit: Callable[[ChunkEntry, bytes], None], *, chunk_prefix: str = "chunk") -> EncodedVersion:
    """Encode ``new`` as a keyframe (``base is None``) or as a delta against ``base``.

    ``new`` and ``base`` hold contiguous CPU tensors. Sealed chunks, named
    ``<chunk_prefix>-NNNNNN.xc``, go to ``emit`` in order. Ranges are scanned on a pool of
    ``config.workers`` threads, a bounded window ahead; results are consumed in order, so the
    output does not depend on timing.
    """
    entries: list[TensorEntry] = []
    ranges: list[_Range] = []
    update = BaseUpdate()
    for t_idx, name in enumerate(sorted(new)):
        t = new[name]
        old = base.get(name) if base is not None else None
        same = old is not None and old.dtype == t.dtype and tuple(old.shape) == tuple(t.shape)
        entries.append(TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), digests[name],
                                   INIT_BASE if same else INIT_NONE))
        if not same:  # even when empty: the publisher's base must take the new dtype and shape
            update.full.append(name)
        rlen = _range_len(t.element_size(), config.block_bytes)
        ranges.extend(_Range(t_idx, name, s, min(s + rlen, t.numel()), not same) for s in range(0, t.numel(), rlen))

    packer = _Packer(config, emit, chunk_prefix)
    changed = 0
    window = 2 * config.workers
    try:
        with ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="xc-scan") as pool:
            def submit(r: _Range) -> Future:
                old = None if r.full or base is None else base[r.name]
                return pool.submit(_encode_range, r, new[r.name], old, config.dense_threshold)

            queue = [submit(r) for r in ranges[:window]]
            for i, r in enumerate(ranges):
                out = queue[i].result()
                queue[i] = None  # type: ignore[call-overload]  # drop the reference: bounded memory
                if i + window < len(ranges):
                    queue.append(submit(ranges[i + window]))
                if out is None:
                    continue
                encoding, w, seg, nnz, pos = out
                changed += nnz
                packer.add(encoding, w, seg)
                if encoding == DENSE_SUB:
                    update.ranges.append((r.name, r.start, r.end))
                elif encoding == SPARSE_SUB:
                    update.points.append((r.name, pos))
        packer.finish()
    except BaseException:
        packer.abort()
        raise
    return EncodedVersion(entries, packer.blocks, packer.chunks, changed, update)


def apply_update(base: dict[str, torch.Tensor], new: Mapping[str, torch.Tensor], update: BaseUpdate) -> None:
    """Bring the publisher's private copy ``base`` to ``new`` using what the encoder found changed."""
    for name in [n for n in base if n not in new]:
        del base[name]
    for name in update.full:
        base[name] = new[name].clone()
    for name, s, e in update.ranges:
        flat_bits(base[name])[s:e] = flat_bits(new[name])[s:e]
    for name, pos in update.points:
        b, n = np_bits(base[name]), np_bits(new[name])
        b[pos] = n[pos]
