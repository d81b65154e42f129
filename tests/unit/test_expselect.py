"""Select by 64-element masks (codec/expselect.py): the same positions, in the same order, as the
plain loop and numpy, for every width of raw bits and every case the masks treat apart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xcluster.codec.kernels import exprank, jit

pytest.importorskip("numba")
from xcluster.codec.kernels import expselect  # noqa: E402  (imports numba)

ROOT = Path(__file__).resolve().parents[2]

# (raw bits, shift, mask) of bf16, fp16, fp32, fp8 e4m3 and e5m2 exponents, and whole bytes as
# groups (all 256 values of 8 bits: the window's subtraction wraps with no room to spare)
FIELDS = [(np.uint16, 7, 0xFF), (np.uint16, 10, 0x1F), (np.uint32, 23, 0xFF), (np.uint8, 3, 0xF), (np.uint8, 2, 0x1F),
          (np.uint8, 0, 0xFF)]
LAYOUTS = ["narrow", "wide", "one", "top", "ends"]

needs_numba = pytest.mark.skipif(not exprank.compiled(), reason="numba is not importable here")


def _bits(udt, shift, mask, n, layout, rng):
    """Raw bits whose groups are: ``narrow`` mostly a run of 8 groups (as real weights' exponents
    are), 3% anywhere; ``wide`` anywhere; ``one`` all in one group (many finds per block); ``top``
    the last three groups (the window runs past the last group); ``ends`` the last six and the
    first four (below a window at the top)."""
    ng = mask + 1
    if layout == "narrow":
        lo = max(0, ng // 2 - 4)
        g = np.where(rng.random(n) < 0.97, rng.integers(lo, min(ng, lo + 8), n), rng.integers(0, ng, n))
    elif layout == "wide":
        g = rng.integers(0, ng, n)
    elif layout == "one":
        g = np.full(n, ng // 3)
    elif layout == "ends":
        g = np.where(rng.random(n) < 0.9, rng.integers(max(0, ng - 6), ng, n), rng.integers(0, min(4, ng), n))
    else:
        g = rng.integers(max(0, ng - 3), ng, n)
    width = 8 * np.dtype(udt).itemsize
    low = rng.integers(0, 1 << shift, n)
    sign = rng.integers(0, 2, n) << (shift + mask.bit_length())  # the bits above the field
    raw = (g.astype(np.uint64) << np.uint64(shift)) | low.astype(np.uint64) | sign.astype(np.uint64)
    return (raw & np.uint64((1 << width) - 1)).astype(udt)


def _query(bits, pos, shift, mask):
    """select's arguments for the changed positions ``pos``: groups present, starts, ranks."""
    g, r, _ = exprank.ranks(bits, pos, shift, mask, numpy=True)
    order = np.lexsort((r, g))
    present = np.unique(g)
    starts = np.append(np.searchsorted(g[order], present), pos.size).astype(np.int64)
    return present, starts, r[order], order


@pytest.fixture(scope="module")
def fast():
    """The mask select built afresh (not through exprank's load-time check, which would put the
    plain loop in its place if it disagreed, so a fault would show only as a slower select)."""
    from numba import njit

    return expselect.build(lambda f: njit(nogil=True, cache=False, boundscheck=False, error_model="numpy")(f))[1]


def _run(fn, bits, present, starts, ranks, shift, mask):
    t = bits.dtype.type
    return fn(bits, present, starts, ranks, t(shift), t(mask), mask + 1)


@needs_numba
def test_the_mask_select_is_in_use_where_numba_is_installed():
    k = exprank.kernels()
    assert k.select is not k.plain_select  # it compiled and agreed with the plain loop when loaded


@needs_numba
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("field", FIELDS, ids=["bf16", "fp16", "fp32", "e4m3", "e5m2", "byte"])
def test_mask_select_matches_the_plain_loop_and_numpy(fast, field, layout):
    udt, shift, mask = field
    k = exprank.kernels()
    rng = np.random.default_rng(abs(hash((layout, shift, mask))) % 2**32)
    for n in (0, 1, 63, 64, 65, 129, 1000, 4099):
        for density in (0.0, 0.002, 0.01, 0.3, 1.0):
            bits = _bits(udt, shift, mask, n, layout, rng)
            pos = np.flatnonzero(rng.random(n) < density).astype(np.int64)
            present, starts, ranks, order = _query(bits, pos, shift, mask)
            got = _run(fast, bits, present, starts, ranks, shift, mask)
            plain = _run(k.plain_select, bits, present, starts, ranks, shift, mask)
            npos, nidx, nok = exprank.select_sorted(bits, present, starts, ranks, shift, mask, numpy=True)
            assert got[2] and plain[2] and nok
            assert got[0].tolist() == plain[0].tolist() == npos.tolist() == pos.tolist(), (n, density)
            assert got[1].tolist() == plain[1].tolist() == nidx.tolist()
            assert order[got[1]].tolist() == list(range(pos.size))  # each find has its own rank


