"""``full-rans``: whole bf16 values entropy coded with four-lane static rANS (FORMAT.md §5b).

A keyframe carries every weight. Byte planes + zstd spend about 10.96 bits per bf16 element on
real weights; what can be saved lies in the exponent (about 2.6 bits of entropy in its 8 bits) and
in the top mantissa bits, whose distribution depends on the exponent. So each element is split
into a **symbol** — its exponent and top two mantissa bits, bits 5–14, one of 1024 — coded with a
static rANS coder whose frequencies are stored per segment, and six **raw** bits (the sign and
the five low mantissa bits) stored as they are: about 10.56 bits per element on real weights.

Four rANS states run side by side (element j belongs to lane j mod 4, each lane with its own word
stream), so the decoder's four dependency chains overlap; the renormalisation is branch-free.

Two implementations give identical results: loops compiled by numba (imported lazily) and the
same functions run by Python where numba is missing or broken — about a thousand times slower
(0.5 MB/s), so readers can always read, with a warning; writers write this encoding only with
the compiled loops (:func:`compiled`).

Pure: numpy arrays in, numpy arrays and bytes out.
"""

from __future__ import annotations

import functools
import itertools
import logging

import numpy as np

from ..errors import DecodeError
from ..format import RANS_TABLE_BYTES
from . import jit

PROB_BITS = 12
TOTAL = 1 << PROB_BITS
"""The frequencies of a segment's symbols sum to this."""
LANES = 4
STATE_LOW = 1 << 16
"""A lane's state stays in [STATE_LOW, 2**32) between symbols; words are 16 bits."""
SYMBOL_SHIFT = 5
SYMBOLS = 1 << 10
RAW_BITS = 6
TABLE_BYTES = RANS_TABLE_BYTES
"""One segment's piece of the tables stream: the frequencies (uint16) and the lanes' word counts
(uint32)."""
assert TABLE_BYTES == 2 * SYMBOLS + 4 * LANES
STATE_BYTES = 4 * LANES

log = logging.getLogger(__name__)

RMAP = np.array([(r & 31) | ((r >> 5) << 15) for r in range(1 << RAW_BITS)], dtype=np.uint16)
"""raw field -> its bits in the bf16 value (low mantissa bits 0-4, sign bit 15)."""


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
    """The piece of a raw stream (FORMAT.md §5b) from byte ``pos`` that holds ``count`` fields, its
    padding bits checked."""
    rb = raw_bytes(count)
    if pos + rb > raw.size:
        raise DecodeError(f"{where}: the raw stream ends early")
    piece = raw[pos:pos + rb]
    if count % 4 and int(piece[-1]) >> (RAW_BITS * count % 8):
        raise DecodeError(f"{where}: nonzero padding bits in the raw stream")
    return piece


