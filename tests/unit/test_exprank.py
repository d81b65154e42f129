"""Ranks inside exponent groups (codec/exprank.py): the compiled loops and the numpy bitmaps give
the same answers, and both agree with a plain Python count."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xcluster.codec.kernels import exprank, jit

FIELDS = [(np.uint16, 7, 0xFF), (np.uint16, 10, 0x1F), (np.uint32, 23, 0xFF), (np.uint8, 3, 0xF), (np.uint8, 2, 0x1F)]


def _select(bits, present, starts, ranks, shift, mask, *, numpy):
    """select_sorted's answer in change order: the position of each of ``ranks``."""
    pos, idx, ok = exprank.select_sorted(bits, present, starts, ranks, shift, mask, numpy=numpy)
    out = np.full(len(ranks), -1, dtype=np.int64)
    out[idx] = pos
    return out, ok


def _reference(bits, pos, shift, mask):
    groups = [(int(b) >> shift) & mask for b in bits.tolist()]
    seen = [0] * (mask + 1)
    ranks = {}
    for i, g in enumerate(groups):
        ranks[i] = seen[g]
        seen[g] += 1
    return [groups[p] for p in pos], [ranks[p] for p in pos], seen


def _case(data, udt, n, density, seed):
    rng = np.random.default_rng(seed)
    info = np.iinfo(udt)
    # few groups, unevenly filled (as real weights are), plus every other value now and then
    narrow = rng.integers(0, 64, size=n).astype(udt) << udt(info.bits - 8)
    wide = rng.integers(0, int(info.max) + 1, size=n, dtype=np.uint64).astype(udt)
    bits = np.where(rng.random(n) < 0.9, narrow, wide).astype(udt)
    pos = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    return bits, pos


@pytest.mark.skipif(not exprank.compiled(), reason="numba is not importable here")
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS), n=st.integers(0, 3000), density=st.sampled_from([0.0, 0.003, 0.05, 0.5, 1.0]),
       seed=st.integers(0, 2**31))
def test_compiled_and_numpy_agree_with_a_plain_count(field, n, density, seed):
    udt, shift, mask = field
    bits, pos = _case(None, udt, n, density, seed)
    want_g, want_r, want_sizes = _reference(bits, pos, shift, mask)
    for use_numpy in (False, True):
        g, r, sizes = exprank.ranks(bits, pos, shift, mask, numpy=use_numpy)
        assert g.tolist() == want_g and r.tolist() == want_r
        present = np.unique(g)
        assert sizes[present].tolist() == [want_sizes[x] for x in present.tolist()]
        if not use_numpy:
            assert sizes.tolist() == want_sizes  # the compiled pass counts every group
        got = exprank.sizes(bits, present, shift, mask, numpy=use_numpy)
        assert got.tolist() == [want_sizes[x] for x in present.tolist()]
        # select inverts ranks: changes in group order, ranks ascending inside a group
        order = np.argsort(g, kind="stable")
        counts = np.array([int((g == x).sum()) for x in present.tolist()], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        out, ok = _select(bits, present, starts, r[order], shift, mask, numpy=use_numpy)
        assert ok and out.tolist() == pos[order].tolist()


@pytest.mark.parametrize("use_numpy", [False, True])
def test_select_refuses_a_rank_past_its_group(use_numpy):
    if not use_numpy and not exprank.compiled():
        pytest.skip("numba is not importable here")
    bits = np.array([0x100, 0x200, 0x100, 0x100], dtype=np.uint16)  # group 2 (>>7): 3 members, group 4: 1
    present = np.array([2, 4])
    starts = np.array([0, 2, 3])
    out, ok = _select(bits, present, starts, np.array([0, 2, 0]), 7, 0xFF, numpy=use_numpy)
    assert ok and out.tolist() == [0, 3, 1]
    for bad in ([0, 3, 0], [0, 2, 1]):  # past group 2's end; past group 4's end
        _, ok = _select(bits, present, starts, np.array(bad), 7, 0xFF, numpy=use_numpy)
        assert not ok
    _, ok = _select(bits, np.array([2, 9]), starts, np.array([0, 2, 0]), 7, 0xFF, numpy=use_numpy)
    assert not ok  # a group with no member at all


def test_numba_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(jit.NO_COMPILE_ENV, "1")
    exprank._kernels.cache_clear()
    try:
        assert not exprank.compiled()
        bits = np.arange(64, dtype=np.uint16) << np.uint16(7)
        g, r, _ = exprank.ranks(bits, np.array([3, 5]), 7, 0xFF)
        assert g.tolist() == [3, 5] and r.tolist() == [0, 0]
    finally:
        monkeypatch.delenv(jit.NO_COMPILE_ENV)
        exprank._kernels.cache_clear()


@pytest.mark.skipif(not exprank.compiled(), reason="numba is not importable here")
def test_kernels_compile_in_memory_when_numba_cannot_cache(monkeypatch):
    import numba

    real = numba.njit

    def njit(*args, **kw):
        if kw.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return real(*args, **kw)

    monkeypatch.setattr(numba, "njit", njit)
    exprank._kernels.cache_clear()
    try:
        assert exprank.compiled()
        bits = np.arange(64, dtype=np.uint16) << np.uint16(7)
        g, r, _ = exprank.ranks(bits, np.array([3, 5]), 7, 0xFF)
        assert g.tolist() == [3, 5] and r.tolist() == [0, 0]
    finally:
        monkeypatch.undo()
        exprank._kernels.cache_clear()


READERS = ("one call", "compiled", "numpy")
"""How a segment is read: ``sparse-exp2`` in one compiled call (codec/expread.py), numpy steps
around the compiled Rice decoder and select, or numpy alone."""


def _decode(pieces, olds, nnzs, dtype, udt, reader):
    from xcluster.codec.encodings import sparse_exp2 as expgroup
    from xcluster.errors import DecodeError

    r = expgroup.SegmentReader([p.copy() for p in pieces], np.dtype(udt).itemsize, "t")
    r.compiled = reader != "numpy"
    r.one_call = r.one_call and reader == "one call"
    try:
        out = [r.segment(old, nnz, dtype, udt) for old, nnz in zip(olds, nnzs)]
        r.finish()
    except DecodeError:
        return None
    return [(p.tolist(), z.tolist()) for p, z in out]


@pytest.mark.skipif(not exprank.compiled(), reason="numba is not importable here")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from([("bfloat16", np.uint16), ("float32", np.uint32), ("float8_e4m3fn", np.uint8)]),
       sizes=st.lists(st.integers(2, 4000), min_size=1, max_size=3), density=st.sampled_from([0.002, 0.03, 0.3]),
       seed=st.integers(0, 2**31))
