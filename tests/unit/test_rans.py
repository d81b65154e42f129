"""``full-rans`` (FORMAT.md §5b): whole bf16 values, exponent and top mantissa bits rANS coded."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber
from xcluster.codec import rans
from xcluster.errors import DecodeError
from xcluster.format import PLANES, RANS_SCHEMA_VERSION
from tests.unit.helpers import bf16_weights as weights
from tests.unit.helpers import memory_store
from tests.unit.test_full_values import state

pytestmark = pytest.mark.skipif(not rans.compiled(), reason="numba unavailable: writers do not write full-rans")


def roundtrip(u: np.ndarray, *, python: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pieces = rans.encode(u, python=python)
    r = rans.SegmentReader(list(pieces), where="t", python=python)
    got = r.segment(u.size, "t")
    r.finish()
    assert got.dtype == np.uint16 and np.array_equal(got, u)
    return pieces


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 63, 4096, 4099, 100_003])
def test_roundtrip_every_length(n):
    roundtrip(weights(n, seed=n))


@pytest.mark.parametrize("kind", ["constant", "two", "every-symbol", "random-bits", "specials"])
def test_roundtrip_odd_distributions(kind):
    gen = np.random.default_rng(3)
    if kind == "constant":  # one symbol with frequency 4096: no words at all
        u = np.full(10_001, 0x3F80, dtype=np.uint16)
    elif kind == "two":
        u = np.where(gen.random(9999) < 0.999, 0x3F80, 0xBF81).astype(np.uint16)
    elif kind == "every-symbol":  # 1024 symbols, many rare: normalising takes from the frequent
        u = np.concatenate([np.arange(1 << 16, dtype=np.uint16), np.full(50_000, 0x3C00, dtype=np.uint16)])
    elif kind == "random-bits":
        u = gen.integers(0, 1 << 16, 77_777, dtype=np.uint16)
    else:  # NaN payloads, infinities, signed zeros, subnormals
        u = np.array([0x7FC1, 0xFFFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F] * 37, dtype=np.uint16)
    table, words, raw = roundtrip(u)
    freq = table[:2048].view("<u2")
    assert int(freq.sum()) == rans.TOTAL
    assert set(np.flatnonzero(freq)) == set(np.unique((u >> 5) & 1023).tolist())
    if kind == "constant":
        assert words.size == rans.STATE_BYTES


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.lists(st.integers(0, (1 << 16) - 1), min_size=1, max_size=300), skew=st.integers(0, 3))
def test_property_any_values(data, skew):
    u = np.array(data, dtype=np.uint16)
    if skew:  # fewer distinct symbols, as in real weights
        u = (u & np.uint16(0x803F)) | np.uint16(0x3C00 + 0x40 * skew)
    roundtrip(u)


def test_compiled_and_python_loops_write_and_read_the_same():
    for n in (1, 3, 5, 1001):
        u = weights(n, seed=n)
        a = rans.encode(u)
        b = roundtrip(u, python=True)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_normalize_is_exact_and_keeps_every_symbol():
    gen = np.random.default_rng(5)
    for _ in range(50):
        counts = np.where(gen.random(1024) < 0.3, gen.integers(1, 10**6, 1024) ** gen.integers(1, 3, 1024), 0)
        if not counts.any():
            continue
        f = rans.normalize(counts)
        assert int(f.sum()) == rans.TOTAL
        assert ((f > 0) == (counts > 0)).all()
    with pytest.raises(ValueError):
        rans.normalize(np.zeros(1024, dtype=np.int64))


def test_it_pays_on_weights():
    """About 10.6 bits per element on Gaussian-like weights, against 16 raw (byte planes + zstd
    spend about 11.0 on such data)."""
    u = weights(200_000)
    table, words, raw = rans.encode(u)
    bits = 8 * (words.size + raw.size) / u.size
    assert 9.5 < bits < 11.0


# --- every check a reader makes ---------------------------------------------------------------
def _pieces(n=4099):
    return [p.copy() for p in rans.encode(weights(n, seed=7))]


def _read(pieces, n=4099):
    r = rans.SegmentReader(pieces, where="t")
    out = r.segment(n, "w")
    r.finish()
    return out


@pytest.mark.parametrize("case, match", [
    ("freq-sum", "sum to"),
    ("lane-words", "more words than it has elements"),
    ("state-low", "initial state"),
    ("words-short", "words stream holds"),
    ("raw-short", "raw stream ends early"),
    ("padding", "padding"),
    ("tables-short", "tables stream ends early"),
    ("left-over", "left over"),
    ("final-state", "do not end where they began|ran out of words"),
])
def test_reader_rejects(case, match):
    t, w, r = _pieces()
    if case == "freq-sum":
        f = t[:2048].view("<u2")
        f[int(np.flatnonzero(f)[0])] += 1
    elif case == "lane-words":
        t[2048:2052] = np.array([5000], "<u4").view(np.uint8)
    elif case == "state-low":
        w[0:4] = np.array([65535], "<u4").view(np.uint8)
    elif case == "words-short":
        w = w[:-2]
    elif case == "raw-short":
        r = r[:-1]
    elif case == "padding":  # 4099 elements: 6 bits used of the last byte
        r[-1] |= 0x80
    elif case == "tables-short":
        t = t[:-1]
    elif case == "left-over":
        r = np.concatenate([r, np.zeros(1, np.uint8)])
    elif case == "final-state":
        w[1] ^= 0x10  # lane 0's initial state
    with pytest.raises(DecodeError, match=match):
        _read([t, w, r])


def test_flipped_bits_are_caught_or_change_the_values():
    """Any bit flipped in the tables or words is caught by the reader's checks, or the values
    change (which the tensor digest then catches): never a crash, never a silent read past a lane."""
    u = weights(5003, seed=9)
    pieces = rans.encode(u)
    caught = 0
    for s in range(2):
        for byte in range(0, pieces[s].size, max(1, pieces[s].size // 40)):
            bad = [p.copy() for p in pieces]
            bad[s][byte] ^= 1 << (byte % 8)
            try:
                got = _read(bad, u.size)
            except DecodeError:
                caught += 1
                continue
            assert not np.array_equal(got, u) or (s == 0 and byte < 2048)  # an unused symbol's zero stays unused
    assert caught > 10


# --- through the publisher (and tests/unit/test_full_values.py) -------------------------------
def test_without_the_flag_or_numba_planes_are_written():
    gen = torch.Generator().manual_seed(2)
    for codec, patch in ((CodecConfig(rans_full=False), None),
                         (CodecConfig(rans_full=True), mock.patch.object(rans, "compiled", lambda: False))):
        store = memory_store()
        pub = Publisher(store=store, config=PublisherConfig(codec=codec))
        sub = Subscriber(store=store)
        if patch:
            with patch:
                pub.publish(state(gen))
        else:
            pub.publish(state(gen))
        sub.sync()
        assert {b.encoding for b in sub.manifest.blocks} == {PLANES}
        assert sub.manifest.schema_version < RANS_SCHEMA_VERSION
