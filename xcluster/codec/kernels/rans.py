"""The magnitudes of a ``sparse-exp2`` segment's changes, coded with adaptive binary rANS (FORMAT.md §5d).

In change order (by exponent group ascending, then position) a segment's changes move by fewer
ulps group after group: the update's size is about the same across a tensor and the ulp doubles
with each exponent step up, so the low groups hold moves of many ulps and the high ones single
steps. Packed flags and byte planes cannot follow that (zstd sees one distribution over the whole
stream); a binary coder with probabilities that adapt as it goes does, with no side information:
on the real-weights run (bench/codec.py --real) the magnitudes take 0.336 bits per change at
steps 1-5 and 0.392 over 24 steps, where the flags and byte planes took 0.432 and 0.511.

A change's magnitude ``|d| ≥ 1`` of bit length ``t`` is coded as yes/no **decisions**: ``t > j``
for ``j = 1, 2, …`` up to the first no (none past ``8w − 1``: ``t ≤ 8w``), then the ``t − 1`` bits
of ``|d|`` below its top bit, highest first. Each decision has a **context**, a 16-bit
probability that the answer is no, which moves 1/16 of the way to the answer after each use:
``unary[j]`` for ``t > j``; ``mantissa[t][k]`` for the first two bits below the top (``k`` 0, 1);
the others are coded at one half, unchanged. Every context starts at one half in each segment.

The decisions are coded with rANS (state in ``[2^16, 2^32)``, 12-bit probabilities,
renormalized by 16-bit words): the writer records every decision and its probability forwards,
then encodes them backwards; the reader decodes forwards and must end on the writer's initial
state, so a changed byte is noticed there if not before. A piece is self-delimiting.

The same functions run compiled (numba) or by Python, with the same bytes.
"""

from __future__ import annotations

import numpy as np

from . import jit

PROB_ONE = 1 << 16
"""A context's probability that a decision is "no" is in units of 2^−16 ..."""
HALF = 1 << 15
"""... and starts at one half."""

ADAPT = 4
"""After each decision its context moves ``(target − p) >> ADAPT`` toward it (1/16 of the way).
On the real-weights run 3, 4 and 5 give the magnitudes 0.331, 0.336 and 0.357 bits per change at
steps 1-5 and 0.390, 0.392 and 0.411 over 24 steps; 4 costs less than 3 where a tensor's moves do
not drift (about 0.05 bits per decision of estimation noise at 4)."""

L_STATE = 1 << 16
"""The rANS state lies in ``[L_STATE, 2^32)``; a piece's first four bytes are the state the reader
starts from, and it must end on ``L_STATE``."""


def _encode(mag, width):
    """The piece of magnitudes ``mag`` (≥ 1, ≤ 2^(8w − 1); change order) of ``width``-byte elements."""
    top = 8 * width
    n = mag.size
    tl = np.empty(n, np.int8)  # bit lengths
    nd = 0
    for i in range(n):  # decisions per change: min(t, top − 1) unary, t − 1 mantissa
        v = np.int64(mag[i])
        t = 0
        while v:
            v >>= 1
            t += 1
        tl[i] = t
        nd += (t if t < top else top - 1) + t - 1
    # forwards: each decision's 12-bit probability of no and its answer, as (p << 1) | answer
    code = np.empty(nd, np.uint16)
    unary = np.full(top + 1, HALF, np.int64)
    mant = np.full((top + 1) * 2, HALF, np.int64)
    q = 0
    u1 = np.int64(HALF)  # unary[1], the context of every change's first decision, kept in a register
    for i in range(n):
        m = np.int64(mag[i])
        t = np.int64(tl[i])
        p0 = u1 >> 4
        p0 = 1 if p0 < 1 else (4095 if p0 > 4095 else p0)
        if t > 1:
            code[q] = (p0 << 1) | 1
            u1 -= u1 >> ADAPT
        else:
            code[q] = p0 << 1
            u1 += (PROB_ONE - u1) >> ADAPT
            q += 1
            continue
        q += 1
        j = 2
        while j < top:
            p = unary[j]
            p0 = p >> 4
            p0 = 1 if p0 < 1 else (4095 if p0 > 4095 else p0)
            if t > j:
                code[q] = (p0 << 1) | 1
                unary[j] = p - (p >> ADAPT)
            else:
                code[q] = p0 << 1
                unary[j] = p + ((PROB_ONE - p) >> ADAPT)
                q += 1
                break
            q += 1
            j += 1
        for k in range(t - 1):
            b = (m >> (t - 2 - k)) & 1
            c = 2 * t + k
            p = mant[c] if k < 2 else HALF
            p0 = p >> 4
            p0 = 1 if p0 < 1 else (4095 if p0 > 4095 else p0)
            if b:
                code[q] = (p0 << 1) | 1
                if k < 2:
                    mant[c] = p - (p >> ADAPT)
            else:
                code[q] = p0 << 1
                if k < 2:
                    mant[c] = p + ((PROB_ONE - p) >> ADAPT)
            q += 1
    # backwards: rANS; x div f as (x · ceil(2^31 / f)) >> 31, at most 2 over for x < 2^32
    inv = np.empty(4097, np.int64)
    for f in range(1, 4097):
        inv[f] = ((1 << 31) + f - 1) // f
    words = np.empty(nd, np.uint16)
    w = 0
    x = np.int64(L_STATE)
    for q in range(nd - 1, -1, -1):
        e = np.int64(code[q])
        p0 = e >> 1
        yes = e & 1
        f = p0 + yes * (4096 - 2 * p0)  # the answer's frequency, at cumulative yes · p0
        if x >= (f << 20):
            words[w] = x & 0xFFFF
            w += 1
            x >>= 16
        d = (x * inv[f]) >> 31
        r = x - d * f
        while r < 0:
            d -= 1
            r += f
        x = (d << 12) + r + yes * p0
    out = np.empty(4 + 2 * w, np.uint8)
    for b in range(4):
        out[b] = (x >> (8 * b)) & 0xFF
    for i in range(w):
        word = np.int64(words[w - 1 - i])
        out[4 + 2 * i] = word & 0xFF
        out[5 + 2 * i] = word >> 8
    return out