def test_compiled_and_numpy_rice_decoders_agree(field, sizes, density, seed):
    """A block of 1-3 sparse-exp2 segments decodes to the same changes read in one compiled call,
    with the compiled Rice decoder and select, and with numpy alone; with a bit flipped anywhere,
    all refuse it or all decode the same."""
    from xcluster.codec.encodings import sparse_exp2 as expgroup
    from xcluster.codec.kernels.changes import zigzag_diff

    dtype, udt = field
    rng = np.random.default_rng(seed)
    olds, nnzs, seg_pieces = [], [], []
    for n in sizes:
        info = np.iinfo(udt)
        old = (rng.integers(0, int(info.max) + 1, size=n, dtype=np.uint64)  # uneven groups, many exponents
               // rng.integers(1, 64, size=n, dtype=np.uint64)).astype(udt)
        pos = np.flatnonzero(rng.random(n) < density)
        if pos.size == 0 or 2 * pos.size > n:
            pos = np.array([n // 2])
        new = old.copy()
        new[pos] += np.where(rng.random(pos.size) < 0.9, 1, 3 << (info.bits - 3)).astype(udt)
        seg_pieces.append(expgroup.build(old, pos, zigzag_diff(old[pos], new[pos]), dtype))
        olds.append(old)
        nnzs.append(pos.size)
    pieces = [np.concatenate([np.ascontiguousarray(p[i]).view(np.uint8) for p in seg_pieces])
              for i in range(expgroup.N_STREAMS)]
    good = _decode(pieces, olds, nnzs, dtype, udt, READERS[0])
    assert good is not None
    assert all(good == _decode(pieces, olds, nnzs, dtype, udt, r) for r in READERS[1:])
    for _ in range(12):
        s = int(rng.integers(0, len(pieces)))
        if pieces[s].size == 0:
            continue
        bad = [p.copy() for p in pieces]
        bit = int(rng.integers(0, 8 * bad[s].size))
        bad[s][bit // 8] ^= np.uint8(1 << (bit % 8))
        got = _decode(bad, olds, nnzs, dtype, udt, READERS[0])
        assert all(got == _decode(bad, olds, nnzs, dtype, udt, r) for r in READERS[1:])


@pytest.mark.skipif(not exprank.compiled(), reason="numba is not importable here")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from([("bfloat16", np.uint16), ("float16", np.uint16), ("float32", np.uint32),
                              ("float8_e4m3fn", np.uint8), ("float8_e5m2", np.uint8)]),
       n=st.integers(1, 5000), density=st.sampled_from([0.001, 0.02, 0.3, 0.5]), big=st.sampled_from([0.0, 0.1, 1.0]),
       seed=st.integers(0, 2**31))
def test_compiled_writer_writes_the_numpy_bytes(field, n, density, big, seed):
    """codec/expwrite.py writes a sparse-exp2 segment to the very bytes of the numpy steps
    (group_ranks, then pack), for every dtype with exponent groups, any share of changes that moved
    more than one step, and values up to the width's largest."""
    from xcluster.codec.encodings import sparse_exp2 as expgroup
    from xcluster.codec.kernels import expwrite

    dtype, udt = field
    rng = np.random.default_rng(seed)
    info = np.iinfo(udt)
    old = (rng.integers(0, int(info.max) + 1, size=n, dtype=np.uint64)
           // rng.integers(1, 64, size=n, dtype=np.uint64)).astype(udt)
    pos = np.flatnonzero(rng.random(n) < density)
    if pos.size == 0:
        pos = np.array([n - 1])
    z = rng.integers(1, 3, size=pos.size).astype(udt)
    moved = rng.random(pos.size) < big
    z[moved] = rng.integers(3, int(info.max) + 1, size=int(moved.sum()), dtype=np.uint64).astype(udt)
    order, ranks, sizes, counts = expgroup.group_ranks(old, pos, dtype)
    want = expgroup.pack(dtype, counts, sizes, ranks, z[order])
    got = expwrite.build(old, pos, z, *expgroup.EXP_FIELDS[dtype][:1], (1 << expgroup.EXP_FIELDS[dtype][1]) - 1)
    assert [g.dtype for g in got] == [np.uint8] * expgroup.N_STREAMS
    assert [g.tobytes() for g in got] == [np.ascontiguousarray(w).view(np.uint8).tobytes() for w in want]
    assert all(g.tobytes() == w.tobytes() for g, w in zip(expgroup.build(old, pos, z, dtype), got))


@pytest.mark.skipif(not exprank.compiled(), reason="numba is not importable here")
def test_compiled_writer_derives_every_rice_parameter_as_rice_k():
    """The Rice parameter the compiled writer stores for a group of ``pop`` elements with ``nnz``
    changes is expgroup.rice_k's, on both sides of every step of it."""
    from xcluster.codec.encodings import sparse_exp2 as expgroup
    from xcluster.codec.kernels import expwrite

    for nnz in (1, 2, 3, 5, 7):
        pops = np.arange(nnz, 9000, dtype=np.int64)
        steps = pops[np.diff([expgroup.rice_k(int(p), nnz) for p in pops], prepend=-1) != 0]
        for pop in sorted({int(p) + d for p in steps for d in (-1, 0)} - {nnz - 1}):
            old = np.full(pop, 0x3F80, dtype=np.uint16)  # one group, 0x7F
            pieces = expwrite.build(old, np.arange(nnz), np.ones(nnz, np.uint16), 7, 0xFF)
            assert pieces[0][4 * 256 + 0x7F] == expgroup.rice_k(pop, nnz), (pop, nnz)


@pytest.mark.skipif(not exprank.compiled(), reason="numba is not importable here")
def test_sparse_exp2_segments_are_read_in_one_compiled_call(monkeypatch):
    """Where numba works, a sparse-exp2 segment is read by codec/expread.py (no numpy steps), a
    sparse-exp one is not (its Rice parameters need the group sizes); without expread's loops the
    numpy steps read the same segment to the same changes."""
    from xcluster.codec.encodings import sparse_exp2 as expgroup
    from xcluster.codec.kernels import expread
    from xcluster.codec.kernels.changes import zigzag_diff

    rng = np.random.default_rng(5)
    old = (rng.standard_normal(20000) * 0.02).astype(np.float32).view(np.uint32)
    pos = np.flatnonzero(rng.random(old.size) < 0.02)
    new = old.copy()
    new[pos] += np.where(rng.random(pos.size) < 0.8, 1, 1 << 20).astype(np.uint32)
    z = zigzag_diff(old[pos], new[pos])
    calls = []
    real = expread.read
    monkeypatch.setattr(expread, "read", lambda *a: calls.append(1) or real(*a))
    r = expgroup.SegmentReader(expgroup.build(old, pos, z, "float32"), 4, "t")
    got, gz = r.segment(old, pos.size, "float32", np.uint32)
    r.finish()
    assert np.array_equal(got, pos) and np.array_equal(gz, z)
    assert r.one_call and len(calls) == 1
    monkeypatch.setattr(expread, "_kernels", lambda: None)
    r = expgroup.SegmentReader(expgroup.build(old, pos, z, "float32"), 4, "t")
    got, gz = r.segment(old, pos.size, "float32", np.uint32)
    assert not r.one_call and len(calls) == 1 and np.array_equal(got, pos) and np.array_equal(gz, z)


@pytest.mark.skipif(not exprank.compiled(), reason="numba is not importable here")
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 31), st.integers(0, 2**20)), min_size=1,
                       max_size=20),
       seed=st.integers(0, 2**31))
def test_compiled_and_numpy_rice_coders_write_the_same_bytes(groups, seed):
    """expgroup.pack's Rice codes (quotients, remainders): the compiled loop writes numpy's bytes,
    for every Rice parameter up to 31 and gaps from 0 to far past 2**k, and they decode back."""
    from xcluster.codec.encodings import sparse_exp2 as expgroup

    rng = np.random.default_rng(seed)
    n = np.array([g[0] for g in groups], dtype=np.int64)
    k = np.array([g[1] for g in groups], dtype=np.int64)
    ranks = np.concatenate([np.sort(rng.choice(c + spread, c, replace=False)) for c, _, spread in groups])
    unary, rem = exprank.rice_code(ranks, n, k)
    want_unary, want_rem = expgroup._rice_numpy(ranks, n, k)
    assert unary.tobytes() == want_unary.tobytes() and rem.tobytes() == want_rem.tobytes()
    got, uend, rend, err = exprank.rice_ranks(unary, 0, rem, 0, n, k)
    assert err == 0 and (uend, rend) == (unary.size, rem.size) and got.tolist() == ranks.tolist()
