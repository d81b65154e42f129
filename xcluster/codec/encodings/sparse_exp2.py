"""``sparse-exp2``: changed positions coded per exponent group of the base (FORMAT.md §5d).

An element changes when the update crosses half an ulp of its value, and the ulp halves with each
exponent step down, so within a range the change rate is nearly a function of the base value's
exponent. Both ends hold the base, so both can split a range into **groups** by the exponent field
of the base's bits; the positions of the changes are coded as gaps between **ranks** inside each
group (the rank of an element: how many elements of its group lie before it in the range), with a
Rice code whose parameter the writer derives from the group's size and its number of changes and
stores (one byte per group, in the counts stream, so a reader needs one pass). The
value of a change is split into a sign bit and its magnitude (in ulps), the magnitudes coded in
change order with adaptive binary rANS (:mod:`..kernels.rans`), which follows the group-by-group
shrinking of the moves that packed flags and byte planes could not.

Ranks, group sizes and the member of a given rank are found by :mod:`..kernels.exprank` (one pass over the
range, no sort).

Pure: numpy arrays in, numpy arrays out.
"""

from __future__ import annotations

import numpy as np

from ...errors import DecodeError
from ..kernels import exprank, expread, expwrite, rans
from ..kernels.changes import UINT
from ..encoding import SPARSE, BlockStreams, DecodeInput, Op, RangeInput, Scatter, register, stored_bytes
from ..kernels.changes import split_planes, unzigzag
from ..streams import incompressible

EXP_FIELDS: dict[str, tuple[int, int]] = {
    "bfloat16": (7, 8),
    "float16": (10, 5),
    "float32": (23, 8),
    "float8_e4m3fn": (3, 4),
    "float8_e4m3fnuz": (3, 4),
    "float8_e5m2": (2, 5),
    "float8_e5m2fnuz": (2, 5),
}
"""dtype -> (shift, bits) of the exponent field in the raw bits: the group of an element is
``(u >> shift) & (2**bits - 1)``. Other dtypes have no ``sparse-exp2`` encoding."""

N_STREAMS = 5
COUNTS, UNARY, REMAINDERS, SIGNS, MAGS = range(N_STREAMS)
STREAM_NAMES = ("counts", "quotient", "remainder", "sign", "magnitude")

def n_groups(dtype: str) -> int:
    return 1 << EXP_FIELDS[dtype][1]


def _field(dtype: str) -> tuple[int, int]:
    shift, nbits = EXP_FIELDS[dtype]
    return shift, (1 << nbits) - 1


