"""Encoding one version: tensors -> blocks of compressed streams -> bounded chunks.

Pure computation: chunks are handed to a callback as soon as they are sealed, so the caller can
upload while the rest is still being encoded; nothing here does I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from .dtypes import UINT, dtype_name, flat_bits, np_bits
from ..errors import ConfigError
from ..format import INIT_BASE, INIT_NONE, BlockEntry, ChunkEntry, Segment, StreamEntry, TensorEntry, xxh3_128
from . import scan_torch, streams
from .encoding import DENSE, FILL, SPARSE, Encoding, RangeInput, core_names, core_of, get, names, offered, stored_bytes
from .encodings import dense_sub, planes, sparse_sub
from .kernels.changes import find_changes, join_planes

SCANS = ("auto", "numpy", "torch")


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """How versions are encoded. Readers need none of this: the manifest says everything."""

    zstd_level: int = 1
    """zstd level for every stream (1-22) but ``full-exp``'s symbols (always level 1, which codes
    them smallest). On byte planes level 1 is as small as 3 and twice as fast; 19 saves ~4% on
    delta streams at ~100x the time."""
    block_bytes: int = 16 << 20
    """Target decoded bytes per block (the unit decoded independently, in parallel); for
    ``sparse-exp2`` and ``full-exp`` blocks, bytes of the tensor they cover (decoding reads all of them)."""
    chunk_bytes: int = 64 << 20
    """Target size of a chunk object; a chunk holds whole blocks and is sealed once it reaches this."""
    dense_threshold: float = 0.25
    """A range whose fraction of changed elements reaches this is carried densely, not as
    positions. At most 1/2: readers refuse sparse ranges with more changed elements than that."""
    workers: int = 2
    """Threads compressing blocks (zstd releases the GIL)."""
    scan: str = "auto"
    """How changes are found: ``"numpy"`` on the host (the publisher copies CUDA tensors there
    first); ``"torch"`` with torch ops on the tensors' own device, so only the changes cross to
    the host (codec/scan_torch.py); ``"auto"``: torch for tensors that are not on the CPU, numpy
    for the rest. All three write the same bytes."""

    encodings: tuple[str, ...] = field(default_factory=names)
    """The encodings this writer may use (docs/FORMAT.md §5); it always writes the smallest of those
    allowed, per range. Must hold the core (``planes``, ``sparse-sub``, ``dense-sub``). The default,
    every encoding, is the smallest: on real weights (bench/codec.py --real) ``sparse-exp2`` takes
    about 40% fewer bytes per delta than ``sparse-sub`` and ``full-exp`` makes keyframes 1.512×
    instead of 1.459× (byte planes).

    Two reasons to narrow it. Upgrades (FORMAT.md §8): a reader refuses a manifest naming an
    encoding it lacks, so a fleet upgrades every reader before its writers allow a new encoding.
    Speed: applying ``sparse-exp2`` reads every element of a range (about 0.5 ns each, one pass
    over the base), ``sparse-sub`` only the changes; measured with numba, 1% changed, 2 cores:
    apply 2.4-2.6 GB/s against 3.6-3.7 GB/s, encode 1.3-1.4 GB/s against about 2 (bench/apply.py).
    A node far from its WAN limit may prefer ``("dense-sub", "full-exp", "planes", "sparse-sub")``."""

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
        if self.scan not in SCANS:
            raise ConfigError(f"scan must be one of {', '.join(map(repr, SCANS))}, got {self.scan!r}")
        known, core = names(), core_names()
        if any(e not in known for e in self.encodings) or not set(core) <= set(self.encodings):
            raise ConfigError(f"encodings must name only {', '.join(known)} and hold the core "
                              f"({', '.join(core)}), got {self.encodings!r}")
        object.__setattr__(self, "encodings", tuple(e for e in known if e in self.encodings))

    def scans_with_torch(self, t: torch.Tensor) -> bool:
        """Is ``t`` scanned with torch ops (on its own device) rather than on the host?"""
        return self.scan == "torch" or (self.scan == "auto" and t.device.type != "cpu")


@dataclass(slots=True)
class _Seg:
    seg: Segment
    streams: list[np.ndarray]


@dataclass
class BaseUpdate:
    """What changed, so the publisher can bring its copy of the base up to date cheaply.

    ``values`` are the new raw bits (unsigned host arrays) where the torch scan brought them to
    the host; None where they are read from the new tensor itself (the numpy scan)."""

    full: list[str] = field(default_factory=list)  # copy whole tensor
    ranges: list[tuple[str, int, int, np.ndarray | None]] = field(default_factory=list)  # [start, end), values
    points: list[tuple[str, np.ndarray, np.ndarray | None]] = field(default_factory=list)  # positions, values

    def touched(self) -> set[str]:
        """Names of the tensors this update changes."""
        return {*self.full, *(r[0] for r in self.ranges), *(p[0] for p in self.points)}


@dataclass
class EncodedVersion:
    tensors: list[TensorEntry]
    blocks: list[BlockEntry]
    chunks: list[ChunkEntry]
    changed_elements: int
    update: BaseUpdate


WINDOW_RANGES = 64
"""Tasks scanned ahead of the one being packed, at most (see :func:`scan_version`)."""

TASK_BYTES = 1 << 20
"""Consecutive ranges are scanned as one task while they hold at most this many bytes together (and
at most ``block_bytes``, so a task never holds more than a range of the window's budget): a
task handed to a worker and back costs about 100-250 µs of thread hand-offs and GIL waits, more than
scanning a small tensor (a bias, a norm: 384 elements, about 70 µs), so a model with many small
tensors was bound by the hand-offs (bench/codec.py --v2 --real: 60 of 101 tensors)."""


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
        self.cur = bytearray()  # the chunk being packed; grown in place (never joined into a copy)
        self.cur_size = 0

    def add(self, encoding: str, width: int, seg: _Seg) -> None:
        key = (encoding, width)
        self.open.setdefault(key, []).append(seg)
        # a block's size is what decoding it costs: its streams' bytes, or the bits of the range
        # where its encoding fills them or reads every element of the base (sparse-exp2), so such
        # a delta still splits into blocks that decode in parallel
        enc = get(encoding)
        work = (seg.seg.count * width if enc.kind == FILL or enc.reads_range
                else sum(s.nbytes for s in seg.streams))
        self.open_bytes[key] = self.open_bytes.get(key, 0) + work
        if self.open_bytes[key] >= self.cfg.block_bytes:
            self._flush(key)

    def _flush(self, key: tuple[str, int]) -> None:
        segs = self.open.pop(key)
        self.open_bytes.pop(key)
        n_streams = len(segs[0].streams)
        level = self.cfg.zstd_level
        enc = get(key[0])

        def work() -> list[tuple[str, bytes, int]]:
            out = []
            for i in range(n_streams):
                pieces = [s.streams[i] for s in segs]
                codec, payload = streams.compress(pieces, level=enc.stream_level(i, level))
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
        for _, p, _ in parts:
            self.cur += p
        self.cur_size += size

    def _seal(self) -> None:
        data, self.cur, self.cur_size = self.cur, bytearray(), 0
        entry = ChunkEntry(f"{self.chunk_prefix}-{len(self.chunks):06d}.xc", len(data), xxh3_128(data))
        self.chunks.append(entry)
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


@dataclass(slots=True)
class ScannedRange:
    """What the scan found in one range: its segment, ready for the packer, and the base update."""

    name: str
    start: int
    end: int
    kind: str  # FILL, DENSE or SPARSE (codec/encoding.py)
    encoding: str
    width: int
    seg: _Seg
    nnz: int
    positions: np.ndarray | None  # sparse-sub: absolute positions (uint32 or int64)
    values: np.ndarray | None  # torch scan: the new raw bits there (sparse) or of the range (dense)


def _host_bits(t: torch.Tensor, start: int, end: int) -> np.ndarray:
    """Unsigned raw bits of ``t[start:end]`` (flat) on the host: a view, or a copy of the range."""
    if t.device.type == "cpu":
        return np_bits(t)[start:end]
    return flat_bits(t)[start:end].cpu().numpy().view(UINT[t.element_size()])


def _encode_range(r: _Range, new: torch.Tensor, old: torch.Tensor | None, config: CodecConfig) -> ScannedRange | None:
    """Scan and transform one range (None: nothing changed): the scan finds which kind of range it
    is and writes it in that kind's core encoding, then the other allowed encodings of the kind
    are offered it (codec/encoding.py)."""
    w = new.element_size()
    count = r.end - r.start
    dtype = dtype_name(new.dtype)
    if config.scans_with_torch(new):
        extra = () if r.full else _offers(SPARSE, dtype, config)
        row = new.shape[-1] if new.dim() >= 2 else 0
        prepare = (lambda ob, pos: [e.on_device(ob, pos, dtype, start=r.start, row=row) for e in extra]) \
            if extra else None
        out = scan_torch.scan_range(new, None if r.full else old, r.start, r.end, config.dense_threshold, prepare)
        if out is None:
            return None
        found, pieces, nnz, pos, values, prep = out
        kind = {"planes": FILL, "dense": DENSE, "sparse": SPARSE}[found]
        ri = RangeInput(dtype, w, count, nnz, start=r.start, row=row)
        if kind == FILL and _offers(FILL, dtype, config):
            ri.bits = join_planes(pieces, UINT[w])
        elif kind == SPARSE and extra:
            ri.z = sparse_sub.SparseSub.diffs(pieces, w)
        encoding, pieces = _choose(kind, ri, pieces, config, prep)
        seg = Segment(r.t_idx, r.start, count, nnz if kind == SPARSE else count)
        return ScannedRange(r.name, r.start, r.end, kind, encoding, w, _Seg(seg, pieces), nnz, pos, values)
    nnp = _host_bits(new, r.start, r.end)
    if r.full:
        encoding, pieces = _choose(FILL, RangeInput(dtype, w, count, count, bits=nnp),
                                   lambda: planes.Planes.encode(nnp), config)
        return ScannedRange(r.name, r.start, r.end, FILL, encoding, w,
                            _Seg(Segment(r.t_idx, r.start, count, count), pieces), count, None, None)
    assert old is not None
    onp = _host_bits(old, r.start, r.end)
    pos, ov, nv = find_changes(onp, nnp)
    nnz = int(pos.size)
    if nnz == 0:
        return None
    if nnz >= config.dense_threshold * count:
        encoding, pieces = _choose(DENSE, RangeInput(dtype, w, count, count, bits=nnp, old=onp),
                                   dense_sub.DenseSub.encode(onp, nnp), config)
        return ScannedRange(r.name, r.start, r.end, DENSE, encoding, w,
                            _Seg(Segment(r.t_idx, r.start, count, count), pieces), nnz, None, None)
    pieces, z = sparse_sub.SparseSub.encode(pos, ov, nv)
    ri = RangeInput(dtype, w, count, nnz, old=onp, pos=pos, z=z, start=r.start,
                    row=new.shape[-1] if new.dim() >= 2 else 0)
    encoding, pieces = _choose(SPARSE, ri, pieces, config)
    seg = _Seg(Segment(r.t_idx, r.start, count, nnz), pieces)
    return ScannedRange(r.name, r.start, r.end, SPARSE, encoding, w, seg, nnz, _absolute(pos, r.start, new.numel()),
                        None)


def _offers(kind: str, dtype: str, config: CodecConfig) -> tuple[Encoding, ...]:
    """The non-core encodings allowed by ``config`` that may carry a ``kind`` range of ``dtype``."""
    return tuple(e for e in offered(kind, config.encodings) if e.dtypes is None or dtype in e.dtypes)


def _choose(kind: str, r: RangeInput, pieces: list[np.ndarray] | Callable[[], list[np.ndarray]],
            config: CodecConfig, device: list | None = None) -> tuple[str, list[np.ndarray]]:
    """The encoding and pieces of one range: the core encoding of ``kind`` (``pieces``), then each
    other allowed encoding of the kind offered the range and the best pieces so far, in name
    order; ``device[i]``: what the i-th one's ``on_device`` found (torch scan).

    ``pieces`` may be a function that makes them: they are then made only if an offer measures
    them or none is taken (a keyframe's byte planes, where ``full-exp`` usually wins unmeasured)."""
    enc = core_of(kind)
    made: list = []

    def core() -> list[np.ndarray]:
        if not made:
            made.append(pieces() if callable(pieces) else pieces)
        return made[0]

    best: list[np.ndarray] | None = None
    for i, e in enumerate(_offers(kind, r.dtype, config)):
        r.device = device[i] if device is not None else None
        cur = best if best is not None else (None if getattr(e, "measures_lazily", False) else core())
        got = e.offer(r, cur, (lambda enc=enc: stored_bytes(enc, core(), config.zstd_level)) if best is None else
                      (lambda enc=enc, b=best: stored_bytes(enc, b, config.zstd_level)), config)
        if got is not None:
            enc, best = e, got
    return enc.name, best if best is not None else core()


def _absolute(pos: np.ndarray, start: int, numel: int) -> np.ndarray:
    """Absolute positions of a range's changes, kept for the base update until the version is
    committed (a delta's largest array): uint32 where the tensor allows, half of int64."""
    if numel <= 1 << 32:
        return np.add(pos, start, dtype=np.uint32, casting="unsafe")
    return pos + start


def _same(t: torch.Tensor, old: torch.Tensor | None) -> bool:
    return old is not None and old.dtype == t.dtype and tuple(old.shape) == tuple(t.shape)


def _tasks(ranges: list[_Range], nbytes: list[int], limit: int) -> tuple[list[list[_Range]], list[int]]:
    """``ranges`` (of ``nbytes`` each) cut into runs of consecutive ranges holding at most ``limit``
    bytes together (a larger range alone): the tasks of :func:`scan_version`, and their bytes."""
    tasks: list[list[_Range]] = []
    sizes: list[int] = []
    for r, b in zip(ranges, nbytes):
        if tasks and sizes[-1] + b <= limit:
            tasks[-1].append(r)
            sizes[-1] += b
        else:
            tasks.append([r])
            sizes.append(b)
    return tasks, sizes


def scan_version(new: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor] | None,
                 config: CodecConfig) -> Iterator[ScannedRange]:
    """The ranges of ``new`` (sorted by name, then position) that carry something against ``base``
    (None: a keyframe), scanned on a pool of ``config.workers`` threads a bounded window ahead and
    yielded in order, so the output does not depend on timing. Tensors that are new, or whose
    dtype or shape changed, are carried whole (planes).

    The window is what ``2 × workers`` ranges of ``block_bytes`` hold (at most
    :data:`WINDOW_RANGES` tasks): many small ranges are scanned while a large one is, so a
    large tensor among small ones does not leave the other workers idle. Consecutive small ranges
    are one task (:data:`TASK_BYTES`)."""
    ranges: list[_Range] = []
    for t_idx, name in enumerate(sorted(new)):
        t = new[name]
        full = not _same(t, base.get(name) if base is not None else None)
        rlen = _range_len(t.element_size(), config.block_bytes)
        ranges.extend(_Range(t_idx, name, s, min(s + rlen, t.numel()), full) for s in range(0, t.numel(), rlen))
    budget = 2 * config.workers * config.block_bytes
    tasks, sizes = _tasks(ranges, [(r.end - r.start) * new[r.name].element_size() for r in ranges],
                          min(TASK_BYTES, config.block_bytes))

    def task(rs: list[_Range]) -> list[ScannedRange | None]:
        return [_encode_range(r, new[r.name], None if r.full or base is None else base[r.name], config) for r in rs]

    with ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="xc-scan") as pool:
        queue: deque[Future] = deque()
        held = 0  # bytes of the tasks in the queue
        nxt = 0

        def fill() -> None:
            nonlocal held, nxt
            while nxt < len(tasks) and len(queue) < WINDOW_RANGES and (not queue or held + sizes[nxt] <= budget):
                queue.append(pool.submit(task, tasks[nxt]))
                held += sizes[nxt]
                nxt += 1

        try:
            fill()
            for i in range(len(tasks)):
                outs = queue.popleft().result()  # and drop the reference: bounded memory
                held -= sizes[i]
                fill()
                for out in outs:
                    if out is not None:
                        yield out
        finally:
            for f in queue:
                f.cancel()


