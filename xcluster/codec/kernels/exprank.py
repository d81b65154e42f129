"""Ranks inside exponent groups: the one costly step of ``sparse-exp2`` (FORMAT.md §5d), done fast.

The **group** of an element is the exponent field of its base value; its **rank** is how many
elements of its group lie before it in the range. The encoder needs the rank of every changed
element and the size of every group; the decoder needs the size of every group and, for each
coded rank, the element that has it (select).

Two implementations give identical results:

- compiled loops (numba, imported lazily; a missing or broken numba falls back): one pass over the
  range's raw bits with eight interleaved histograms, so consecutive elements of one group do not
  wait on each other (the encoder tests once per eight elements whether a change falls among them,
  not once per element); the GIL is released, so ranges decode on several cores at once. The
  decoder's select is in :mod:`.expselect`: a plain loop over every element, and the same pass 64
  elements per step by vector masks (about twice as fast on real weights at 1% changed on the host
  first measured, as fast as the plain loop on an AVX2-only one: :data:`DENSE_RANGE`), used
  where it compiles and agrees with the plain loop when loaded, on ranges not denser than
  :data:`DENSE_RANGE`;
- numpy: one bitmap per group that holds changes (members packed 64 to a word) with the prefix
  popcounts of its words; one pass over the range per such group.

Pure: numpy arrays in, numpy arrays out. ``positions`` and ``ranks`` are int64, groups index
``range(n_groups)``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .jit import disabled, once

_POP8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)



def _popcount(words: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words)
    return _POP8[words.view(np.uint8)].reshape(-1, 8).sum(axis=1, dtype=np.uint8)


def group_ids(bits: np.ndarray, shift: int, mask: int) -> np.ndarray:
    """The group of every element of the unsigned raw bits ``bits``, as uint8."""
    g = (bits >> bits.dtype.type(shift)).astype(np.uint8)  # truncation keeps the low 8 bits
    if mask != 0xFF:
        g &= np.uint8(mask)
    return g


# --- numpy ------------------------------------------------------------------------------------
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
        wi = pos >> 6
        below = (np.uint64(1) << (pos & 63).astype(np.uint64)) - np.uint64(1)
        return self.cum[wi] + _popcount(self.words[wi] & below).astype(np.int64)

    def select(self, ranks: np.ndarray) -> np.ndarray:
        wi = np.searchsorted(self.cum, ranks, side="right") - 1
        j = ranks - self.cum[wi]  # which set bit of its word, from the lowest
        bits = np.unpackbits(self.words[wi].view(np.uint8), bitorder="little").reshape(-1, 64)
        seen = np.cumsum(bits, axis=1, dtype=np.int8)
        return (wi << 6) + np.argmax(seen > j[:, None].astype(np.int8), axis=1)


def _ranks_numpy(bits, pos, shift, mask, ng):
    groups = group_ids(bits, shift, mask)
    cg = groups[pos]
    sizes = np.zeros(ng, dtype=np.int64)
    ranks = np.empty(pos.size, dtype=np.int64)
    for g in np.unique(cg).tolist():
        sel = np.flatnonzero(cg == g)
        bm = _Bitmap(groups, g)
        sizes[g] = bm.size
        ranks[sel] = bm.rank(pos[sel])
    return cg.astype(np.int64), ranks, sizes


def _sizes_numpy(bits, present, shift, mask, ng):
    groups = group_ids(bits, shift, mask)
    return np.array([np.count_nonzero(groups == g) for g in present.tolist()], dtype=np.int64)


def _select_numpy(bits, present, starts, ranks, shift, mask, ng):
    groups = group_ids(bits, shift, mask)
    out = np.empty(ranks.size, dtype=np.int64)
    for i, g in enumerate(present.tolist()):
        r = ranks[starts[i]:starts[i + 1]]
        if r.size:
            bm = _Bitmap(groups, g)
            if int(r[-1]) >= bm.size:
                return out, False
            out[starts[i]:starts[i + 1]] = bm.select(r)
    return out, True


# --- compiled ---------------------------------------------------------------------------------
def _compiled_kernels(cache: bool = True):
    from numba import njit

    opts = dict(nogil=True, cache=cache, boundscheck=False)

    @njit(**opts)
    def ranks(bits, pos, shift, mask, ng):
        n = bits.size
        m = pos.size
        c = np.zeros((8, ng), np.uint32)  # lane k counts elements 8·q + k; a segment holds < 2**32 elements
        grp = np.empty(m, np.int64)
        rank = np.empty(m, np.int64)
        j = 0
        p = pos[0] if m > 0 else n  # the next change
        n8 = n - n % 8
        for i in range(0, n8, 8):
            if p >= i + 8:  # no change among these eight (nearly always): no test per element
                c[0, (bits[i] >> shift) & mask] += 1
                c[1, (bits[i + 1] >> shift) & mask] += 1
                c[2, (bits[i + 2] >> shift) & mask] += 1
                c[3, (bits[i + 3] >> shift) & mask] += 1
                c[4, (bits[i + 4] >> shift) & mask] += 1
                c[5, (bits[i + 5] >> shift) & mask] += 1
                c[6, (bits[i + 6] >> shift) & mask] += 1
                c[7, (bits[i + 7] >> shift) & mask] += 1
                continue
            for k in range(8):
                g = (bits[i + k] >> shift) & mask
                if i + k == p:
                    grp[j] = g
                    rank[j] = (np.int64(c[0, g]) + c[1, g] + c[2, g] + c[3, g] + c[4, g] + c[5, g] + c[6, g]
                               + c[7, g])
                    j += 1
                    p = pos[j] if j < m else n
                c[k, g] += 1
        for i in range(n8, n):
            g = (bits[i] >> shift) & mask
            if i == p:
                grp[j] = g
                rank[j] = (np.int64(c[0, g]) + c[1, g] + c[2, g] + c[3, g] + c[4, g] + c[5, g] + c[6, g] + c[7, g])
                j += 1
                p = pos[j] if j < m else n
            c[0, g] += 1
        sizes = np.zeros(ng, np.int64)
        for lane in range(8):
            for g in range(ng):
                sizes[g] += c[lane, g]
        return grp, rank, sizes

    @njit(**opts)
    def sizes(bits, present, shift, mask, ng):
        n = bits.size
        c = np.zeros((8, ng), np.uint32)  # a segment holds < 2**32 elements
        n8 = n - n % 8
        for i in range(0, n8, 8):
            c[0, (bits[i] >> shift) & mask] += 1
            c[1, (bits[i + 1] >> shift) & mask] += 1
            c[2, (bits[i + 2] >> shift) & mask] += 1
            c[3, (bits[i + 3] >> shift) & mask] += 1
            c[4, (bits[i + 4] >> shift) & mask] += 1
            c[5, (bits[i + 5] >> shift) & mask] += 1
            c[6, (bits[i + 6] >> shift) & mask] += 1
            c[7, (bits[i + 7] >> shift) & mask] += 1
        for i in range(n8, n):
            c[0, (bits[i] >> shift) & mask] += 1
        out = np.zeros(present.size, np.int64)
        for k in range(present.size):
            for lane in range(8):
                out[k] += c[lane, present[k]]
        return out

    from . import expselect  # imports numba: only here

    select, masked = expselect.build(njit(**opts))

    ctz = np.array([0] + [(i & -i).bit_length() - 1 for i in range(1, 256)], dtype=np.int64)

    @njit(**opts)
    def rice(unary, ustart, rem, rstart, n, k):
        nnz = 0
        total = 0
        for g in range(n.size):
            nnz += n[g]
            total += n[g] * k[g]
        out = np.empty(nnz, np.int64)
        rend = rstart + (total + 7) // 8
        if rend > rem.size:
            return out, 0, 0, 5
        ubits = unary.size * 8
        bit = ustart * 8
        at = rstart  # the next remainder byte to load into buf
        buf = np.int64(0)
        nbuf = 0  # bits in buf (LSB first)
        j = 0
        for g in range(n.size):
            kg = k[g]
            kmask = (np.int64(1) << kg) - 1
            rank = np.int64(-1)
            for _ in range(n[g]):
                q = np.int64(0)
                while True:  # the unary quotient: zero bits, then a one bit
                    if bit >= ubits:
                        return out, 0, 0, 1
                    b = np.int64(unary[bit >> 3]) >> (bit & 7)
                    if b == 0:
                        step = 8 - (bit & 7)
                        q += step
                        bit += step
                        continue
                    t = ctz[b]
                    q += t
                    bit += t + 1
                    break
                if q > np.int64(1) << 31:
                    return out, 0, 0, 2
                while nbuf < kg:  # at most 31 + 7 bits held: fits
                    buf |= np.int64(rem[at]) << nbuf
                    at += 1
                    nbuf += 8
                gap = (q << kg) + (buf & kmask)
                buf >>= kg
                nbuf -= kg
                if gap >= np.int64(1) << 31:
                    return out, 0, 0, 3
                rank += gap + 1
                out[j] = rank
                j += 1
        if bit & 7 and np.int64(unary[bit >> 3]) >> (bit & 7):
            return out, 0, 0, 4
        if buf != 0:  # the bits left in the last byte loaded: padding
            return out, 0, 0, 6
        return out, (bit + 7) >> 3, rend, 0

    @njit(**opts)
    def rice_code(ranks, n, k):
        ubits = np.int64(0)
        rbits = np.int64(0)
        j = 0
        for g in range(n.size):
            kg = k[g]
            prev = np.int64(-1)
            for _ in range(n[g]):
                ubits += ((ranks[j] - prev - 1) >> kg) + 1
                prev = ranks[j]
                j += 1
            rbits += n[g] * kg
        unary = np.zeros((ubits + 7) >> 3, np.uint8)
        rem = np.zeros((rbits + 7) >> 3, np.uint8)
        bit = np.int64(0)
        at = 0
        buf = np.int64(0)
        nbuf = 0  # bits in buf (LSB first), at most 7 + 31
        j = 0
        for g in range(n.size):
            kg = k[g]
            kmask = (np.int64(1) << kg) - 1
            prev = np.int64(-1)
            for _ in range(n[g]):
                gap = ranks[j] - prev - 1
                prev = ranks[j]
                j += 1
                bit += gap >> kg  # the quotient's zero bits, then a one bit
                unary[bit >> 3] |= np.uint8(1) << np.uint8(bit & 7)
                bit += 1
                buf |= (gap & kmask) << nbuf
                nbuf += kg
                while nbuf >= 8:
                    rem[at] = np.uint8(buf & 0xFF)
                    at += 1
                    buf >>= 8
                    nbuf -= 8
        if nbuf > 0:
            rem[at] = np.uint8(buf & 0xFF)
        return unary, rem

    return Kernels(ranks, sizes, _checked(masked, ranks, select) or select, rice, rice_code, select)


def _checked(masked, ranks, plain):
    """:mod:`.expselect`'s masked select, checked against the plain loop on a few thousand elements
    of every case it treats apart (groups in and outside its window, several finds in one block,
    the last elements); None where it does not compile or disagrees. (A plain loop that fails
    raises: then no compiled kernel is used.)"""
    rng = np.random.default_rng(5)
    n = 60 * 64 + 17  # 60 blocks of the masks, and 17 elements after them
    g = np.where(rng.random(n) < 0.97, rng.integers(0x74, 0x7C, n), rng.integers(0, 256, n))
    bits = (g.astype(np.uint16) << np.uint16(7)) | rng.integers(0, 128, n).astype(np.uint16)
    changed = rng.random(n) < 0.025
    changed[1000:1032] = True  # several finds in one block
    pos = np.flatnonzero(changed).astype(np.int64)
    grp, rank, _ = ranks(bits, pos, np.uint16(7), np.uint16(0xFF), 256)
    order = np.lexsort((rank, grp))
    present = np.unique(grp)
    starts = np.append(np.searchsorted(grp[order], present), pos.size).astype(np.int64)
    args = (bits, present, starts, rank[order], np.uint16(7), np.uint16(0xFF), 256)
    p2, i2, ok2 = plain(*args)
    if not (ok2 and np.array_equal(p2, pos)):
        raise RuntimeError("the compiled select disagrees with FORMAT.md §5a")
    try:
        p1, i1, ok1 = masked(*args)
    except Exception:  # noqa: BLE001 - any failure to compile or run: the plain loop stays
        return None
    return masked if ok1 and np.array_equal(p1, p2) and np.array_equal(i1, i2) else None


class Kernels(NamedTuple):
    """The compiled loops (numba dispatchers; other compiled loops may call them). ``select`` is
    :mod:`.expselect`'s masked select where it compiles and agrees with ``plain_select`` (the
    plain loop there) when loaded, else the plain loop: the same results."""

    ranks: object
    sizes: object
    select: object
    rice: object
    rice_code: object
    plain_select: object


DENSE_RANGE = 25
"""Ranges where more than 1 element in ``DENSE_RANGE`` changed are selected by the plain loop, not
by :mod:`.expselect`'s masks: there most blocks hold a change, and the branches the masks take per
find cost more than the plain loop's pass (real weights, one thread, bench/rank_select.py: the
masks 2.7-3× as fast at 0.1% changed, 1.8-2.2× at 1%, 1.1-1.2× at 3%, 0.9-1.0× at 5%, 0.7-0.8×
at 10%, on the host first measured, whose vector ISA was not recorded; on an AVX2-only host, a
2-core AMD EPYC, 2026-12-07: 0.99× at 0.1%, 0.95× at 1%, 0.81× at 3%, 0.79× at 5%, 0.64× at 10%:
there a 64-lane compare and its mask cost several instructions each)."""


def select_loop(kern: Kernels, changes: int, elements: int):
    """The compiled select for a range of ``elements`` with ``changes`` to find."""
    return kern.plain_select if changes * DENSE_RANGE > elements else kern.select


@once
def _kernels() -> Kernels | None:
    """The compiled kernels, or None (numba missing or broken, or turned off)."""
    if disabled():
        return None
    try:
        return _compiled_kernels()
    except ImportError:  # numba absent: numpy gives the same results
        return None
    except Exception:  # e.g. no writable place for numba's on-disk cache: compile in memory
        try:
            return _compiled_kernels(cache=False)
        except Exception:  # numba unusable on this platform
            return None


def compiled() -> bool:
    """Whether the compiled kernels are in use."""
    return _kernels() is not None


def kernels() -> Kernels | None:
    """The compiled kernels, or None where they are not in use."""
    return _kernels()


def _args(bits: np.ndarray, shift: int, mask: int):
    t = bits.dtype.type
    return t(shift), t(mask)


# --- the interface ----------------------------------------------------------------------------
def ranks(bits: np.ndarray, pos: np.ndarray, shift: int, mask: int, *, numpy: bool = False
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the sorted positions ``pos`` of the range ``bits``: ``(groups, ranks, sizes)`` — the
    group and rank of each position (in position order) and the size of every group."""
    k = None if numpy else _kernels()
    ng = mask + 1
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    if k is None:
        return _ranks_numpy(bits, pos, shift, mask, ng)
    return k[0](np.ascontiguousarray(bits), pos, *_args(bits, shift, mask), ng)


