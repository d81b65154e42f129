"""``full-rans`` (FORMAT.md §5b): whole bf16 values, exponent and top mantissa bits rANS coded."""

from __future__ import annotations

import json
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber
from xcluster.codec import encode as encode_mod
from xcluster.codec import rans
from xcluster.codec.decode import decode_block
from xcluster.errors import DecodeError, FormatError, SchemaVersionError
from xcluster.format import FULL_RANS, PLANES, RANS_SCHEMA_VERSION
from xcluster.dtypes import torch_dtype
from tests.unit.helpers import assert_state_equal, memory_store, mkey
from tests.unit.test_roundtrip import SMALL, perturb, random_tensor
from tests.unit.test_roundtrip import roundtrip as publish_roundtrip

pytestmark = pytest.mark.skipif(not rans.compiled(), reason="numba unavailable: writers do not write full-rans")


def weights(n: int, seed: int = 0, scale: float = 0.02) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * scale).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


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


# --- through the publisher and the subscriber -------------------------------------------------
def _state(gen):
    return {"w": (torch.randn(300, 257, generator=gen) * 0.02).to(torch.bfloat16),
            "emb": (torch.randn(1000, 64, generator=gen) * 0.05).to(torch.bfloat16),
            "ones": torch.ones(4096, dtype=torch.bfloat16),  # constant: planes are smaller
            "f32": torch.randn(777, generator=gen),  # not bf16: planes
            "f16": torch.randn(500, generator=gen).to(torch.float16),  # not bf16 either
            "tiny": torch.randn(3, generator=gen).to(torch.bfloat16)}


def test_keyframes_and_new_tensors_are_full_rans_and_late_joiners_agree():
    gen = torch.Generator().manual_seed(1)
    cur = _state(gen)
    store = memory_store()
    codec = CodecConfig(rans_full=True, exp_groups=True, block_bytes=32 << 10, chunk_bytes=64 << 10)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=3, codec=codec))
    follower = Subscriber(store=store)
    joiners = []
    for i in range(7):
        if i == 4:
            cur["new"] = (torch.randn(5000, generator=gen) * 0.1).to(torch.bfloat16)
        res = pub.publish(cur, step=i)
        assert follower.sync() == res.version
        assert_state_equal(follower.state_dict(), cur)
        m = follower.manifest
        rans_tensors = {m.tensors[s.tensor].name for b in m.blocks if b.encoding == FULL_RANS for s in b.segments}
        if res.kind == "keyframe":
            joiners.append(Subscriber(store=store))
            assert rans_tensors == {"w", "emb"} | ({"new"} if "new" in cur else set())
            plane_tensors = {m.tensors[s.tensor].name for b in m.blocks if b.encoding == PLANES for s in b.segments}
            assert plane_tensors == {"ones", "f32", "f16", "tiny"}
            assert m.schema_version == RANS_SCHEMA_VERSION
        else:
            assert rans_tensors == ({"new"} if i == 4 else set())
        for j in joiners:
            assert j.sync() == res.version
            assert j.model_digest == follower.model_digest
        cur = {k: (v.float() + torch.randn(v.shape, generator=gen) * 1e-3).to(v.dtype) for k, v in cur.items()}
    assert len(joiners) == 3


def test_without_the_flag_or_numba_planes_are_written():
    gen = torch.Generator().manual_seed(2)
    for codec, patch in ((CodecConfig(rans_full=False), None),
                         (CodecConfig(rans_full=True), mock.patch.object(rans, "compiled", lambda: False))):
        store = memory_store()
        pub = Publisher(store=store, config=PublisherConfig(codec=codec))
        sub = Subscriber(store=store)
        if patch:
            with patch:
                pub.publish(_state(gen))
        else:
            pub.publish(_state(gen))
        sub.sync()
        assert {b.encoding for b in sub.manifest.blocks} == {PLANES}
        assert sub.manifest.schema_version < RANS_SCHEMA_VERSION