@needs_numba
@pytest.mark.parametrize("layout", ["narrow", "wide"])
def test_mask_select_refuses_a_rank_past_its_group(fast, layout):
    k = exprank.kernels()
    rng = np.random.default_rng(7)
    bits = _bits(np.uint16, 7, 0xFF, 3000, layout, rng)
    pos = np.flatnonzero(rng.random(3000) < 0.05).astype(np.int64)
    present, starts, ranks, _ = _query(bits, pos, 7, 0xFF)
    sizes = exprank.sizes(bits, present, 7, 0xFF)
    for i in range(present.size):  # the last rank of each group in turn set to the group's size
        bad = ranks.copy()
        bad[starts[i + 1] - 1] = sizes[i]
        assert not _run(fast, bits, present, starts, bad, 7, 0xFF)[2]
        assert not _run(k.plain_select, bits, present, starts, bad, 7, 0xFF)[2]
    members = set(((bits >> 7) & 0xFF).tolist())
    if layout == "wide":  # every group has members
        assert len(members) == 256
        return
    empty = present.copy()
    empty[0] = next(g for g in range(256) if g not in members)  # a group without any member
    assert not _run(fast, bits, np.sort(empty), starts, ranks, 7, 0xFF)[2]


@needs_numba
def test_dense_ranges_go_to_the_plain_loop(monkeypatch):
    k = exprank.kernels()
    n = 64 * 50
    assert exprank.select_loop(k, n // exprank.DENSE_RANGE, n) is k.select
    assert exprank.select_loop(k, n // exprank.DENSE_RANGE + 1, n) is k.plain_select
    # and the readers take it: with the masks made to fail, only dense ranges still select
    broken = k._replace(select=lambda *a: (np.empty(0, np.int64), np.empty(0, np.int64), False))
    monkeypatch.setattr(exprank, "_kernels", lambda: broken)
    rng = np.random.default_rng(3)
    bits = _bits(np.uint16, 7, 0xFF, n, "narrow", rng)
    for m, works in ((n // exprank.DENSE_RANGE, False), (n // exprank.DENSE_RANGE + 1, True)):
        pos = np.sort(rng.choice(n, m, replace=False)).astype(np.int64)
        present, starts, ranks, _ = _query(bits, pos, 7, 0xFF)
        got, _, ok = exprank.select_sorted(bits, present, starts, ranks, 7, 0xFF)
        assert ok is works and (got.tolist() == pos.tolist()) is works


def test_mask_select_compiles_for_a_generic_cpu():
    """Without AVX2 or AVX-512 (numba told to compile for a generic x86-64 or whatever this
    machine is): the vector step is plain LLVM IR, so the masks still compile and agree."""
    pytest.importorskip("numba")
    probe = ("import numpy as np\n"
             "from xcluster.codec.kernels import exprank\n"
             "k = exprank.kernels()\n"
             "assert k is not None and k.select is not k.plain_select\n"
             "bits = (np.arange(5000, dtype=np.uint16) % 23 + 100) << np.uint16(7)\n"
             "pos = np.arange(3, 5000, 37, dtype=np.int64)\n"
             "g, r, _ = exprank.ranks(bits, pos, 7, 0xFF)\n"
             "o = np.lexsort((r, g)); p = np.unique(g)\n"
             "s = np.append(np.searchsorted(g[o], p), pos.size).astype(np.int64)\n"
             "got = k.select(bits, p, s, r[o], np.uint16(7), np.uint16(0xFF), 256)\n"
             "assert got[2] and got[0].tolist() == pos.tolist(), got\n"
             "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CPU_NAME": "generic"}
    env.pop(jit.NO_COMPILE_ENV, None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_block_and_window_fit_the_mask_words():
    assert expselect.BLOCK == 64  # one bit of a uint64 per element
    assert 1 <= expselect.WINDOW < 64


@needs_numba
def test_masks_that_fail_or_disagree_when_loaded_leave_the_plain_loop():
    k = exprank.kernels()

    def raises(*args):
        raise RuntimeError("does not compile here")

    def off_by_one(*args):
        pos, idx, ok = k.plain_select(*args)
        return pos + 1, idx, ok

    assert exprank._checked(k.select, k.ranks, k.plain_select) is k.select
    assert exprank._checked(raises, k.ranks, k.plain_select) is None
    assert exprank._checked(off_by_one, k.ranks, k.plain_select) is None
    with pytest.raises(RuntimeError):  # a broken plain loop is not hidden: no compiled kernels then
        exprank._checked(k.select, k.ranks, off_by_one)