# --- frequencies --------------------------------------------------------------------------------
def normalize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to TOTAL, at least 1 for every symbol that occurs, close to
    proportional to ``counts`` (int64): floor(c·TOTAL/n) raised to 1, then the shortfall given one
    each to the symbols with the largest remainders (ties: lower symbol), or an excess taken one
    at a time from the largest frequency (ties: lower symbol). Integer arithmetic only, so every
    writer produces the same bytes."""
    counts = counts.astype(np.int64)
    n = int(counts.sum())
    if n <= 0:
        raise ValueError("no symbols to normalise")
    present = counts > 0
    scaled = counts * TOTAL
    f = np.where(present, np.maximum(scaled // n, 1), 0)
    short = TOTAL - int(f.sum())
    if short > 0:
        rem = np.where(present & (scaled // n >= 1), scaled % n, -1)
        order = np.lexsort((np.arange(counts.size), -rem))  # largest remainder first, then symbol
        f[order[:short]] += 1
    for _ in range(-short):  # raising rare symbols to 1 overshot: take from the most frequent
        f[int(np.argmax(f))] -= 1  # argmax: the first (lowest) of equal maxima
    return f


# --- the loops (compiled by numba when it is there) ----------------------------------------------
def _prepare(u, counts, raw):
    """Count the symbols of the uint16 values ``u`` into ``counts`` and pack their raw fields into
    ``raw`` (zeroed, :func:`raw_bytes` long): six bits each, least significant first."""
    n = u.size
    main = n - n % 4
    for k in range(0, main, 4):
        a = np.int64(u[k])
        b = np.int64(u[k + 1])
        c = np.int64(u[k + 2])
        d = np.int64(u[k + 3])
        counts[(a >> 5) & 1023] += 1
        counts[(b >> 5) & 1023] += 1
        counts[(c >> 5) & 1023] += 1
        counts[(d >> 5) & 1023] += 1
        w = (((a & 31) | ((a >> 15) << 5)) | (((b & 31) | ((b >> 15) << 5)) << 6)
             | (((c & 31) | ((c >> 15) << 5)) << 12) | (((d & 31) | ((d >> 15) << 5)) << 18))
        o = 3 * (k >> 2)
        raw[o] = w & 255
        raw[o + 1] = (w >> 8) & 255
        raw[o + 2] = (w >> 16) & 255
    for j in range(main, n):  # at most three
        a = np.int64(u[j])
        counts[(a >> 5) & 1023] += 1
        bit = 6 * j
        v = ((a & 31) | ((a >> 15) << 5)) << (bit & 7)
        raw[bit >> 3] |= v & 255
        if v >> 8:
            raw[(bit >> 3) + 1] |= v >> 8


def _encode_lanes(u, freq, cum, inv, w0, w1, w2, w3, states):
    """rANS-encode the symbols of the uint16 values ``u`` (element j on lane j % 4), last element
    first; each lane's words are written backwards from the end of its buffer. ``inv[s]`` is
    1/freq[s] (the quotient is estimated in floating point, then corrected exactly). Returns the
    first word index of each lane."""
    n = u.size
    xs = np.full(4, STATE_LOW, dtype=np.int64)
    ps = np.array([w0.size, w1.size, w2.size, w3.size], dtype=np.int64)
    for j in range(n - 1, n - 1 - n % 4, -1):  # the last, incomplete group, one element at a time
        lane = j & 3
        s = (np.int64(u[j]) >> 5) & 1023
        f = freq[s]
        x = xs[lane]
        if x >= (f << 20):
            ps[lane] -= 1
            w = w0 if lane == 0 else w1 if lane == 1 else w2 if lane == 2 else w3
            w[ps[lane]] = x & 0xFFFF
            x >>= 16
        xs[lane] = ((x // f) << 12) + (x % f) + cum[s]
    x0 = xs[0]
    x1 = xs[1]
    x2 = xs[2]
    x3 = xs[3]
    p0 = ps[0]
    p1 = ps[1]
    p2 = ps[2]
    p3 = ps[3]
    for k in range(n - n % 4 - 4, -1, -4):
        s0 = (np.int64(u[k]) >> 5) & 1023
        s1 = (np.int64(u[k + 1]) >> 5) & 1023
        s2 = (np.int64(u[k + 2]) >> 5) & 1023
        s3 = (np.int64(u[k + 3]) >> 5) & 1023
        f0 = freq[s0]
        f1 = freq[s1]
        f2 = freq[s2]
        f3 = freq[s3]
        if x0 >= (f0 << 20):
            p0 -= 1
            w0[p0] = x0 & 0xFFFF
            x0 >>= 16
        if x1 >= (f1 << 20):
            p1 -= 1
            w1[p1] = x1 & 0xFFFF
            x1 >>= 16
        if x2 >= (f2 << 20):
            p2 -= 1
            w2[p2] = x2 & 0xFFFF
            x2 >>= 16
        if x3 >= (f3 << 20):
            p3 -= 1
            w3[p3] = x3 & 0xFFFF
            x3 >>= 16
        q0 = np.int64(x0 * inv[s0])
        q1 = np.int64(x1 * inv[s1])
        q2 = np.int64(x2 * inv[s2])
        q3 = np.int64(x3 * inv[s3])
        r0 = x0 - q0 * f0
        r1 = x1 - q1 * f1
        r2 = x2 - q2 * f2
        r3 = x3 - q3 * f3
        if r0 < 0 or r0 >= f0:
            q0 = x0 // f0
            r0 = x0 - q0 * f0
        if r1 < 0 or r1 >= f1:
            q1 = x1 // f1
            r1 = x1 - q1 * f1
        if r2 < 0 or r2 >= f2:
            q2 = x2 // f2
            r2 = x2 - q2 * f2
        if r3 < 0 or r3 >= f3:
            q3 = x3 // f3
            r3 = x3 - q3 * f3
        x0 = (q0 << 12) + r0 + cum[s0]
        x1 = (q1 << 12) + r1 + cum[s1]
        x2 = (q2 << 12) + r2 + cum[s2]
        x3 = (q3 << 12) + r3 + cum[s3]
    states[0] = x0
    states[1] = x1
    states[2] = x2
    states[3] = x3
    return p0, p1, p2, p3


def _fill_table(freq, table):
    """``table[slot]`` for the 4096 slots of frequencies ``freq`` (summing to 4096, checked by the
    caller): (symbol << 5, its bits as they sit in the value) << 32 | frequency << 12 | slot −
    cumulative frequency."""
    slot = 0
    for s in range(freq.size):
        f = np.int64(freq[s])
        for k in range(f):
            table[slot] = (np.int64(s) << (32 + SYMBOL_SHIFT)) | (f << 12) | k
            slot += 1


def _groups(table, rmap, words, raw, out, g, stop, xs, qs):
    """Decode groups ``g … stop-1`` (elements 4g … 4·stop-1), which the caller made sure cannot
    run a lane out of words, from and into the lane states ``xs`` and word indices ``qs``.
    ``table`` as :func:`_fill_table` makes it. Unsigned indices (no negative-index code) and one
    table keep the loop's values in registers: about 1 GB/s of values per core here. The four lanes
    are written out one after another on purpose: states held in an array, or a loop over lanes,
    would live in memory and serialise the four chains."""
    x0 = xs[0]
    x1 = xs[1]
    x2 = xs[2]
    x3 = xs[3]
    q0 = np.uint64(qs[0])
    q1 = np.uint64(qs[1])
    q2 = np.uint64(qs[2])
    q3 = np.uint64(qs[3])
    b = np.uint64(3 * g)
    o = np.uint64(4 * g)
    for _ in range(stop - g):
        w = np.int64(raw[b]) | (np.int64(raw[b + np.uint64(1)]) << 8) | (np.int64(raw[b + np.uint64(2)]) << 16)
        e = table[x0 & 4095]
        x0 = ((e >> 12) & 0x1FFF) * (x0 >> 12) + (e & 4095)
        y = (x0 << 16) | np.int64(words[q0])
        c = x0 < 65536
        x0 = y if c else x0
        q0 += np.uint64(c)
        out[o] = np.uint16(e >> 32) | rmap[w & 63]
        e = table[x1 & 4095]
        x1 = ((e >> 12) & 0x1FFF) * (x1 >> 12) + (e & 4095)
        y = (x1 << 16) | np.int64(words[q1])
        c = x1 < 65536
        x1 = y if c else x1
        q1 += np.uint64(c)
        out[o + np.uint64(1)] = np.uint16(e >> 32) | rmap[(w >> 6) & 63]
        e = table[x2 & 4095]
        x2 = ((e >> 12) & 0x1FFF) * (x2 >> 12) + (e & 4095)
        y = (x2 << 16) | np.int64(words[q2])
        c = x2 < 65536
        x2 = y if c else x2
        q2 += np.uint64(c)
        out[o + np.uint64(2)] = np.uint16(e >> 32) | rmap[(w >> 12) & 63]
        e = table[x3 & 4095]
        x3 = ((e >> 12) & 0x1FFF) * (x3 >> 12) + (e & 4095)
        y = (x3 << 16) | np.int64(words[q3])
        c = x3 < 65536
        x3 = y if c else x3
        q3 += np.uint64(c)
        out[o + np.uint64(3)] = np.uint16(e >> 32) | rmap[(w >> 18) & 63]
        b += np.uint64(3)
        o += np.uint64(4)
    xs[0] = x0
    xs[1] = x1
    xs[2] = x2
    xs[3] = x3
    qs[0] = np.int64(q0)
    qs[1] = np.int64(q1)
    qs[2] = np.int64(q2)
    qs[3] = np.int64(q3)


def _make_decode(groups):
    def decode(table, rmap, states, words, bounds, raw, n, out):
        """Decode ``n`` values into ``out``. ``words`` holds the four lanes' words one after
        another, lane k in ``[bounds[k], bounds[k + 1])``. Returns ``(ok, xs, qs)``: ok is False
        when a lane needed a word it did not have (nothing is read past its words); the final
        states and the word index each lane stopped at, for the caller to check."""
        xs = states.copy()
        qs = bounds[:4].copy()
        n_groups = n // 4
        g = 0
        while g < n_groups:
            # a lane reads at most one word per group: this many groups cannot run out of words
            room = min(bounds[1] - qs[0], bounds[2] - qs[1], bounds[3] - qs[2], bounds[4] - qs[3])
            if room == 0:  # a lane is at its last word: the rest one element at a time, below
                break
            stop = min(n_groups, g + room)
            groups(table, rmap, words, raw, out, g, stop, xs, qs)
            g = stop
        for j in range(4 * g, n):
            lane = j & 3
            x = xs[lane]
            e = table[x & 4095]
            x = ((e >> 12) & 0x1FFF) * (x >> 12) + (e & 4095)
            if x < 65536:
                if qs[lane] >= bounds[lane + 1]:
                    return False, xs, qs
                x = (x << 16) | np.int64(words[qs[lane]])
                qs[lane] += 1
            xs[lane] = x
            bit = RAW_BITS * j
            v = np.int64(raw[bit >> 3])
            if (bit >> 3) + 1 < raw.size:
                v |= np.int64(raw[(bit >> 3) + 1]) << 8
            out[j] = np.uint16(e >> 32) | rmap[(v >> (bit & 7)) & 63]
        return True, xs, qs

    return decode


_PYTHON = (_prepare, _encode_lanes, _make_decode(_groups), _fill_table)
"""The loops run by Python (no numba)."""


@jit.once
def _kernels():
    """``(prepare, encode, decode, fill_table)`` compiled, or None (see :mod:`.jit`)."""
    return jit.compile_loops(lambda c: (c(_prepare), c(_encode_lanes), c(_make_decode(c(_groups))), c(_fill_table)),
                             _smoke)


def compiled() -> bool:
    """Whether the compiled loops are in use (writers write ``full-rans`` only then)."""
    return _kernels() is not None


def _loops(python: bool):
    k = None if python else _kernels()
    return _PYTHON if k is None else k


def _smoke(loops) -> None:
    """Compile the loops now (a broken numba fails here, not in the middle of a version)."""
    u = np.arange(67, dtype=np.uint16) * 997
    t, w, r = encode(u, loops=loops)
    if not np.array_equal(SegmentReader([t, w, r], loops=loops).segment(u.size, "smoke"), u):
        raise RuntimeError("rans loops disagree")


# --- one segment ------------------------------------------------------------------------------
def encode(values: np.ndarray, *, loops=None, python: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three pieces of one segment (tables, words, raw) for the uint16 raw bits ``values``."""
    prepare, enc = (loops if loops is not None else _loops(python))[:2]
    u = np.ascontiguousarray(values, dtype=np.uint16)
    n = u.size
    counts = np.zeros(SYMBOLS, dtype=np.int64)
    raw = np.zeros(raw_bytes(n), dtype=np.uint8)
    prepare(u, counts, raw)
    freq = normalize(counts)
    cum = np.concatenate(([0], np.cumsum(freq)[:-1])).astype(np.int64)
    inv = 1.0 / np.maximum(freq, 1)
    per_lane = (n + 3) // 4
    bufs = [np.empty(per_lane, dtype=np.uint16) for _ in range(LANES)]
    states = np.empty(LANES, dtype=np.int64)
    starts = enc(u, freq, cum, inv, *bufs, states)
    lanes = [b[s:] for b, s in zip(bufs, starts)]
    table = np.concatenate((freq.astype("<u2").view(np.uint8),
                            np.array([x.size for x in lanes], dtype="<u4").view(np.uint8)))
    words = np.concatenate([states.astype("<u4").view(np.uint8)] + [x.astype("<u2").view(np.uint8) for x in lanes])
    return table, words, raw


