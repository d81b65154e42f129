"""``full-exp``: whole bf16 values as one symbol byte, entropy coded by zstd, and six raw bits
(FORMAT.md §5c).

What a keyframe can save lies in the exponent (about 2.6 bits of entropy in its 8 bits) and in the
two top mantissa bits, whose distribution depends on the exponent. A tensor's exponents span far
fewer than 64 values, so the exponent (relative to a per-segment **base**) and the two top mantissa
bits fit one byte: ``4·(e − base) + m``. A stream of such bytes is what zstd's literal coder
(Huffman, in C) handles best, and decodes at a few GB/s; the remaining six bits (sign and five low
mantissa bits, near random in trained weights) are stored packed. Exponents
outside the window of 63 are escaped: symbol ``252 + m``, the exponent in a stream of its own.

On real weights: about 10.58 bits per element (byte planes: 10.96), decoded at over 1 GB/s per core.

Two implementations give identical results: loops compiled by numba (imported lazily) and numpy
(about ten times slower), so writers and readers work without numba.

Pure: numpy arrays in, numpy arrays out.
"""

from __future__ import annotations

import logging

import numpy as np

from ...errors import DecodeError
from ..kernels import jit
from ..encoding import FILL, BlockStreams, DecodeInput, Fill, Op, RangeInput, register, stored_bytes
from ..streams import Reader, incompressible

RAW_BITS = 6
"""Bits of each value stored as they are: the sign and the five low mantissa bits."""

WINDOW = 63
"""Exponents ``base … base + 62`` have symbols of their own."""
ESCAPE = 4 * WINDOW
"""Symbols ``ESCAPE + m`` (252-255): the exponent is the next byte of the escapes stream."""
MAX_BASE = 256 - WINDOW
"""A segment's base is at most this (its window ends at exponent 255)."""
SYMBOLS_ZSTD_LEVEL = 1
"""The symbols stream is compressed at this level whatever the configured one: the stream is
what zstd's literal coder handles best, and the lazy match finders of levels 3-18 find short
spurious matches in it that cost more than the literals (4.58 bits per symbol at level 1 and 2,
4.70-4.83 at 3-9 on real weights)."""

log = logging.getLogger(__name__)


def check_out(out: np.ndarray, count: int) -> np.ndarray:
    """``out``, if it can take a segment of ``count`` values (a writable, contiguous uint16 array)."""
    if out.dtype != np.uint16 or out.shape != (count,) or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"a segment of {count} values needs a writable contiguous uint16 array of that size, "
                         f"got {out.dtype} {out.shape}")
    return out


def used_up(where: str, **streams: tuple[int, np.ndarray]) -> None:
    """A DecodeError unless each stream (name: (bytes read, the stream)) is read to its end."""
    for name, (pos, arr) in streams.items():
        if pos != arr.size:
            raise DecodeError(f"{where}: {arr.size - pos} bytes left over in the {name} stream")


def raw_bytes(count: int) -> int:
    """Bytes of a segment's piece of the raw stream."""
    return (RAW_BITS * count + 7) // 8


def raw_piece(raw: np.ndarray, pos: int, count: int, where: str) -> np.ndarray:
    """The piece of a raw stream (FORMAT.md §5e) from byte ``pos`` that holds ``count`` fields, its
    padding bits checked."""
    rb = raw_bytes(count)
    if pos + rb > raw.size:
        raise DecodeError(f"{where}: the raw stream ends early")
    piece = raw[pos:pos + rb]
    if count % 4 and int(piece[-1]) >> (RAW_BITS * count % 8):
        raise DecodeError(f"{where}: nonzero padding bits in the raw stream")
    return piece


PREFERRED_BASE = 80
"""The base written wherever the window then holds every exponent it could (magnitudes 2^-47 to
2^15 hold nearly all weights): symbols of different tensors mean the same, so zstd's Huffman
tables, one per 128 KiB of a block's symbols, fit across segment boundaries (4.58 bits per symbol
on real weights, against 4.59 with each segment's window at its own largest exponent)."""