def _decode(buf, at, nnz, width, mag):
    """Decode ``nnz`` magnitudes into ``mag`` from the piece at byte ``at`` of ``buf``; the byte
    after the piece, or −1 when the piece runs past ``buf`` or does not end on the initial state."""
    top = 8 * width
    size = buf.size
    if at + 4 > size:
        return -1
    x = np.int64(buf[at]) | (np.int64(buf[at + 1]) << 8) | (np.int64(buf[at + 2]) << 16) | (np.int64(buf[at + 3]) << 24)
    if x < L_STATE:
        return -1
    r = at + 4
    unary = np.full(top + 1, HALF, np.int64)
    mant = np.full((top + 1) * 2, HALF, np.int64)
    for i in range(nnz):
        t = 1
        while t < top:
            p = unary[t]
            p0 = p >> 4
            if p0 < 1:
                p0 = 1
            elif p0 > 4095:
                p0 = 4095
            s = x & 4095
            if s >= p0:
                x = (4096 - p0) * (x >> 12) + s - p0
                unary[t] = p - (p >> ADAPT)
                b = 1
            else:
                x = p0 * (x >> 12) + s
                unary[t] = p + ((PROB_ONE - p) >> ADAPT)
                b = 0
            if x < L_STATE:
                if r + 2 > size:
                    return -1
                x = (x << 16) | np.int64(buf[r]) | (np.int64(buf[r + 1]) << 8)
                r += 2
            if not b:
                break
            t += 1
        v = 1
        for k in range(t - 1):
            c = 2 * t + k
            p = mant[c] if k < 2 else HALF
            p0 = p >> 4
            if p0 < 1:
                p0 = 1
            elif p0 > 4095:
                p0 = 4095
            s = x & 4095
            if s >= p0:
                x = (4096 - p0) * (x >> 12) + s - p0
                b = 1
                if k < 2:
                    mant[c] = p - (p >> ADAPT)
            else:
                x = p0 * (x >> 12) + s
                b = 0
                if k < 2:
                    mant[c] = p + ((PROB_ONE - p) >> ADAPT)
            if x < L_STATE:
                if r + 2 > size:
                    return -1
                x = (x << 16) | np.int64(buf[r]) | (np.int64(buf[r + 1]) << 8)
                r += 2
            v = (v << 1) | b
        mag[i] = v
    if x != L_STATE:
        return -1
    return r


def _smoke(loops) -> None:
    enc, dec = loops
    mag = np.array([1, 1, 2, 3, 1, 30000, 7, 32768], np.int64)
    piece = enc(mag, 2)
    got = np.zeros(mag.size, np.int64)
    if piece.tobytes() != _encode(mag, 2).tobytes() or dec(piece, 0, mag.size, 2, got) != piece.size \
            or got.tolist() != mag.tolist():
        raise RuntimeError("the compiled magnitude coder disagrees with FORMAT.md §5d")


@jit.once
def _kernels():
    return jit.compile_loops(lambda c: (c(_encode), c(_decode)), _smoke)


def compiled() -> bool:
    """Whether the compiled coder is in use."""
    return _kernels() is not None


def encode(mag: np.ndarray, width: int, *, compiled_loops: bool = True) -> np.ndarray:
    """The magnitude piece (uint8) of changes of ``width``-byte elements, ``mag`` in change order."""
    loops = _kernels() if compiled_loops else None
    return (loops[0] if loops is not None else _encode)(np.ascontiguousarray(mag, dtype=np.int64), width)


def decode(buf: np.ndarray, at: int, nnz: int, width: int, *, compiled_loops: bool = True
           ) -> tuple[np.ndarray, int]:
    """``(magnitudes, end)`` of the piece at byte ``at`` of ``buf``; ``end`` −1 when it is bad."""
    loops = _kernels() if compiled_loops else None
    mag = np.empty(nnz, np.int64)
    end = (loops[1] if loops is not None else _decode)(buf, at, nnz, width, mag)
    return mag, end


def max_piece(nnz: int, width: int) -> int:
    """The longest piece of ``nnz`` changes: the state, and at most one word per decision."""
    return 4 + 2 * nnz * (16 * width - 2)
