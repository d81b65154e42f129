"""``sparse-exp``: changed positions coded per exponent group of the base (FORMAT.md §5).

An element changes when the update crosses half an ulp of its value, and the ulp halves with each
exponent step down, so within a range the change rate is nearly a function of the base value's
exponent. Both ends hold the base, so both can split a range into **groups** by the exponent field
of the base's bits; the positions of the changes are coded as gaps between **ranks** inside each
group (the rank of an element: how many elements of its group lie before it in the range), with a
Rice code whose parameter both ends derive from the group's size and its number of changes. The
value of a change is split into a sign bit, a "moved more than one step" bit, and, for those that
did, the rest in byte planes.

Ranks are found with one bitmap per group that holds changes (the group's members, packed 64 to a
word) and the prefix popcounts of its words: the rank of a member is the popcount before its word
plus the popcount of the lower bits of its word; the member of a given rank is found the other way
round. No sort of the range.

Pure: numpy arrays in, numpy arrays out.
"""

from __future__ import annotations

import numpy as np

from ..errors import DecodeError
from .changes import split_planes

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
``(u >> shift) & (2**bits - 1)``. Other dtypes have no ``sparse-exp`` encoding."""

N_STREAMS = 6
COUNTS, UNARY, REMAINDERS, SIGNS, BIG, REST = range(N_STREAMS)

_POP8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def n_groups(dtype: str) -> int:
    return 1 << EXP_FIELDS[dtype][1]


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
    shift, nbits = EXP_FIELDS[dtype]
    g = (bits >> bits.dtype.type(shift)).astype(np.uint8)  # truncation keeps the low 8 bits
    if nbits < 8:
        g &= np.uint8((1 << nbits) - 1)
    return g


def _popcount(words: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words)
    return _POP8[words.view(np.uint8)].reshape(-1, 8).sum(axis=1, dtype=np.uint8)


class _Bitmap:
    """Members of one group in a range: bit j of word i is element 64·i + j; ``cum[i]`` is the
    number of members before word i (``cum[-1]``: the group's size)."""

    __slots__ = ("words", "cum")

    def __init__(self, groups: np.ndarray, g: int) -> None:
        packed = np.packbits(groups == g, bitorder="little")
        pad = -packed.size % 8
        if pad:
            packed = np.concatenate([packed, np.zeros(pad, dtype=np.uint8)])
        self.words = packed.view("<u8")
        self.cum = np.zeros(self.words.size + 1, dtype=np.int64)
        np.cumsum(_popcount(self.words), out=self.cum[1:])

    @property
    def size(self) -> int:
        return int(self.cum[-1])

    def rank(self, pos: np.ndarray) -> np.ndarray:
        """Ranks of the members at ``pos`` (int64)."""
        wi = pos >> 6
        below = (np.uint64(1) << (pos & 63).astype(np.uint64)) - np.uint64(1)
        return self.cum[wi] + _popcount(self.words[wi] & below).astype(np.int64)

    def select(self, ranks: np.ndarray) -> np.ndarray:
        """Positions of the members of ``ranks`` (each < size)."""
        wi = np.searchsorted(self.cum, ranks, side="right") - 1
        j = ranks - self.cum[wi]  # which set bit of its word, from the lowest
        bits = np.unpackbits(self.words[wi].view(np.uint8), bitorder="little").reshape(-1, 64)
        seen = np.cumsum(bits, axis=1, dtype=np.int8)
        return (wi << 6) + np.argmax(seen > j[:, None].astype(np.int8), axis=1)


def ranks_numpy(old: np.ndarray, pos: np.ndarray, dtype: str
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Groups and ranks of the changed positions ``pos`` (sorted, relative to the range ``old``):
    ``(order, ranks, sizes, counts)`` where ``order`` lists indices into ``pos`` in **change
    order** (by group, then position), ``ranks`` the rank of each in that order, ``sizes`` the size
    of every group (0 for groups without changes: they are not counted) and ``counts`` the changes
    per group."""
    groups = groups_of(old, dtype)
    cg = groups[pos]
    order = np.argsort(cg, kind="stable")
    counts = np.bincount(cg, minlength=n_groups(dtype))
    sizes = np.zeros(counts.size, dtype=np.int64)
    ranks = np.empty(pos.size, dtype=np.int64)
    start = 0
    for g in np.flatnonzero(counts).tolist():
        end = start + int(counts[g])
        bm = _Bitmap(groups, g)
        sizes[g] = bm.size
        ranks[start:end] = bm.rank(pos[order[start:end]])
        start = end
    return order, ranks, sizes, counts


def _packbits(bits: np.ndarray) -> np.ndarray:
    return np.packbits(bits, bitorder="little")


def pack(dtype: str, counts: np.ndarray, sizes: np.ndarray, ranks: np.ndarray, z: np.ndarray) -> list[np.ndarray]:
    """The six stream pieces of one segment (FORMAT.md §5, ``sparse-exp``). ``counts``: changes per
    group; ``sizes``: group sizes (where counts > 0); ``ranks`` and ``z`` (zigzag of the change,
    unsigned of the element's width) in change order."""
    counts = counts.astype(np.uint32)
    present = np.flatnonzero(counts)
    n = counts[present].astype(np.int64)
    k = rice_k(sizes[present], n)
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
    kmax = int(k.max()) if k.size else 0
    if kmax:
        lanes = np.arange(kmax, dtype=np.int64)
        rem_bits = ((gaps[:, None] >> lanes) & 1)[lanes < kk[:, None]].astype(np.uint8)
    else:
        rem_bits = np.zeros(0, dtype=np.uint8)
    one = z.dtype.type(1)
    sign = (z & one).astype(np.uint8)
    big = z > z.dtype.type(2)
    rest = (z[big] >> one) + (z[big] & one) - z.dtype.type(2)
    return [np.concatenate(split_planes(counts)), _packbits(unary), _packbits(rem_bits), _packbits(sign),
            _packbits(big.view(np.uint8)), np.concatenate(split_planes(rest)) if rest.size else rest.view(np.uint8)]


def build(old: np.ndarray, pos: np.ndarray, z: np.ndarray, dtype: str) -> list[np.ndarray]:
    """``sparse-exp`` stream pieces of one segment from its old raw bits (the range), the sorted
    relative changed positions and their zigzag diffs (in position order)."""
    order, ranks, sizes, counts = ranks_numpy(old, pos, dtype)
    return pack(dtype, counts, sizes, ranks, z[order])


# --- decoding ---------------------------------------------------------------------------------
def _bits(piece: np.ndarray, nbits: int, where: str, what: str) -> np.ndarray:
    """The first ``nbits`` bits of ``piece`` (LSB first); the padding bits after them must be 0."""
    bits = np.unpackbits(piece, bitorder="little")
    if bits[nbits:].any():
        raise DecodeError(f"{where}: nonzero padding bits in the {what} stream")
    return bits[:nbits]


class SegmentReader:
    """Walks a ``sparse-exp`` block's decoded streams segment by segment (cursors per stream)."""

    def __init__(self, streams: list[np.ndarray], width: int, where: str) -> None:
        self.s = streams
        self.w = width
        self.where = where
        self.cur = [0] * N_STREAMS
        self.ones = np.flatnonzero(np.unpackbits(streams[UNARY], bitorder="little"))
        self.one_cur = 0

    def _take(self, i: int, n: int, what: str) -> np.ndarray:
        a = self.cur[i]
        if a + n > self.s[i].size:
            raise DecodeError(f"{self.where}: the {what} stream ends early ({self.s[i].size} bytes)")
        self.cur[i] = a + n
        return self.s[i][a:a + n]

    def segment(self, old: np.ndarray, nnz: int, dtype: str, udt) -> tuple[np.ndarray, np.ndarray]:
        """Relative positions and wrapped differences of one segment's changes, checked."""
        where, w = self.where, self.w
        ng = n_groups(dtype)
        planes = self._take(COUNTS, 4 * ng, "counts").reshape(4, ng)
        counts = (planes.astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32))[:, None]).sum(axis=0,
                                                                                               dtype=np.uint64)
        if int(counts.sum()) != nnz:
            raise DecodeError(f"{where}: group counts add up to {int(counts.sum())}, the segment has {nnz} changes")
        # unary quotients: the next nnz one bits, from this segment's first byte on
        if self.one_cur + nnz > self.ones.size:
            raise DecodeError(f"{where}: the quotient stream holds too few codes")
        ones = self.ones[self.one_cur:self.one_cur + nnz]
        self.one_cur += nnz
        start_bit = 8 * self.cur[UNARY]
        if int(ones[0]) < start_bit:
            raise DecodeError(f"{where}: nonzero padding bits in the quotient stream")
        q = np.diff(ones, prepend=start_bit - 1) - 1
        self.cur[UNARY] = int(ones[-1]) // 8 + 1
        groups = groups_of(old, dtype)
        present = np.flatnonzero(counts)
        n = counts[present].astype(np.int64)
        bitmaps = []
        sizes = np.empty(present.size, dtype=np.int64)
        for i, g in enumerate(present.tolist()):
            bm = _Bitmap(groups, g)
            bitmaps.append(bm)
            sizes[i] = bm.size
        if (n > sizes).any():
            raise DecodeError(f"{where}: a group holds more changes than elements")
        k = rice_k(sizes, n)
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
            raise DecodeError(f"{where}: a quotient is larger than any group")
        gaps = (q << kk) + rem
        pos = np.empty(nnz, dtype=np.int64)
        s = 0
        for i, bm in enumerate(bitmaps):
            e = s + int(n[i])
            ranks = np.cumsum(gaps[s:e] + 1) - 1
            if int(ranks[-1]) >= bm.size:
                raise DecodeError(f"{where}: a rank lies past the end of its group")
            pos[s:e] = bm.select(ranks)
            s = e
        sign = _bits(self._take(SIGNS, (nnz + 7) // 8, "sign"), nnz, where, "sign").astype(udt)
        big = _bits(self._take(BIG, (nnz + 7) // 8, "flag"), nnz, where, "flag").astype(bool)
        nbig = int(np.count_nonzero(big))
        rplanes = self._take(REST, w * nbig, "rest").reshape(w, nbig)
        z = udt(2) - sign
        if nbig:
            rest = np.ascontiguousarray(rplanes.T).view(udt).reshape(-1)
            if (rest > udt((1 << (8 * w - 1)) - 2)).any():
                raise DecodeError(f"{where}: a change's rest is out of range")
            zb = ((rest + udt(2)) << udt(1)) - sign[big]
            if (zb < udt(3)).any():
                raise DecodeError(f"{where}: a change's rest is out of range")
            z[big] = zb
        return pos, z

    def finish(self) -> None:
        for i, what in enumerate(("counts", "quotient", "remainder", "sign", "flag", "rest")):
            if self.cur[i] != self.s[i].size:
                raise DecodeError(f"{self.where}: {self.s[i].size - self.cur[i]} bytes left over in the {what} stream")
        if self.one_cur != self.ones.size:
            raise DecodeError(f"{self.where}: the quotient stream holds more codes than changes")
