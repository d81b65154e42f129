"""The magnitude coder of ``sparse-exp2`` (codec/kernels/rans.py, FORMAT.md §5d): the compiled loops
and Python write the same bytes and read them back; a decoder written from FORMAT.md's text alone
reads what the writer wrote; a damaged piece is refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xcluster.codec.kernels import rans


def spec_decode(piece: bytes, nnz: int, w: int) -> list[int]:
    """FORMAT.md §5d "Values", followed line by line (plain Python ints; no code shared with rans.py)."""
    x = int.from_bytes(piece[:4], "little")
    at = 4
    contexts: dict = {}

    def decision(ctx) -> int:
        nonlocal x, at
        big_p = contexts.get(ctx, 32768) if ctx is not None else 32768
        p = min(4095, max(1, big_p >> 4))
        s = x & 4095
        if s < p:
            x, answer = p * (x >> 12) + s, 0
        else:
            x, answer = (4096 - p) * (x >> 12) + s - p, 1
        if x < 2 ** 16:
            x = (x << 16) | int.from_bytes(piece[at:at + 2], "little")
            assert at + 2 <= len(piece), "words run past the piece"
            at += 2
        if ctx is not None:
            contexts[ctx] = big_p - (big_p >> 4) if answer else big_p + ((65536 - big_p) >> 4)
        return answer

    out = []
    for _ in range(nnz):
        t, j = 1, 1
        while j < 8 * w and decision(("U", j)):
            t, j = t + 1, j + 1
        a = 1
        for k in range(t - 1):
            a = (a << 1) | decision(("M", t, k) if k < 2 else None)
        out.append(a)
    assert x == 2 ** 16 and at == len(piece)
    return out


def magnitudes(rng: np.random.Generator, n: int, w: int, big: float) -> np.ndarray:
    top = 1 << (8 * w - 1)
    m = np.minimum(rng.geometric(0.6, n), top).astype(np.int64)
    moved = rng.random(n) < big
    m[moved] = rng.integers(1, top + 1, int(moved.sum()))
    if n:
        m[rng.integers(0, n)] = top  # the largest magnitude of the width (z = 2^(8w) - 1)
    return m


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=st.sampled_from([1, 2, 4]), n=st.integers(0, 600), big=st.sampled_from([0.0, 0.05, 1.0]),
       seed=st.integers(0, 2**31))
def test_compiled_python_and_the_spec_agree(w, n, big, seed):
    m = magnitudes(np.random.default_rng(seed), n, w, big)
    piece = rans.encode(m, w, compiled_loops=False)
    assert piece.dtype == np.uint8 and piece.size <= rans.max_piece(n, w)
    if rans.compiled():
        assert rans.encode(m, w).tobytes() == piece.tobytes()
    for compiled in (True, False):
        got, end = rans.decode(piece, 0, n, w, compiled_loops=compiled)
        assert end == piece.size and got.tolist() == m.tolist()
    assert spec_decode(piece.tobytes(), n, w) == m.tolist()


def test_a_piece_is_read_from_inside_a_stream_and_ends_where_it_ends():
    rng = np.random.default_rng(3)
    a, b = magnitudes(rng, 300, 2, 0.1), magnitudes(rng, 50, 2, 0.5)
    pa, pb = rans.encode(a, 2), rans.encode(b, 2)
    stream = np.concatenate([pa, pb])
    got_a, end = rans.decode(stream, 0, a.size, 2)
    assert end == pa.size and got_a.tolist() == a.tolist()
    got_b, end = rans.decode(stream, end, b.size, 2)
    assert end == stream.size and got_b.tolist() == b.tolist()


@pytest.mark.parametrize("compiled", [True, False])
def test_damaged_pieces_are_refused(compiled):
    """A truncated piece, a short stream or a changed state is refused (end −1), never read past
    its bytes; a flipped bit elsewhere is refused or reads other magnitudes (which the digest of the
    patched tensor then refuses: tests/unit/test_roundtrip.py)."""
    rng = np.random.default_rng(9)
    m = magnitudes(rng, 400, 2, 0.2)
    piece = rans.encode(m, 2)
    assert rans.decode(piece[:-2], 0, m.size, 2, compiled_loops=compiled)[1] == -1
    assert rans.decode(piece[:3], 0, m.size, 2, compiled_loops=compiled)[1] == -1
    assert rans.decode(piece, 0, m.size + 1, 2, compiled_loops=compiled)[1] == -1
    state = piece.copy()
    state[3] ^= 0x01
    assert rans.decode(state, 0, m.size, 2, compiled_loops=compiled)[1] == -1
    refused = 0
    for bit in range(32, 8 * piece.size, 7):
        bad = piece.copy()
        bad[bit // 8] ^= np.uint8(1 << (bit % 8))
        got, end = rans.decode(bad, 0, m.size, 2, compiled_loops=compiled)
        refused += end == -1
        assert end == -1 or got.tolist() != m.tolist()
    assert refused > 0


def test_the_coder_adapts():
    """Where every change moved one ulp (the high exponent groups) a magnitude costs a small fraction
    of a bit; where they spread, about their entropy plus what adapting fast costs (each context
    moves 1/16 of the way: about 0.05 bits per decision on data that does not drift)."""
    ones = np.ones(100_000, np.int64)
    assert rans.encode(ones, 2).size < 100_000 * 0.01 / 8 + 64
    rng = np.random.default_rng(1)
    spread = rng.integers(1, 9, 20_000)  # uniform over 1..8: 3 bits each
    assert 3 * 20_000 / 8 < rans.encode(spread, 2).size < 3.3 * 20_000 / 8