def encode_version(new: Mapping[str, torch.Tensor],
                   digests: Mapping[str, str] | Callable[[BaseUpdate], Mapping[str, str]],
                   base: Mapping[str, torch.Tensor] | None, config: CodecConfig,
                   emit: Callable[[ChunkEntry, bytes], None], *, chunk_prefix: str = "chunk") -> EncodedVersion:
    """Encode ``new`` as a keyframe (``base is None``) or as a delta against ``base``.

    ``new`` and ``base`` hold contiguous tensors: on the CPU for ``config.scan="numpy"``; with the
    torch scan, anywhere (a base on another device than its new tensor is brought over range by
    range). ``digests`` are the tensor digests of ``new``, or a function that computes them from the
    :class:`BaseUpdate` once the scan is done (the torch scan brings only the changes to the host).
    Sealed chunks, named ``<chunk_prefix>-NNNNNN.xc``, go to ``emit`` in order.
    """
    update = BaseUpdate()
    for name in sorted(new):
        if not _same(new[name], base.get(name) if base is not None else None):
            update.full.append(name)  # even when empty: the publisher's base must take the new dtype and shape
    packer = _Packer(config, emit, chunk_prefix)
    changed = 0
    try:
        for sr in scan_version(new, base, config):
            changed += sr.nnz
            packer.add(sr.encoding, sr.width, sr.seg)
            if sr.kind == DENSE:
                update.ranges.append((sr.name, sr.start, sr.end, sr.values))
            elif sr.kind == SPARSE:
                update.points.append((sr.name, sr.positions, sr.values))
        packer.finish()
    except BaseException:
        packer.abort()
        raise
    if callable(digests):
        digests = digests(update)
    entries = [TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), digests[name],
                           INIT_NONE if name in update.full else INIT_BASE)
               for name, t in ((n, new[n]) for n in sorted(new))]
    return EncodedVersion(entries, packer.blocks, packer.chunks, changed, update)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.device.type == "cpu" else t.cpu()


def apply_update(base: dict[str, torch.Tensor], new: Mapping[str, torch.Tensor], update: BaseUpdate) -> None:
    """Bring the publisher's host copy ``base`` to ``new`` using what the encoder found changed
    (``new`` may live on a device when the update carries the values)."""
    for name in [n for n in base if n not in new]:
        del base[name]
    for name in update.full:
        base[name] = _host_copy(new[name])
    for name, s, e, values in update.ranges:
        np_bits(base[name])[s:e] = np_bits(new[name])[s:e] if values is None else values
    for name, pos, values in update.points:
        b = np_bits(base[name])
        b[pos] = np_bits(new[name])[pos] if values is None else values