def choose_base(hist: np.ndarray) -> int:
    """Among the bases whose window holds the most elements of an exponent histogram (256 counts),
    the one nearest to PREFERRED_BASE (ties: the lower)."""
    window = np.convolve(hist.astype(np.int64), np.ones(WINDOW, dtype=np.int64))[WINDOW - 1:MAX_BASE + WINDOW]
    best = np.flatnonzero(window == window.max())
    return int(best[np.argmin(np.abs(best - PREFERRED_BASE))])


# --- the loops (compiled by numba when it is there; numpy below otherwise) -----------------------
BLOCK = 64
"""Raw fields are stored in blocks of this many values (FORMAT.md §5e): 48 bytes, laid out so that
each of the block's four quarters is read with the same constant shifts, which vector units do 16
values at a time (AVX2 has no 16-bit shift by a variable amount: a layout whose shifts vary from
value to value, as six bits after six bits does, runs one value at a time, about 4x slower here)."""


HIST_STEP = 16
"""Segments of at least :data:`HIST_SAMPLED` values choose their base from every HIST_STEP-th
exponent (a base is the writer's choice, FORMAT.md §5e: any base gives a correct segment; one
whose window misses an exponent the sample did not see escapes it). A full histogram cost
0.39 ns a value here, a third of encoding the segment; the sample gives the same bytes within
0.001% on real weights."""
HIST_SAMPLED = 1 << 16


def _hist(u, step, hist):
    """Add the exponents of every ``step``-th of the bf16 raw bits ``u`` to ``hist`` (256 counts;
    four partial histograms, so that equal neighbours do not wait on each other's count)."""
    h = np.zeros((4, 256), dtype=np.int64)
    n = u.size
    s4 = 4 * step
    main = n - n % s4
    for j in range(0, main, s4):
        h[0, (np.int64(u[j]) >> 7) & 255] += 1
        h[1, (np.int64(u[j + step]) >> 7) & 255] += 1
        h[2, (np.int64(u[j + 2 * step]) >> 7) & 255] += 1
        h[3, (np.int64(u[j + 3 * step]) >> 7) & 255] += 1
    for j in range(main, n, step):
        h[0, (np.int64(u[j]) >> 7) & 255] += 1
    for e in range(256):
        hist[e] += h[0, e] + h[1, e] + h[2, e] + h[3, e]


def _symbols(u, base, sym):
    """The symbols of the bf16 raw bits ``u``, right for the exponents inside the window (the
    others are fixed by :func:`_escapes`): bits 5-12 of ``u − (base << 7)`` (modulo 2^16), which
    are ``4·(e − base) + m`` modulo 256. Returns the largest ``(e − base) mod 256``: some exponent
    lies outside the window when it is WINDOW or more. (Written so that it runs as a vector loop:
    uint16 throughout; 0.1 ns a value here, against 0.35 with the same steps in int64.)"""
    top = np.uint16(base << 7)
    most = np.uint16(0)
    for j in range(u.size):
        d = np.uint16(u[j] - top)
        sym[j] = d >> np.uint16(5)
        most = max(most, np.uint16(d & np.uint16(0x7F80)))
    return most >> np.uint16(7)


def _escapes(u, base, sym, esc):
    """Escape the exponents of ``u`` outside the window: their symbols, and the exponents into
    ``esc`` (room for all of ``u``) in order; returns how many. Blocks of BLOCK values are tested by
    a vector loop first, and only those holding an escape are walked value by value."""
    top = np.uint16(base << 7)
    lo = np.uint16(WINDOW << 7)
    n = u.size
    k = 0
    for b0 in range(0, n, BLOCK):
        b1 = min(b0 + BLOCK, n)
        most = np.uint16(0)
        for j in range(b0, b1):
            most = max(most, np.uint16(np.uint16(u[j] - top) & np.uint16(0x7F80)))
        if most >= lo:
            for j in range(b0, b1):
                x = u[j]
                if np.uint16(np.uint16(x - top) & np.uint16(0x7F80)) >= lo:
                    sym[j] = np.uint8(ESCAPE | ((x >> np.uint16(5)) & np.uint16(3)))
                    esc[k] = np.uint8(x >> np.uint16(7))
                    k += 1
    return k