def sizes(bits: np.ndarray, present: np.ndarray, shift: int, mask: int, *, numpy: bool = False) -> np.ndarray:
    """The sizes of the groups ``present`` in the range ``bits``."""
    k = None if numpy else _kernels()
    present = np.ascontiguousarray(present, dtype=np.int64)
    if k is None:
        return _sizes_numpy(bits, present, shift, mask, mask + 1)
    return k[1](np.ascontiguousarray(bits), present, *_args(bits, shift, mask), mask + 1)


RICE_ERRORS = {
    1: "the quotient stream holds too few codes",
    2: "a quotient is larger than any group",
    3: "a gap is longer than any group",
    4: "nonzero padding bits in the quotient stream",
    5: "the remainder stream ends early",
    6: "nonzero padding bits in the remainder stream",
}


def rice_ranks(unary: np.ndarray, ustart: int, rem: np.ndarray, rstart: int, n: np.ndarray, k: np.ndarray):
    """Compiled Rice decoding of one ``sparse-exp2`` segment (FORMAT.md §5d): the ranks of its
    changes in change order, groups of ``n[i]`` changes coded with parameter ``k[i]``, from the
    quotient bits at byte ``ustart`` of ``unary`` and the remainder bits at byte ``rstart`` of
    ``rem``. Returns ``(ranks, unary end, remainder end, error)``, byte offsets after the segment's
    pieces, ``error`` a key of :data:`RICE_ERRORS` or 0; None without the compiled kernels (the
    caller decodes with numpy)."""
    kern = _kernels()
    if kern is None:
        return None
    return kern[3](unary, ustart, rem, rstart, np.ascontiguousarray(n, dtype=np.int64),
                   np.ascontiguousarray(k, dtype=np.int64))


