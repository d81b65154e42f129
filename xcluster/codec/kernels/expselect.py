"""Select inside exponent groups (the decoder's costly pass): element by element, or 64 at a time.

The decoder of ``sparse-exp2`` (FORMAT.md §5d) knows, for each group with changes, the ranks of its
changed members, and must find the elements that hold them. The plain loop (:func:`_plain`)
visits every element: it computes the element's group, counts it down and tests for a hit, about
1 ns an element on real weights, the largest part of applying a delta.

:func:`_masked` handles a whole block of 64 elements at once. One vector step computes the group of
all 64 and compares them with each group of a **window** of ``WINDOW`` consecutive groups, giving
one 64-bit mask per group (bit ``j``: element ``j`` of the block is a member). A group's count in
the block is the popcount of its mask, so a group is passed with one subtraction when its next
changed member lies beyond the block; otherwise the member is the n-th set bit of the mask.
Elements whose group lies outside the window (rare: on real weights a window of twelve exponents
holds 99.9% of the elements) have a mask of their own and are counted one by one as before. On the
real model at 1% this was about twice as fast as the plain loop on the host first measured (as
fast as it on an AVX2-only host: :data:`.exprank.DENSE_RANGE`), with the same results in the same
order. Where more than one element in :data:`.exprank.DENSE_RANGE` changed, most blocks hold a find
and the masks gain nothing: :mod:`.exprank` gives such ranges to the plain loop.

The window is the run of ``WINDOW`` groups that holds the most changes: the decoder knows how many
changes each group has, and changes follow the group sizes, so no pass over the range is spent to
choose it. Any window gives the same results; a poor one is only slower.

The vector step and the bit counts are generic LLVM IR (numba's ``@intrinsic``: vector compares
whose results are read as integers, ``llvm.ctpop``, ``llvm.cttz``), so they compile for any target
LLVM supports, with AVX-512 or AVX2 where the machine has them. The n-th set bit takes six
popcount steps (BMI2's ``pdep`` was only 5% faster here and exists on x86 alone). :mod:`.exprank`
imports this module only once numba imported, and keeps the plain loop where the masks do not
compile or disagree with it.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, register_jitable

BLOCK = 64
"""Elements per vector step: one mask bit each."""

WINDOW = 12
"""Groups that get a mask of their own per block (12 was fastest on real weights: 8 leaves 1.6% of
the elements outside, 16 spends more on masks than it saves)."""

_I1, _I32, _I64 = ir.IntType(1), ir.IntType(32), ir.IntType(64)


def build(jit) -> tuple:
    """``(plain, masked)``: the two compiled selects, the same arguments and results
    (:func:`.exprank.select_sorted`'s, ``ng`` the number of groups); ``jit`` compiles one function.
    (Module-level functions only: numba keys a cached closure by its cells, which differ from
    process to process, so a closure would compile anew in each.)"""
    return jit(_plain), jit(_masked)


@intrinsic
def _masks(typingctx, bits, i, shift, mask, lo, out):
    """``out[k]`` (k < WINDOW): bit j set where element ``i + j``'s group is ``lo + k``;
    ``out[WINDOW]``: bit j set where it lies outside the window."""
    sig = types.void(bits, i, shift, mask, lo, out)
    width = bits.dtype.bitwidth

    def codegen(context, builder, signature, args):
        bits_v, i_v, shift_v, mask_v, lo_v, out_v = args
        data = context.make_array(signature.args[0])(context, builder, bits_v).data
        dest = context.make_array(signature.args[5])(context, builder, out_v).data
        vt = ir.VectorType(ir.IntType(width), BLOCK)

        def splat(x):
            one = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
            return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined),
                                          ir.Constant(ir.VectorType(_I32, BLOCK), [0] * BLOCK))

        v = builder.load(builder.bitcast(builder.gep(data, [i_v]), vt.as_pointer()), align=1)
        d = builder.sub(builder.and_(builder.lshr(v, splat(shift_v)), splat(mask_v)), splat(lo_v))
        for k in range(WINDOW):  # below lo wraps past the window (lo <= ng - WINDOW): outside too
            hit = builder.icmp_unsigned("==", d, ir.Constant(vt, [k] * BLOCK))
            builder.store(builder.bitcast(hit, _I64), builder.gep(dest, [ir.Constant(_I64, k)]))
        out = builder.icmp_unsigned(">=", d, ir.Constant(vt, [WINDOW] * BLOCK))
        builder.store(builder.bitcast(out, _I64), builder.gep(dest, [ir.Constant(_I64, WINDOW)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _popcount(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.call(builder.module.declare_intrinsic("llvm.ctpop", [_I64]), [args[0]])

    return types.int64(x), codegen


@intrinsic
def _lowest(typingctx, x):
    """The index of the lowest set bit (x nonzero)."""
    def codegen(context, builder, signature, args):
        f = builder.module.declare_intrinsic("llvm.cttz", [_I64, _I1])
        return builder.call(f, [args[0], ir.Constant(_I1, 1)])

    return types.int64(x), codegen


@register_jitable
def _nth(m, r):
    """The index of set bit number ``r`` (from 0, lowest first) of ``m``; ``r`` < popcount."""
    at = 0
    for w in (32, 16, 8, 4, 2, 1):
        low = _popcount(m & ((np.uint64(1) << np.uint64(w)) - np.uint64(1)))
        if r >= low:
            r -= low
            m >>= np.uint64(w)
            at += w
    return at


_NEVER = 1 << 62
"""A count-down no element reaches: the group has no more changes to find."""


@register_jitable
def _sought(present, starts, ranks, ng, extra):
    """Per group (and ``extra`` more, without changes): the members to pass before the next one
    sought, and the first and end index of its ranks."""
    skip = np.full(ng + extra, _NEVER, np.int64)
    ptr = np.zeros(ng, np.int64)
    end = np.zeros(ng, np.int64)
    for k in range(present.size):
        g = present[k]
        ptr[g] = starts[k]
        end[g] = starts[k + 1]
        if starts[k] < starts[k + 1]:
            skip[g] = ranks[starts[k]]
    return skip, ptr, end


def _plain(bits, present, starts, ranks, shift, mask, ng):
    """Every element in turn. Returns ``(positions, indices, ok)`` as :func:`.exprank.select_sorted`."""
    m = ranks.size
    pos = np.empty(m, np.int64)  # the elements found, in element order
    idx = np.empty(m, np.int64)  # the index (in change order) of the rank each one has
    skip, ptr, end = _sought(present, starts, ranks, ng, 0)
    h = 0
    for i in range(bits.size):  # the count-down of _masked's elements outside its window, inline
        g = (bits[i] >> shift) & mask  # (a compiled helper taking the arrays costs 60 ns a call)
        d = skip[g]
        if d == 0:
            p = ptr[g]
            pos[h] = i
            idx[h] = p
            h += 1
            p += 1
            ptr[g] = p
            d = ranks[p] - ranks[p - 1] - 1 if p < end[g] else _NEVER
        else:
            d -= 1
        skip[g] = d
    return pos[:h], idx[:h], h == m


def _masked(bits, present, starts, ranks, shift, mask, ng):
    """64 elements per step (the module's docstring); the same results as :func:`_plain`."""
    m = ranks.size
    pos = np.empty(m, np.int64)
    idx = np.empty(m, np.int64)
    skip, ptr, end = _sought(present, starts, ranks, ng, WINDOW)  # the window may run past ng
    wanted = np.zeros(ng + WINDOW, np.int64)
    for k in range(present.size):
        wanted[present[k]] = starts[k + 1] - starts[k]
    # the window: groups lo .. lo + WINDOW - 1, the run with the most changes; ties go to the first,
    # so lo <= max(0, ng - WINDOW) and a group below lo wraps to WINDOW or more in _masks
    lo = 0
    most = -1
    for a in range(ng):
        s = 0
        for k in range(WINDOW):
            s += wanted[a + k]
        if s > most:
            most = s
            lo = a
    masks = np.empty(WINDOW + 1, np.uint64)
    last = np.zeros(BLOCK, bits.dtype)  # the last elements, fewer than a block, and padding
    h = 0
    n = bits.size
    tlo = bits.dtype.type(lo)
    for i in range(0, n, BLOCK):
        if i + BLOCK <= n:
            _masks(bits, i, shift, mask, tlo, masks)
        else:  # the padding's bits are cleared from every mask
            last[:n - i] = bits[i:]
            _masks(last, 0, shift, mask, tlo, masks)
            real = (np.uint64(1) << np.uint64(n - i)) - np.uint64(1)
            for k in range(WINDOW + 1):
                masks[k] &= real
        h0 = h
        for k in range(WINDOW):
            g = lo + k
            s = skip[g]
            mk = masks[k]
            c = _popcount(mk)
            if s < c:  # the member sought is in this block: take it, and any after it
                t = 0  # members of the block passed
                while t + s < c:
                    p = ptr[g]
                    pos[h] = i + _nth(mk, t + s)
                    idx[h] = p
                    h += 1
                    p += 1
                    ptr[g] = p
                    t += s + 1
                    s = ranks[p] - ranks[p - 1] - 1 if p < end[g] else _NEVER
                s -= c - t
            else:
                s -= c
            skip[g] = s
        rest = masks[WINDOW]
        while rest:  # outside the window: one by one, as _plain counts
            j = i + _lowest(rest)
            rest &= rest - np.uint64(1)
            g = (bits[j] >> shift) & mask
            d = skip[g]
            if d == 0:
                p = ptr[g]
                pos[h] = j
                idx[h] = p
                h += 1
                p += 1
                ptr[g] = p
                d = ranks[p] - ranks[p - 1] - 1 if p < end[g] else _NEVER
            else:
                d -= 1
            skip[g] = d
        for a in range(h0 + 1, h):  # this block's finds in element order (they are few)
            x = pos[a]
            y = idx[a]
            q = a - 1
            while q >= h0 and pos[q] > x:
                pos[q + 1] = pos[q]
                idx[q + 1] = idx[q]
                q -= 1
            pos[q + 1] = x
            idx[q + 1] = y
    return pos[:h], idx[:h], h == m