def _pack(u, raw):
    """Pack the raw fields of the bf16 raw bits ``u`` into ``raw`` (zeroed, :func:`raw_bytes`
    long): whole blocks of BLOCK values (FORMAT.md §5e), then the last values six bits each, least
    significant first."""
    n = u.size
    m15, m31, m32, ten = np.uint16(15), np.uint16(31), np.uint16(32), np.uint16(10)
    for k in range(n // BLOCK):
        o = BLOCK * k
        a = 48 * k
        for i in range(16):  # a field: the five low mantissa bits, then the sign
            r0 = (u[o + i] & m31) | ((u[o + i] >> ten) & m32)
            r1 = (u[o + 16 + i] & m31) | ((u[o + 16 + i] >> ten) & m32)
            r2 = (u[o + 32 + i] & m31) | ((u[o + 32 + i] >> ten) & m32)
            r3 = (u[o + 48 + i] & m31) | ((u[o + 48 + i] >> ten) & m32)
            raw[a + i] = np.uint8((r0 & m15) | ((r2 & m15) << np.uint16(4)))
            raw[a + 16 + i] = np.uint8((r1 & m15) | ((r3 & m15) << np.uint16(4)))
            raw[a + 32 + i] = np.uint8((r0 >> np.uint16(4)) | ((r1 >> np.uint16(4)) << np.uint16(2))
                                       | ((r2 >> np.uint16(4)) << np.uint16(4)) | ((r3 >> np.uint16(4)) << np.uint16(6)))
    t = n - n % BLOCK
    at = 48 * (n // BLOCK)
    for j in range(t, n):  # the last values, fewer than a block: six bits each, then zero padding
        bit = RAW_BITS * (j - t)
        r = np.uint32((u[j] & m31) | ((u[j] >> ten) & m32)) << np.uint32(bit & 7)
        raw[at + (bit >> 3)] |= np.uint8(r & np.uint32(255))
        if r >> np.uint32(8):
            raw[at + (bit >> 3) + 1] |= np.uint8(r >> np.uint32(8))


def _join(sym, esc, raw, base, out):
    """Values from symbols, escapes and packed raw fields, for a segment of base ``base``. A
    symbol s < 252 gives the bits ``(s << 5) + (base << 7)`` (``4·(e − base) + m`` shifted into
    place is ``(e << 7) | (m << 5)`` less ``base << 7``): no table, and the loop has no branch;
    escapes are put right in a second pass, when there are any. Returns the number of escapes
    used, or -1 when ``esc`` ran out."""
    n = sym.size
    top = np.uint16(base << 7)
    keep = np.uint16(0x7FE0)  # an escape's bits 5-14 are wrong until put right, and nothing else
    m15, m3, m31, m32 = np.uint16(15), np.uint16(3), np.uint16(31), np.uint16(32)
    five, four, ten = np.uint16(5), np.uint16(4), np.uint16(10)
    for k in range(n // BLOCK):  # four quarters of 16 values, each with constant shifts
        o = BLOCK * k
        a = 48 * k
        for i in range(16):
            r = (np.uint16(raw[a + i]) & m15) | ((np.uint16(raw[a + 32 + i]) & m3) << four)
            out[o + i] = (((np.uint16(sym[o + i]) << five) + top) & keep) | (r & m31) | ((r & m32) << ten)
        for i in range(16):
            r = (np.uint16(raw[a + 16 + i]) & m15) | (((np.uint16(raw[a + 32 + i]) >> np.uint16(2)) & m3) << four)
            out[o + 16 + i] = (((np.uint16(sym[o + 16 + i]) << five) + top) & keep) | (r & m31) | ((r & m32) << ten)
        for i in range(16):
            r = (np.uint16(raw[a + i]) >> four) | (((np.uint16(raw[a + 32 + i]) >> four) & m3) << four)
            out[o + 32 + i] = (((np.uint16(sym[o + 32 + i]) << five) + top) & keep) | (r & m31) | ((r & m32) << ten)
        for i in range(16):
            r = (np.uint16(raw[a + 16 + i]) >> four) | ((np.uint16(raw[a + 32 + i]) >> np.uint16(6)) << four)
            out[o + 48 + i] = (((np.uint16(sym[o + 48 + i]) << five) + top) & keep) | (r & m31) | ((r & m32) << ten)
    t = n - n % BLOCK
    at = 48 * (n // BLOCK)
    for j in range(t, n):  # the last values: six bits each
        bit = RAW_BITS * (j - t)
        w = np.int64(raw[at + (bit >> 3)])
        if at + (bit >> 3) + 1 < raw.size:
            w |= np.int64(raw[at + (bit >> 3) + 1]) << 8
        r = np.uint16((w >> (bit & 7)) & 63)
        out[j] = (((np.uint16(sym[j]) << five) + top) & keep) | (r & m31) | ((r & m32) << ten)
    escaped = 0
    for j in range(n):
        escaped += sym[j] >= ESCAPE
    if escaped > esc.size:
        return -1
    k = 0
    if escaped:
        for j in range(n):
            s = np.uint16(sym[j])
            if s >= ESCAPE:
                out[j] = (out[j] & np.uint16(0x801F)) | (np.uint16(esc[k]) << np.uint16(7)) \
                    | ((s & np.uint16(3)) << np.uint16(5))
                k += 1
    return k


def _np_hist(u, step, hist):
    hist += np.bincount((u[::step] >> 7) & 255, minlength=256)


def _np_symbols(u, base, sym):
    sym[:] = (((u >> 5) & 1023) - np.uint16(base << 2)).astype(np.uint8)
    return int((((u >> 7) & 255) - np.uint16(base)).astype(np.uint8).max(initial=0))


def _np_escapes(u, base, sym, esc):
    e = (u >> 7) & 255
    where = np.flatnonzero((e < base) | (e >= base + WINDOW))
    sym[where] = ESCAPE | ((u[where] >> 5) & 3)
    esc[:where.size] = e[where]
    return where.size


def _np_fields6(r: np.ndarray) -> np.ndarray:
    """Fields (uint32, < 64) packed six bits each, least significant first, padded to a byte."""
    n = r.size
    r = np.concatenate((r, np.zeros(-n % 4, dtype=np.uint32))).reshape(-1, 4)
    w = r[:, 0] | (r[:, 1] << 6) | (r[:, 2] << 12) | (r[:, 3] << 18)
    return np.stack((w & 255, (w >> 8) & 255, w >> 16), axis=1).ravel()[:raw_bytes(n)]


def _np_pack(u, raw):
    r = ((u & 31) | ((u >> 15) << 5)).astype(np.uint32)
    t = u.size - u.size % BLOCK
    q = r[:t].reshape(-1, 4, 16)  # block, quarter, value
    lo, hi = q & 15, q >> 4
    blocks = np.concatenate((lo[:, 0] | (lo[:, 2] << 4), lo[:, 1] | (lo[:, 3] << 4),
                             hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)), axis=1)
    tail = _np_fields6(r[t:])
    raw[:] = np.concatenate((blocks.ravel(), tail)).astype(np.uint8)


def _np_join(sym, esc, raw, base, out):
    n = sym.size
    v = ((sym.astype(np.uint16) << 5) + np.uint16(base << 7)) & np.uint16(0x7FE0)
    t = n - n % BLOCK
    b = raw[:48 * (t // BLOCK)].reshape(-1, 48).astype(np.uint16)
    lo, hi = b[:, :32], b[:, 32:]
    quarters = [lo[:, :16] & 15, lo[:, 16:] & 15, lo[:, :16] >> 4, lo[:, 16:] >> 4]
    r = np.stack([quarters[k] | (((hi >> (2 * k)) & 3) << 4) for k in range(4)], axis=1).reshape(-1)
    padded = raw[48 * (t // BLOCK):]
    padded = np.concatenate((padded, np.zeros(-padded.size % 3, dtype=np.uint8))).reshape(-1, 3).astype(np.uint32)
    w = padded[:, 0] | (padded[:, 1] << 8) | (padded[:, 2] << 16)
    tail = np.stack([(w >> (RAW_BITS * i)) & 63 for i in range(4)], axis=1).ravel()[:n - t].astype(np.uint16)
    r = np.concatenate((r, tail))
    v |= (r & 31) | ((r & 32) << 10)
    where = np.flatnonzero(sym >= ESCAPE)
    if where.size > esc.size:
        return -1
    v[where] = (v[where] & np.uint16(0x801F)) | (esc[:where.size].astype(np.uint16) << 7) | ((sym[where] & 3) << 5)
    out[:] = v
    return where.size


_NUMPY = (_np_hist, _np_symbols, _np_escapes, _np_pack, _np_join)


def _smoke(loops) -> None:
    """Run the compiled loops once (a broken numba fails here, not in the middle of a version)."""
    u = (np.arange(67, dtype=np.uint16) * 997) ^ np.uint16(0x8000)
    pieces = encode(u, loops=loops)
    if not np.array_equal(SegmentReader(pieces, loops=loops).segment(u.size, "smoke"), u):
        raise RuntimeError("full-exp loops disagree")


@jit.once
def _kernels():
    return jit.compile_loops(lambda c: tuple(map(c, (_hist, _symbols, _escapes, _pack, _join))), _smoke)


def compiled() -> bool:
    """Whether the compiled loops are in use."""
    return _kernels() is not None


def _loops(numpy: bool):
    k = None if numpy else _kernels()
    return _NUMPY if k is None else k


# --- one segment ------------------------------------------------------------------------------
def encode(values: np.ndarray, *, loops=None, numpy: bool = False) -> list[np.ndarray]:
    """The four pieces of one segment (base, symbols, escapes, raw) for the bf16 raw bits ``values``."""
    hist_loop, symbols, escapes, pack = (loops if loops is not None else _loops(numpy))[:4]
    u = np.ascontiguousarray(values, dtype=np.uint16)
    hist = np.zeros(256, dtype=np.int64)
    hist_loop(u, 1 if u.size < HIST_SAMPLED else HIST_STEP, hist)
    base = choose_base(hist)
    sym = np.empty(u.size, dtype=np.uint8)
    esc = np.empty(0, dtype=np.uint8)
    if symbols(u, base, sym) >= WINDOW:
        room = np.empty(u.size, dtype=np.uint8)  # pages are touched only where escapes are written
        esc = room[:escapes(u, base, sym, room)].copy()
    raw = np.zeros(raw_bytes(u.size), dtype=np.uint8)
    pack(u, raw)
    return [np.array([base], dtype=np.uint8), sym, esc, raw]


SAMPLE = 1 << 15
"""Bytes of each of the three samples (start, middle, end) of a raw field that zstd is tried on
before the whole: a field none of them shrinks is stored raw without compressing it all."""


def _samples(raw: np.ndarray) -> list[np.ndarray]:
    mid = (raw.size - SAMPLE) // 2
    return [raw[:SAMPLE], raw[mid:mid + SAMPLE], raw[-SAMPLE:]]


PIECE = 1 << 17
"""Values joined at a time: the symbols inflated for them stay in the cache until they are used."""


class SegmentReader:
    """Reads a block's segments in order from its four streams, checking everything FORMAT.md §5c
    asks of a reader. The symbols stream may be given as a :class:`.streams.Reader`, inflated a
    piece at a time as the segments need it, or decoded whole."""

    def __init__(self, streams: list, *, where: str = "", loops=None, numpy: bool = False) -> None:
        self.bases, symbols, self.escapes, self.raw = streams
        self.symbols = symbols if isinstance(symbols, Reader) else Reader.over(symbols, where=f"{where} symbols")
        self.where = where
        self._join = (loops if loops is not None else _loops(numpy))[4]
        self.b = self.e = self.r = 0

    def segment(self, count: int, name: str, *, out: np.ndarray | None = None) -> np.ndarray:
        """The next segment's ``count`` values (uint16; into ``out`` where given), or a DecodeError
        (``out`` may then hold part of them)."""
        where = f"{self.where}: full-exp segment of {name}"
        if self.b >= self.bases.size:
            raise DecodeError(f"{where}: the bases stream ends early")
        base = int(self.bases[self.b])
        self.b += 1
        if base > MAX_BASE:
            raise DecodeError(f"{where}: base {base} is above {MAX_BASE} (its window would pass exponent 255)")
        if self.symbols.left() < count:
            raise DecodeError(f"{where}: the symbols stream ends early")
        raw = raw_piece(self.raw, self.r, count, where)
        self.r += raw.size
        out = np.empty(count, dtype=np.uint16) if out is None else check_out(out, count)
        for pos in range(0, count, PIECE):  # PIECE is a multiple of 4: each piece starts on a whole raw byte
            m = min(PIECE, count - pos)
            used = self._join(self.symbols.take(m), self.escapes[self.e:], raw[3 * pos // 4:3 * pos // 4 + raw_bytes(m)],
                              base, out[pos:pos + m])
            if used < 0:
                raise DecodeError(f"{where}: the escapes stream ends early")
            self.e += used
        return out

    def finish(self) -> None:
        """Every stream read to its end."""
        used_up(f"{self.where}: full-exp", bases=(self.b, self.bases), escapes=(self.e, self.escapes),
                raw=(self.r, self.raw))
        self.symbols.finish()


# --- the encoding ---------------------------------------------------------------------------
NAME = "full-exp"

EXACT = (True, True, False, True)
"""Which stream lengths :meth:`FullExp.stream_lengths` gives exactly (else a bound)."""

MIN_ELEMENTS = 1024
"""Ranges of whole values shorter than this stay byte planes: a ``full-exp`` segment's base byte,
escapes and setup outweigh what it saves there, and all such ranges together are a small part of
a model (biases, norms)."""


class FullExp:
    """Whole bf16 values: a symbol byte per value (exponent window and top mantissa bits), escapes,
    the other six bits raw."""

    name, kind, core, reads_range = NAME, FILL, False, False
    measures_lazily = True  # byte planes are made only when zstd might shrink the raw field
    dtypes = ("bfloat16",)

    def stream_lengths(self, width, segments, dtypes):
        elems = sum(s.count for s in segments)
        # a base per segment, a symbol per element, at most one escaped exponent per element
        lengths = [len(segments), elems, elems, sum(raw_bytes(s.count) for s in segments)]
        return list(zip(lengths, EXACT))

    def stream_level(self, stream: int, level: int) -> int:
        return SYMBOLS_ZSTD_LEVEL if stream == 1 else level

    def memory(self, block) -> int:
        # the streams, the decoded values (held until the block is applied) and a segment's tables
        return sum(s.raw for s in block.streams) + block.width * sum(s.count for s in block.segments) + 64 * 1024

    def on_device(self, old, pos, dtype, *, start, row):
        return None

    def offer(self, r: RangeInput, best, stored, config):
        """``full-exp`` pieces where they are smaller stored than ``best`` (ties: ``best``).

        ``full-exp`` stores the raw field (sign and low mantissa bits) as its last stream, and byte
        planes win only on values with little variety or with repeats (a constant, a few levels,
        repeated rows), which show in that field (near random in trained weights). So ``best`` is
        compressed to compare only when zstd shrinks the raw field; and ``full-exp`` with few
        escapes needs no measuring at all then: it is smaller than the values themselves."""
        if r.count < MIN_ELEMENTS:
            return None
        bits = r.bits
        pieces = encode(bits)
        level = config.zstd_level
        raw = pieces[-1]
        if raw.nbytes > 4 * SAMPLE and all(
                stored_bytes(self, [s], level) >= s.nbytes for s in _samples(raw)):
            raw_stored = raw.nbytes  # zstd shrinks no sample of it: near random, not tried whole
        else:
            raw_stored = stored_bytes(self, [raw], level)
        if raw_stored >= raw.nbytes:  # zstd gains nothing on it: the block stores it raw, untried
            pieces[-1] = incompressible(raw)
        if raw_stored >= 0.95 * pieces[-1].nbytes:
            if 64 * pieces[2].size <= bits.size:
                return pieces
            least = bits.nbytes
        else:
            least = min(bits.nbytes, stored())
        size = (pieces[0].nbytes + stored_bytes(self, [pieces[1]], level, first=1)
                + stored_bytes(self, [pieces[2]], level) + raw_stored)
        return pieces if size < least else None

    def decode(self, streams: BlockStreams, d: DecodeInput) -> list[Op]:
        reader = SegmentReader([streams.stream(0), streams.reader(1), streams.stream(2), streams.stream(3)],
                               where=d.where)
        ops: list[Op] = []
        for seg in streams.block.segments:
            dst = d.into.get(seg.tensor) if d.into is not None else None
            name = d.tensors[seg.tensor].name
            if dst is None:
                ops.append(Fill(seg.tensor, seg.start, [reader.segment(seg.count, name)]))
            else:
                reader.segment(seg.count, name, out=dst[seg.start:seg.start + seg.count])
        reader.finish()
        return ops


ENCODING = register(FullExp())