@functools.cache
def _warn_python() -> None:
    log.warning("numba is missing or broken: full-rans blocks are decoded in Python, at about 0.5 MB/s "
                "(pip install numba)")


class SegmentReader:
    """Reads a block's segments in order from its three decoded streams, checking everything
    FORMAT.md §5b asks of a reader."""

    def __init__(self, streams: list[np.ndarray], *, where: str = "", loops=None, python: bool = False) -> None:
        self.tables, self.words, self.raw = streams
        self.where = where
        loops = loops if loops is not None else _loops(python)
        self._table, self._dec = loops[3], loops[2]
        if loops is _PYTHON and not python:
            _warn_python()
        self.t = self.w = self.r = 0

    def segment(self, count: int, name: str, *, out: np.ndarray | None = None) -> np.ndarray:
        """The next segment's ``count`` values (uint16; into ``out`` where given), or a DecodeError
        (``out`` may then hold part of them)."""
        where = f"{self.where}: full-rans segment of {name}"
        if self.t + TABLE_BYTES > self.tables.size:
            raise DecodeError(f"{where}: the tables stream ends early")
        tab = self.tables[self.t:self.t + TABLE_BYTES]
        self.t += TABLE_BYTES
        freq = tab[:2 * SYMBOLS].view("<u2")
        nwords = tab[2 * SYMBOLS:].view("<u4").tolist()
        total = int(freq.sum(dtype=np.int64))
        if total != TOTAL:
            raise DecodeError(f"{where}: symbol frequencies sum to {total}, not {TOTAL}")
        if any(nw > (count - k + 3) // 4 for k, nw in enumerate(nwords)):
            raise DecodeError(f"{where}: a lane declares more words than it has elements")
        need = STATE_BYTES + 2 * sum(nwords)
        if self.w + need > self.words.size:
            raise DecodeError(f"{where}: the words stream holds {self.words.size - self.w} more bytes, "
                              f"the segment needs {need}")
        piece = self.words[self.w:self.w + need]
        self.w += need
        states = piece[:STATE_BYTES].view("<u4").astype(np.int64)
        if min(states.tolist()) < STATE_LOW:
            raise DecodeError(f"{where}: a lane's initial state is below {STATE_LOW}")
        words = piece[STATE_BYTES:].view("<u2")
        if not words.flags.aligned or words.dtype != np.uint16:
            words = words.astype(np.uint16)
        raw = raw_piece(self.raw, self.r, count, where)
        self.r += raw.size
        if not freq.flags.aligned or freq.dtype != np.uint16:
            freq = freq.astype(np.uint16)
        table = np.empty(TOTAL, dtype=np.int64)
        self._table(freq, table)
        bounds = np.array([0, *itertools.accumulate(nwords)], dtype=np.int64)
        out = np.empty(count, dtype=np.uint16) if out is None else check_out(out, count)
        ok, xs, qs = self._dec(table, RMAP, states, words, bounds, raw, count, out)
        if not ok:
            raise DecodeError(f"{where}: a lane ran out of words")
        if xs.tolist() != [STATE_LOW] * LANES or qs.tolist() != bounds[1:].tolist():
            raise DecodeError(f"{where}: the lanes do not end where they began (corrupt words or frequencies)")
        return out

    def finish(self) -> None:
        """Every stream read to its end."""
        used_up(f"{self.where}: full-rans", tables=(self.t, self.tables), words=(self.w, self.words),
                raw=(self.r, self.raw))
