"""The Encoding protocol and the registry of the encodings this build reads and writes.

An encoding is one module under ``codec/encodings/`` (docs/FORMAT.md §5): its name, what kind of
range it carries, its limits (which dtypes, how long each stream decodes to), how much memory
decoding a block takes, its writer and its reader. The module registers one object with
:func:`register` when imported; ``codec/encodings/__init__.py`` imports every module of the
package, so adding an encoding touches its module, FORMAT.md and a golden test, nothing else.

The encoder's choice and the decoder's dispatch come from here:

- a range is a **fill** (whole values of a tensor built from scratch), **dense** (a difference per
  element) or **sparse** (differences at some positions); the scan decides which, from the
  tensors, and writes it in the **core** encoding of that kind (``planes``, ``dense-sub``,
  ``sparse-sub``: every reader has those);
- every other allowed encoding of that kind, in name order, is then *offered* the range and the
  best pieces so far, and answers with smaller pieces or None (its own rule: what it must save,
  when trying is not worth the time);
- a reader looks the block's encoding up by name; a name it lacks is refused by name
  (:class:`UnknownEncodingError`), before anything is fetched (:func:`check_manifest`).

torch-free: arrays in, arrays out (``read/chain.py`` and the relay check manifests with it).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import DecompressionBombError, FormatError, UnknownEncodingError
from ..format import INIT_NONE, BlockEntry, Manifest, Segment, StreamEntry, TensorEntry
from ..format import parse_manifest as _parse
from . import streams as _streams

if TYPE_CHECKING:  # pragma: no cover
    from .encode import CodecConfig

FILL, DENSE, SPARSE = "fill", "dense", "sparse"
KINDS = (FILL, DENSE, SPARSE)


# --- what decoding gives ---------------------------------------------------------------------
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


Op = Fill | Patch | Scatter


# --- what an encoding is given ---------------------------------------------------------------
class BlockStreams:
    """A block's streams, decoded on demand from its chunk's bytes (checksum already verified)."""

    def __init__(self, block: BlockEntry, chunk: bytes | memoryview, where: str) -> None:
        self.block, self.where = block, where
        self._mv = memoryview(chunk)
        self._offsets = [block.offset]
        for s in block.streams:
            self._offsets.append(self._offsets[-1] + s.stored)

    def _payload(self, i: int) -> memoryview:
        return self._mv[self._offsets[i]:self._offsets[i + 1]]

    def stream(self, i: int) -> np.ndarray:
        """Stream ``i`` decoded whole (a uint8 array of its declared raw length)."""
        s = self.block.streams[i]
        return _streams.decompress(s.codec, self._payload(i), s.raw, where=f"{self.where} stream {i}")

    def reader(self, i: int) -> _streams.Reader:
        """Stream ``i`` read front to back, inflated a piece at a time."""
        s = self.block.streams[i]
        return _streams.Reader(s.codec, self._payload(i), s.raw, where=f"{self.where} stream {i}")

    def joined(self, first: int, width: int, dtype) -> np.ndarray:
        """Streams ``first … first+width-1`` as the byte planes of one new array of ``dtype``
        (one decompressed plane alive at a time)."""
        n = self.block.streams[first].raw
        out = np.empty(n, dtype=dtype)
        lanes = out.view(np.uint8).reshape(n, width)
        for i in range(width):
            lanes[:, i] = self.stream(first + i)
        return out


@dataclass(slots=True)
class DecodeInput:
    """What a block is decoded against. ``base[i]``: the raw bits (unsigned, flat) the reader holds
    for tensor ``i`` (the base version's, before this version's patches land); ``into[i]``: the raw
    bits of tensor ``i`` being built from scratch, which a fill encoding may decode straight into
    (giving no operation for it)."""

    tensors: Sequence[TensorEntry]
    where: str
    base: Sequence[np.ndarray | None] = ()
    into: Mapping[int, np.ndarray] | None = None


@dataclass(slots=True)
class RangeInput:
    """One range offered to an encoding by the encoder (host arrays, unsigned raw bits).

    ``bits``: the new values of the range (fill ranges; None where the scan ran on a device and
    only the changes crossed); ``old``: the base's bits of the range (sparse; None likewise);
    ``pos``/``z``: the sparse range's changed positions (relative, ascending) and zigzag
    differences (None where only the core pieces were built); ``device``: what an encoding's
    :meth:`Encoding.on_device` hook computed where the tensors live; ``start``: the range's first
    element in its tensor; ``row``: the tensor's row length (its last dimension) where it has two
    or more dimensions, else 0."""

    dtype: str
    width: int
    count: int
    nnz: int
    bits: np.ndarray | None = None
    old: np.ndarray | None = None
    pos: np.ndarray | None = None
    z: np.ndarray | None = None
    device: Any = None
    start: int = 0
    row: int = 0


class Encoding(Protocol):
    """One encoding of a block (docs/FORMAT.md §5)."""

    name: str
    """Its name in manifests (``encodings`` and each block's ``encoding``)."""
    kind: str
    """:data:`FILL`, :data:`DENSE` or :data:`SPARSE`: what a segment of it carries."""
    core: bool
    """Every reader and writer has it; exactly one core encoding per kind, written by the scan."""
    dtypes: tuple[str, ...] | None
    """The tensor dtypes it may carry (None: every dtype)."""
    reads_range: bool
    """Decoding a segment reads every element of its range of the base (not only the changes):
    the encoder sizes such blocks by the range's bytes, so they still decode in parallel."""
    min_dims: int
    """Segments of it name tensors of at least this many dimensions (0: any; ``sparse-rows``: 2)."""
    measures_lazily: bool
    """:meth:`offer` reads the core pieces only through ``stored()``: it is then given None for
    ``best`` when the core pieces are not made yet, and they are made only if it measures them."""

    def stream_lengths(self, width: int, segments: Sequence[Segment], dtypes: Sequence[str]
                       ) -> list[tuple[int, bool]]:
        """Per stream of a block, the decoded length its segments (and their tensors' dtypes) fix
        and whether that length is exact (else an upper bound the decoder makes exact)."""

    def stream_level(self, stream: int, level: int) -> int:
        """The zstd level stream ``stream`` is compressed at, given the configured ``level``."""

    def memory(self, block: BlockEntry) -> int:
        """Bytes decoding ``block`` holds at its peak (from the manifest's checked sizes alone)."""

    def offer(self, r: RangeInput, best: list[np.ndarray], stored: Callable[[], int], config: CodecConfig
              ) -> list[np.ndarray] | None:
        """This encoding's stream pieces of range ``r`` where they should replace ``best`` (the
        pieces so far, ``stored()`` bytes once compressed), else None. Core encodings answer None:
        the scan writes them."""

    def on_device(self, old: Any, pos: Any, dtype: str, *, start: int, row: int) -> Any:
        """Work done with torch where the tensors live before the changes cross to the host (the
        result reaches :meth:`offer` as ``r.device``); None where it has none. ``old``/``pos``: the
        range's base bits and changed positions there; ``start``, ``row``: as in :class:`RangeInput`."""

    def decode(self, streams: BlockStreams, d: DecodeInput) -> list[Op]:
        """The operations of one block, every position and length checked before any is applied."""


def stored_bytes(enc: Encoding, pieces: Sequence[np.ndarray], level: int, *, first: int = 0) -> int:
    """Bytes ``pieces`` (streams ``first``, ``first + 1``, … of ``enc``) take stored, each compressed
    on its own at its stream's level (zstd, or raw where that is smaller)."""
    return sum(_streams.stored_size([p], level=enc.stream_level(first + i, level)) for i, p in enumerate(pieces))


class Core:
    """Defaults for an encoding the scan writes itself."""

    core = True
    dtypes: tuple[str, ...] | None = None
    reads_range = False
    measures_lazily = False
    min_dims = 0

    def stream_level(self, stream: int, level: int) -> int:
        return level

    def offer(self, r, best, stored, config) -> None:
        return None

    def on_device(self, old, pos, dtype, *, start, row) -> None:
        return None


# --- the registry ----------------------------------------------------------------------------
_REGISTRY: dict[str, Encoding] = {}


def register(enc: Encoding) -> Encoding:
    """Add ``enc`` (its module calls this once, on import)."""
    if enc.kind not in KINDS:
        raise ValueError(f"encoding {enc.name}: kind must be one of {KINDS}, got {enc.kind!r}")
    if enc.name in _REGISTRY and _REGISTRY[enc.name] is not enc:
        raise ValueError(f"encoding {enc.name} registered twice")
    _REGISTRY[enc.name] = enc
    _loaded.cache_clear()
    return enc


@functools.cache
def _loaded() -> dict[str, Encoding]:
    importlib.import_module(f"{__package__}.encodings")  # every module of it registers itself
    return dict(sorted(_REGISTRY.items()))


def registry() -> Mapping[str, Encoding]:
    """Every encoding this build has, by name (sorted)."""
    return _loaded()


def names() -> tuple[str, ...]:
    """The names of every encoding this build reads (the default of ``CodecConfig.encodings``)."""
    return tuple(registry())


def core_names() -> tuple[str, ...]:
    """The encodings every reader has (one per kind)."""
    return tuple(n for n, e in registry().items() if e.core)


def get(name: str, *, where: str = "manifest") -> Encoding:
    """The encoding named ``name``, or :class:`UnknownEncodingError` naming it."""
    enc = registry().get(name)
    if enc is None:
        raise UnknownEncodingError(
            f"{where}: uses encoding {name!r}, which this reader does not have (it reads "
            f"{', '.join(names())}): upgrade xcluster on this node; until every reader has it, publishers "
            "leave it out of CodecConfig.encodings (docs/FORMAT.md §8)")
    return enc


def core_of(kind: str) -> Encoding:
    """The core encoding of ``kind``."""
    return next(e for e in registry().values() if e.core and e.kind == kind)


def offered(kind: str, allowed: Sequence[str]) -> tuple[Encoding, ...]:
    """The non-core encodings of ``kind`` among ``allowed``, in name order: the ones the encoder
    offers a range of that kind to, after the core one."""
    return tuple(e for n, e in registry().items() if not e.core and e.kind == kind and n in allowed)


def is_fill(name: str) -> bool:
    """Whether blocks of ``name`` carry whole values (segments of tensors with ``init: none``)."""
    return get(name).kind == FILL


# --- checks before anything is fetched -------------------------------------------------------
class _Rules:
    """This build's encodings as ``format.parse_manifest`` checks them."""

    def check_names(self, encodings: Sequence[str], *, where: str) -> None:
        for name in encodings:
            get(name, where=where)

    def check_block(self, block: BlockEntry, tensors: Sequence[TensorEntry], *, where: str) -> None:
        check_block(block, tensors, where=where)


RULES = _Rules()


def parse_manifest(data: bytes, *, where: str = "manifest") -> Manifest:
    """``format.parse_manifest`` with this build's encodings: an encoding it lacks is refused by
    name (:class:`UnknownEncodingError`) before anything else, and each block must keep its
    encoding's limits (FORMAT.md §5: dtypes, changed elements per segment, the number of streams
    and the decoded length of each). What a reader runs before it fetches or allocates anything."""
    return _parse(data, where=where, rules=RULES)


def check_manifest(m: Manifest, *, where: str = "manifest") -> Manifest:
    """The checks of :func:`parse_manifest` on a manifest already parsed without them. Returns ``m``."""
    RULES.check_names(m.encodings, where=where)
    for i, b in enumerate(m.blocks):
        check_block(b, m.tensors, where=f"{where}: blocks[{i}]")
    return m


def check_block(b: BlockEntry, tensors: Sequence[TensorEntry], *, where: str) -> None:
    enc = get(b.encoding, where=where)
    for s in b.segments:
        te = tensors[s.tensor]
        if enc.dtypes is not None and te.dtype not in enc.dtypes:
            raise FormatError(f"{where}: {enc.name} segment on {te.name} ({te.dtype}): only "
                              f"{', '.join(enc.dtypes)} tensors have that encoding")
        if len(te.shape) < getattr(enc, "min_dims", 0):
            raise FormatError(f"{where}: {enc.name} segment on {te.name} of shape {list(te.shape)}: that encoding "
                              f"needs a tensor of {enc.min_dims} or more dimensions")
        if enc.kind == SPARSE:
            # sparse past half the elements is never smaller than dense (writers switch at
            # dense_threshold <= 1/2), and would cost a reader more memory than the tensor
            if not 0 < 2 * s.nnz <= s.count:
                raise FormatError(f"{where}: {enc.name} segment of {te.name} has nnz {s.nnz} outside "
                                  f"(0, {s.count // 2}] (half its count {s.count}): such ranges are carried densely")
        elif s.nnz != s.count:
            raise FormatError(f"{where}: {enc.name} segment of {te.name} must have nnz == count")
        if (enc.kind == FILL) != (te.init == INIT_NONE):
            raise FormatError(f"{where}: {enc.name} segment on tensor {te.name} with init {te.init!r}")
    expected = enc.stream_lengths(b.width, b.segments, [tensors[s.tensor].dtype for s in b.segments])
    check_streams(b.streams, expected, what=f"{enc.name} of width {b.width}", where=where)


def check_streams(streams: Sequence[StreamEntry], expected: Sequence[tuple[int, bool]], *, what: str,
                  where: str) -> None:
    if len(streams) != len(expected):
        raise FormatError(f"{where}: {what} has {len(expected)} streams, got {len(streams)}")
    for k, (s, (e, exact)) in enumerate(zip(streams, expected)):
        if s.raw > e:
            raise DecompressionBombError(f"{where}: stream {k} declares {s.raw} decoded bytes but its segments "
                                         f"hold only {e}")
        if s.raw != e and exact:
            raise FormatError(f"{where}: stream {k} declares {s.raw} decoded bytes, its segments need {e}")
        if s.codec == _streams.RAW and s.stored != s.raw:
            raise FormatError(f"{where}: raw stream {k} stores {s.stored} bytes for {s.raw}")
        if s.stored > s.raw:
            raise FormatError(f"{where}: stream {k} stores {s.stored} bytes for {s.raw} decoded: writers store "
                              "a stream raw when zstd does not make it smaller")