def rice_code(ranks_: np.ndarray, n: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Compiled Rice coding of one ``sparse-exp2`` segment's ranks (change order; group i: the next
    ``n[i]`` ranks, parameter ``k[i]``): its quotient and remainder pieces, the bytes
    :func:`sparse_exp2.pack`'s numpy code writes; None without the compiled kernels."""
    kern = _kernels()
    if kern is None:
        return None
    return kern[4](np.ascontiguousarray(ranks_, dtype=np.int64), np.ascontiguousarray(n, dtype=np.int64),
                   np.ascontiguousarray(k, dtype=np.int64))


def select_sorted(bits: np.ndarray, present: np.ndarray, starts: np.ndarray, ranks_: np.ndarray, shift: int,
                  mask: int, *, numpy: bool = False) -> tuple[np.ndarray, np.ndarray, bool]:
    """The elements with the given ranks: ``ranks_[starts[i]:starts[i+1]]`` (strictly increasing)
    are ranks in group ``present[i]``. Returns ``(positions, indices, ok)``: the positions
    ascending, ``indices[j]`` the index into ``ranks_`` of the rank ``positions[j]`` has (so patches
    land in memory order); ``ok`` is False when a rank lies past the end of its group (the rest is
    then meaningless)."""
    k = None if numpy else _kernels()
    present = np.ascontiguousarray(present, dtype=np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    ranks_ = np.ascontiguousarray(ranks_, dtype=np.int64)
    if k is None:
        out, ok = _select_numpy(bits, present, starts, ranks_, shift, mask, mask + 1)
        idx = np.argsort(out, kind="stable") if ok else np.zeros(0, dtype=np.int64)
        return out[idx], idx, ok
    fn = select_loop(k, ranks_.size, bits.size)
    pos, idx, ok = fn(np.ascontiguousarray(bits), present, starts, ranks_, *_args(bits, shift, mask), mask + 1)
    return pos, idx, bool(ok)
