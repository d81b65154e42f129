"""codec/scatter.py: adding changes at scattered positions, compiled and with numpy, wraps the same."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xcluster.codec.kernels import scatter


@pytest.mark.skipif(not scatter.compiled(), reason="numba is not importable here")
@settings(max_examples=60, deadline=None)
@given(udt=st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]), n=st.integers(1, 3000),
       density=st.sampled_from([0.001, 0.05, 0.5, 1.0]), pos_dt=st.sampled_from([np.int64, np.uint32]),
       seed=st.integers(0, 2**31))
def test_compiled_and_numpy_agree_and_undo_restores(udt, n, density, pos_dt, seed):
    rng = np.random.default_rng(seed)
    info = np.iinfo(udt)
    bits = rng.integers(0, int(info.max) + 1, size=n, dtype=np.uint64).astype(udt)
    bits[:: max(1, n // 7)] = info.max  # values that wrap past the top
    pos = np.flatnonzero(rng.random(n) < density).astype(pos_dt)
    diff = rng.integers(0, int(info.max) + 1, size=pos.size, dtype=np.uint64).astype(udt)
    want = bits.copy()
    want[pos] = want[pos] + diff
    for use_numpy in (False, True):
        got = bits.copy()
        scatter.scatter_add(got, pos, diff, numpy=use_numpy)
        assert got.tobytes() == want.tobytes()
        scatter.scatter_add(got, pos, diff, subtract=True, numpy=use_numpy)
        assert got.tobytes() == bits.tobytes()


@pytest.mark.skipif(not scatter.compiled(), reason="numba is not importable here")
@settings(max_examples=60, deadline=None)
@given(udt=st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]), n=st.integers(1, 3000),
       density=st.sampled_from([0.001, 0.05, 0.5, 1.0]), start=st.integers(0, 50), seed=st.integers(0, 2**31))
def test_from_gaps_compiled_and_numpy_agree_and_undo_restores(udt, n, density, start, seed):
    """scatter_gaps lands on the positions the gaps give (sparse-sub's p_0 = start + gap_0,
    p_k = p_(k-1) + gap_k + 1), compiled and with numpy, and undoes exactly."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(udt)
    bits = rng.integers(0, int(info.max) + 1, size=n + start, dtype=np.uint64).astype(udt)
    bits[:: max(1, n // 7)] = info.max  # values that wrap past the top
    pos = start + np.flatnonzero(rng.random(n) < density)
    gaps = np.diff(pos, prepend=start - 1).astype(np.uint32) - np.uint32(1)
    diff = rng.integers(0, int(info.max) + 1, size=pos.size, dtype=np.uint64).astype(udt)
    want = bits.copy()
    want[pos] = want[pos] + diff
    for use_numpy in (False, True):
        got = bits.copy()
        scatter.scatter_gaps(got, start, gaps, diff, numpy=use_numpy)
        assert got.tobytes() == want.tobytes()
        scatter.scatter_gaps(got, start, gaps, diff, subtract=True, numpy=use_numpy)
        assert got.tobytes() == bits.tobytes()