def test_old_readers_and_bad_manifests_are_refused():
    from xcluster import format as fmt

    gen = torch.Generator().manual_seed(3)
    store = memory_store()
    Publisher(store=store, config=PublisherConfig(codec=CodecConfig(rans_full=True))).publish(_state(gen))
    data = store.get(mkey(store, 1)).data
    obj = json.loads(data)
    assert obj["schema_version"] == RANS_SCHEMA_VERSION
    with pytest.raises(SchemaVersionError, match="upgrade"):  # a reader of schemas 1-5
        fmt._load_json(data, "m", fmt.MAX_MANIFEST_BYTES, fmt.MANIFEST_FORMAT, versions=(1, 2, 3, 4, 5))
    bad = dict(obj, schema_version=5)
    with pytest.raises(FormatError, match="a full-rans block needs schema_version 6"):
        fmt.parse_manifest(fmt.canonical_json(bad))
    # a full-rans segment on a tensor of another dtype
    bad = json.loads(data)
    f16 = [i for i, t in enumerate(bad["tensors"]) if t["dtype"] == "float16"][0]
    blk = [b for b in bad["blocks"] if b["encoding"] == FULL_RANS][0]
    blk["segments"][0] = [f16, 0, 100, 100]
    with pytest.raises(FormatError, match="only bfloat16"):
        fmt.parse_manifest(fmt.canonical_json(bad))
    # a declared raw length other than the segments fix
    bad = json.loads(data)
    blk = [b for b in bad["blocks"] if b["encoding"] == FULL_RANS][0]
    blk["streams"][2][2] += 1
    with pytest.raises(Exception, match="stream 2 declares"):
        fmt.parse_manifest(fmt.canonical_json(bad))


def test_decode_block_reads_every_segment_of_a_block():
    """Several tensors' segments in one block, decoded in order; the block's streams must be used up."""
    gen = torch.Generator().manual_seed(4)
    sd = {f"t{i}": (torch.randn(2000 + i, generator=gen) * 0.02).to(torch.bfloat16) for i in range(5)}
    store = memory_store()
    Publisher(store=store, config=PublisherConfig(codec=CodecConfig(rans_full=True))).publish(sd)
    sub = Subscriber(store=store)
    sub.sync()
    m = sub.manifest
    (blk,) = [b for b in m.blocks if b.encoding == FULL_RANS]
    assert len(blk.segments) == 5
    chunk = store.get(f"versions/{1:012d}/{m.chunks[blk.chunk].name}").data
    ops = decode_block(blk, chunk, m.tensors, where="t")
    assert [op.tensor for op in ops] == [s.tensor for s in blk.segments]
    # one segment fewer declared: the streams hold bytes nobody reads
    short = replace(blk, segments=blk.segments[:-1])
    with pytest.raises(DecodeError):
        decode_block(short, chunk, m.tensors, where="t")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(["bfloat16", "float16", "float32", "bool", "int8"]),
       shape=st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple),
       density=st.sampled_from([0.0, 0.01, 0.5, 1.0]), seed=st.integers(0, 2**31 - 1), force=st.booleans())
def test_property_keyframes_any_dtype_shape(dtype, shape, density, seed, force):
    """The hypothesis round trip with ``rans_full`` on and a keyframe every other version; forced,
    every bf16 range of whole values is written as full-rans whether it is smaller or not, however short."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch_dtype(dtype)
    cur = {"a": random_tensor(dt, shape, gen), "b": random_tensor(dt, (64, 67), gen)}
    versions = [cur]
    for _ in range(3):
        cur = {k: perturb(v, density, gen) for k, v in cur.items()}
        versions.append(cur)
    codec = replace(SMALL, rans_full=True)
    forced = mock.patch.object(encode_mod, "_full", lambda planes, bits, cfg: (FULL_RANS, list(rans.encode(bits))))
    if force:  # every length, down to one element
        with forced, mock.patch.object(encode_mod, "FULL_MIN_ELEMENTS", 1):
            publish_roundtrip(versions, keyframe_every=2, codec=codec)
    else:
        publish_roundtrip(versions, keyframe_every=2, codec=codec)


def test_torch_scan_writes_the_numpy_bytes():
    """A keyframe and a new tensor scanned with torch ops write the same full-rans objects as the numpy scan."""
    from xcluster.codec.encode import encode_version

    gen = torch.Generator().manual_seed(5)
    base = _state(gen)
    new = dict(base, added=(torch.randn(7000, generator=gen) * 0.01).to(torch.bfloat16))

    def objects(state, old, scan):
        chunks: list = []
        enc = encode_version(state, {n: f"{i:032x}" for i, n in enumerate(sorted(state))}, old,
                             CodecConfig(scan=scan, rans_full=True, block_bytes=16 << 10, chunk_bytes=32 << 10),
                             lambda e, d: chunks.append((e, bytes(d))))
        return chunks, enc.tensors, enc.blocks

    for state, old in ((base, None), (new, base)):
        want = objects(state, old, "numpy")
        assert FULL_RANS in {b.encoding for b in want[2]}
        assert objects(state, old, "torch") == want