def rice_k(pop: int | np.ndarray, nnz: int | np.ndarray):
    """The Rice parameter of a group of ``pop`` elements with ``nnz`` changes: the bit length of
    ``floor(pop * 31537 / (nnz * 65536))`` (≈ 1 + floor(log2(0.4812 · pop / nnz)), the optimal
    Rice parameter for geometric gaps of mean pop/nnz − 1)."""
    if isinstance(pop, np.ndarray):
        x = (pop.astype(np.int64) * 31537) // (nnz.astype(np.int64) * 65536)
        return np.array([int(v).bit_length() for v in x.tolist()], dtype=np.int64)
    return ((int(pop) * 31537) // (int(nnz) * 65536)).bit_length()


def groups_of(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The group (exponent field) of every element of the unsigned raw bits ``bits``, as uint8."""
    return exprank.group_ids(bits, *_field(dtype))


def group_ranks(old: np.ndarray, pos: np.ndarray, dtype: str
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Groups and ranks of the changed positions ``pos`` (sorted, relative to the range ``old``):
    ``(order, ranks, sizes, counts)`` where ``order`` lists indices into ``pos`` in **change
    order** (by group, then position), ``ranks`` the rank of each in that order, ``sizes`` the size
    of every group (0 for groups without changes: they are not counted) and ``counts`` the changes
    per group. (Compiled loops when numba is there, numpy otherwise: :mod:`..kernels.exprank`.)"""
    groups, ranks, sizes = exprank.ranks(old, pos, *_field(dtype))
    order = np.argsort(groups.astype(np.uint8), kind="stable")  # a radix sort of ≤ 256 keys
    counts = np.bincount(groups, minlength=n_groups(dtype))
    sizes = np.where(counts > 0, sizes, 0)
    return order, ranks[order], sizes, counts


def _packbits(bits: np.ndarray) -> np.ndarray:
    return np.packbits(bits, bitorder="little")


def pack(dtype: str, counts: np.ndarray, sizes: np.ndarray, ranks: np.ndarray, z: np.ndarray) -> list[np.ndarray]:
    """The five stream pieces of one ``sparse-exp2`` segment (FORMAT.md §5d). ``counts``: changes per group; ``sizes``: group sizes (where counts > 0);
    ``ranks`` and ``z`` (zigzag of the change, unsigned of the element's width) in change order.
    The Rice codes are written by a compiled loop where there is one, else with numpy: the same
    bytes."""
    counts = counts.astype(np.uint32)
    present = np.flatnonzero(counts)
    n = counts[present].astype(np.int64)
    k = rice_k(sizes[present], n)
    count_pieces = split_planes(counts)
    # the writer's choice; the size-derived one codes real weights as well as the best of k ± 2
    kfull = np.zeros(counts.size, dtype=np.uint8)
    kfull[present] = k
    count_pieces.append(kfull)
    coded = exprank.rice_code(ranks, n, k)
    unary, rem = coded if coded is not None else _rice_numpy(ranks, n, k)
    sign = (z & z.dtype.type(1)).astype(np.uint8)
    mags = incompressible(rans.encode((z.astype(np.int64) + 1) >> 1, z.dtype.itemsize))
    return [np.concatenate(count_pieces), unary, rem, _packbits(sign), mags]


def _rice_numpy(ranks: np.ndarray, n: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The quotient and remainder pieces of ranks in change order (group i: ``n[i]`` ranks, Rice
    parameter ``k[i]``), with numpy."""
    first = np.zeros(ranks.size, dtype=bool)
    first[np.cumsum(n)[:-1]] = True
    first[:1] = True
    prev = np.empty_like(ranks)
    prev[1:] = ranks[:-1]
    prev[first] = -1
    gaps = ranks - prev - 1
    kk = np.repeat(k, n)
    q = gaps >> kk
    unary = np.zeros(int(q.sum()) + q.size, dtype=np.uint8)
    unary[np.cumsum(q + 1) - 1] = 1
    rem_parts = [np.zeros(0, dtype=np.uint8)]
    s = 0
    for ng_, kg in zip(n.tolist(), k.tolist()):  # a group's remainders: n × k bits, LSB first
        if kg:
            lanes = np.arange(kg, dtype=np.int64)
            rem_parts.append(((gaps[s:s + ng_, None] >> lanes) & 1).astype(np.uint8).reshape(-1))
        s += ng_
    return _packbits(unary), _packbits(np.concatenate(rem_parts))


def build(old: np.ndarray, pos: np.ndarray, z: np.ndarray, dtype: str) -> list[np.ndarray]:
    """``sparse-exp2`` stream pieces of one segment from its old raw bits (the range), the sorted
    relative changed positions and their zigzag diffs (in position order). Written by compiled
    code from end to end where there is some (the same bytes)."""
    if (pieces := expwrite.build(old, pos, z, *_field(dtype))) is not None:
        return pieces
    order, ranks, sizes, counts = group_ranks(old, pos, dtype)
    return pack(dtype, counts, sizes, ranks, z[order])


# --- decoding ---------------------------------------------------------------------------------
def _bits(piece: np.ndarray, nbits: int, where: str, what: str) -> np.ndarray:
    """The first ``nbits`` bits of ``piece`` (LSB first); the padding bits after them must be 0."""
    bits = np.unpackbits(piece, bitorder="little")
    if bits[nbits:].any():
        raise DecodeError(f"{where}: nonzero padding bits in the {what} stream")
    return bits[:nbits]


class SegmentReader:
    """Walks a ``sparse-exp2`` block's decoded streams segment by segment (cursors per stream)."""

    def __init__(self, streams: list[np.ndarray], width: int, where: str) -> None:
        self.s = streams
        self.w = width
        self.where = where
        self.cur = [0] * N_STREAMS
        self.compiled = exprank.compiled()
        self.one_call = expread.compiled()  # segments read by one compiled call
        self._ones: np.ndarray | None = None  # the numpy decoder's: positions of the quotient stream's one bits
        self.one_cur = 0

    def _take(self, i: int, n: int, what: str) -> np.ndarray:
        a = self.cur[i]
        if a + n > self.s[i].size:
            raise DecodeError(f"{self.where}: the {what} stream ends early ({self.s[i].size} bytes)")
        self.cur[i] = a + n
        return self.s[i][a:a + n]

    def segment(self, old: np.ndarray, nnz: int, dtype: str, udt) -> tuple[np.ndarray, np.ndarray]:
        """Relative positions (ascending) and wrapped differences of one segment's changes, checked."""
        where, w = self.where, self.w
        ng = n_groups(dtype)
        shift, mask = _field(dtype)
        if self.one_call:  # the numpy steps below only run to say which check failed
            got = expread.read(self.s, self.cur, old, nnz, shift, mask, w)
            if got is not None:
                pos, z, self.cur = got
                return pos, z
        planes = self._take(COUNTS, 5 * ng, "counts").reshape(-1, ng)
        counts = (planes[:4].astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32))[:, None]).sum(axis=0,
                                                                                                   dtype=np.uint64)
        if int(counts.sum()) != nnz:
            raise DecodeError(f"{where}: group counts add up to {int(counts.sum())}, the segment has {nnz} changes")
        present = np.flatnonzero(counts)
        n = counts[present].astype(np.int64)
        # stored; a group with more changes than elements fails in select
        kfull = planes[4]
        k = kfull[present].astype(np.int64)
        if (k > 31).any() or np.count_nonzero(kfull) != np.count_nonzero(k):
            raise DecodeError(f"{where}: a Rice parameter is over 31, or set for a group without changes")
        starts = np.zeros(n.size + 1, dtype=np.int64)
        np.cumsum(n, out=starts[1:])
        ranks = self._ranks(nnz, n, k, starts)
        pos, idx, ok = exprank.select_sorted(old, present, starts, ranks, shift, mask)
        if not ok:
            raise DecodeError(f"{where}: a rank lies past the end of its group")
        sign = _bits(self._take(SIGNS, (nnz + 7) // 8, "sign"), nnz, where, "sign").astype(np.int64)
        mag, end = rans.decode(self.s[MAGS], self.cur[MAGS], nnz, w, compiled_loops=self.compiled)
        if end < 0:
            raise DecodeError(f"{where}: the magnitude piece runs past its stream or does not end on "
                              f"the coder's initial state")
        self.cur[MAGS] = end
        z64 = 2 * mag - sign
        if (z64 >= 1 << (8 * w)).any():
            raise DecodeError(f"{where}: a change's magnitude is out of range")
        z = z64.astype(udt)
        if self.one_call:
            raise DecodeError(f"{where}: the compiled reader rejects a segment the numpy reader reads (a bug)")
        return pos, z[idx]  # in element order, so the patch lands in memory order

    def _ranks(self, nnz: int, n: np.ndarray, k: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The ranks of the segment's changes in change order (group i: ``n[i]`` changes from
        ``starts[i]`` on, Rice parameter ``k[i]``), from its quotient and remainder pieces; the
        cursors move past them."""
        where = self.where
        if self.compiled:
            ranks, uend, rend, err = exprank.rice_ranks(self.s[UNARY], self.cur[UNARY], self.s[REMAINDERS],
                                                        self.cur[REMAINDERS], n, k)
            if err:
                raise DecodeError(f"{where}: {exprank.RICE_ERRORS[err]}")
            self.cur[UNARY], self.cur[REMAINDERS] = uend, rend
            return ranks
        # unary quotients: the next nnz one bits, from this segment's first byte on
        if self._ones is None:
            self._ones = np.flatnonzero(np.unpackbits(self.s[UNARY], bitorder="little"))
        if self.one_cur + nnz > self._ones.size:
            raise DecodeError(f"{where}: {exprank.RICE_ERRORS[1]}")
        ones = self._ones[self.one_cur:self.one_cur + nnz]
        self.one_cur += nnz
        start_bit = 8 * self.cur[UNARY]
        if int(ones[0]) < start_bit:
            raise DecodeError(f"{where}: {exprank.RICE_ERRORS[4]}")
        q = np.diff(ones, prepend=start_bit - 1) - 1
        self.cur[UNARY] = int(ones[-1]) // 8 + 1
        kk = np.repeat(k, n)
        total = int((n * k).sum())
        rem_bits = _bits(self._take(REMAINDERS, (total + 7) // 8, "remainder"), total, where, "remainder")
        rem = np.zeros(nnz, dtype=np.int64)
        s = b = 0
        for ng_, kg in zip(n.tolist(), k.tolist()):  # a group's remainders: n × k bits, LSB first
            if kg:
                rem[s:s + ng_] = rem_bits[b:b + ng_ * kg].reshape(ng_, kg).astype(np.int64) @ (
                    np.int64(1) << np.arange(kg, dtype=np.int64))
            s, b = s + ng_, b + ng_ * kg
        if (q > (np.int64(1) << 31)).any():
            raise DecodeError(f"{where}: {exprank.RICE_ERRORS[2]}")
        gaps = (q << kk) + rem
        if (gaps >= np.int64(1) << 31).any():  # a segment holds at most 2**31 elements
            raise DecodeError(f"{where}: {exprank.RICE_ERRORS[3]}")
        first = starts[:-1]
        ranks = np.cumsum(gaps + 1) - 1  # ranks inside each group: restart the count at each group
        ranks -= np.repeat(ranks[first] - gaps[first], n)
        return ranks

    def finish(self) -> None:
        for i, what in enumerate(STREAM_NAMES):
            if self.cur[i] != self.s[i].size:
                raise DecodeError(f"{self.where}: {self.s[i].size - self.cur[i]} bytes left over in the {what} stream")
        if self._ones is not None and self.one_cur != self._ones.size:
            raise DecodeError(f"{self.where}: the quotient stream holds more codes than changes")


# --- the encoding ---------------------------------------------------------------------------
NAME = "sparse-exp2"

EXACT = (True, False, False, True, False)
"""Which stream lengths :meth:`SparseExp2.stream_lengths` gives exactly (else a bound)."""

MIN_CHANGES = 64
"""Ranges with fewer changes stay ``sparse-sub`` without trying ``sparse-exp2``: its side information
(the counts and Rice parameters of the groups, five stream pieces) outweighs what it saves there,
and the trial (grouping, coding, compressing both) costs more than encoding the range itself.
On the real-weights run (bench/codec.py --real) 16, 64 and 256 give 7.520, 7.517 and 7.516 bits
per change over 24 steps (6.777, 6.768 and 6.768 at steps 1-5); with the flags and byte planes
the magnitudes were before, 1024 gave 8.29 where 64 gave 7.64. The 64 ranges of 384 elements of
that model then encode in 100 µs each instead of 230."""

MIN_SAVING = 0.0005
"""Bits per element of a range that ``sparse-exp2`` must save over the pieces it is offered to be
written (one byte per 16384 elements); below that the range stays as it is, and where those pieces
are themselves that small the trial is skipped. Decoding ``sparse-exp2`` reads every element of
the range (about 1 ns each), ``sparse-sub`` only the changes: a near-idle range, such as an
embedding table of which a step touches a few rows, saved a few hundred bytes for a pass over
millions of elements. On the real-weights run (bench/codec.py --real) the word embedding (52% of
that model's elements, about 0.01% of them changed per step) stays ``sparse-sub``: 0.00025,
0.0005 and 0.001 all give 7.517 bits per change over 24 steps; 0.001 would cost 1.7% more bytes
at 0.1% random changes (measured with the flags and byte planes), 0.00025 and 0.0005 nothing there."""


class SparseExp2:
    """Changed positions per exponent group of the base (Rice-coded ranks), signs, rANS-coded magnitudes."""

    name, kind, core, reads_range = NAME, SPARSE, False, True
    dtypes = tuple(EXP_FIELDS)

    def stream_lengths(self, width, segments, dtypes):
        bitmaps = sum((s.nnz + 7) // 8 for s in segments)
        # per group: its count (uint32) and its Rice parameter (one byte)
        lengths = [5 * sum(n_groups(d) for d in dtypes), sum((s.count + 7) // 8 for s in segments),
                   sum((31 * s.nnz + 7) // 8 for s in segments), bitmaps,
                   sum(rans.max_piece(s.nnz, width) for s in segments)]
        return list(zip(lengths, EXACT))

    def stream_level(self, stream: int, level: int) -> int:
        return level

    def memory(self, block) -> int:
        # the streams and the unpacked quotient bits; per segment its groups, a group's membership
        # mask and bitmap with prefix counts (3 bytes per element); per change about 10 int64
        # temporaries, the values, its magnitude, sign and value as int64 (24), its remainder bits
        # unpacked (at most 31) and a 64-byte word unpacked three times while its rank is selected (192)
        raw = [s.raw for s in block.streams]
        nnz = sum(s.nnz for s in block.segments)
        longest = max(s.count for s in block.segments)
        return sum(raw) + 8 * raw[1] + 3 * longest + nnz * (80 + 3 * block.width + 24 + 31 + 192)

    def on_device(self, old, pos, dtype: str, *, start: int, row: int):
        """The grouping and ranks of the changes, with torch ops where the tensors live."""
        from ..scan_torch import field_ranks  # torch: only on that path
        return field_ranks(old, pos, *EXP_FIELDS[dtype])

    def offer(self, r: RangeInput, best, stored, config):
        if r.nnz < MIN_CHANGES:
            return None
        need = MIN_SAVING * r.count / 8  # bytes
        s1 = stored()
        if s1 <= need:
            return None
        if r.device is not None:
            order, ranks, sizes, counts = r.device
            pieces = pack(r.dtype, counts, sizes, ranks, r.z[order])
        else:
            pieces = build(r.old, r.pos, r.z, r.dtype)
        return pieces if s1 - stored_bytes(self, pieces, config.zstd_level) > need else None

    def decode(self, streams: BlockStreams, d: DecodeInput) -> list[Op]:
        block = streams.block
        udt = UINT[block.width]
        reader = SegmentReader([streams.stream(i) for i in range(len(block.streams))], block.width, d.where)
        ops: list[Op] = []
        for seg in block.segments:
            t = d.base[seg.tensor] if seg.tensor < len(d.base) else None
            if t is None:
                raise DecodeError(f"{d.where}: {NAME} needs the base of {d.tensors[seg.tensor].name}")
            pos, z = reader.segment(t[seg.start:seg.start + seg.count], seg.nnz, d.tensors[seg.tensor].dtype, udt)
            pos += seg.start
            ops.append(Scatter(seg.tensor, pos, unzigzag(z)))
        reader.finish()
        return ops


ENCODING = register(SparseExp2())
