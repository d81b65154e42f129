"""Bit-exact round trips through encode -> store -> decode, for every dtype and shape."""

from __future__ import annotations

from dataclasses import replace

import contextlib
import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber, model_digest
from xcluster.codec import encode
from xcluster.codec.kernels.changes import unzigzag
from xcluster.codec.dtypes import DTYPE_NAMES, flat_bits, torch_dtype
from xcluster.codec.encoding import core_names
from xcluster.codec.encodings import sparse_exp2
from tests.support.encodings import without_encodings
from tests.unit.helpers import assert_state_equal, memory_store
SPARSE_EXP2, SPARSE_SUB = "sparse-exp2", "sparse-sub"
CORE_ENCODINGS = core_names()

ALL_DTYPES = sorted(DTYPE_NAMES)
SMALL = CodecConfig(block_bytes=4096, chunk_bytes=8192)  # many blocks and chunks even for tiny tensors


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random raw bits of any dtype (so NaNs with payloads, Infs and -0.0 all occur)."""
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def perturb(t: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    new = t.clone()
    if t.numel() == 0 or density == 0:
        return new
    mask = torch.rand(t.numel(), generator=gen) < density
    bits = flat_bits(new)
    if t.dtype == torch.bool:
        bits[mask] = 1 - bits[mask]
    else:
        fresh = flat_bits(random_tensor(t.dtype, (t.numel(),), gen))
        bits[mask] = fresh[mask]
    return new


def roundtrip(versions: list[dict[str, torch.Tensor]], *, keyframe_every: int = 1000,
              codec: CodecConfig = SMALL) -> None:
    store = memory_store()
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=keyframe_every, codec=codec))
    sub = Subscriber(store=store)
    for i, sd in enumerate(versions):
        res = pub.publish(sd, step=i)
        assert sub.sync() == res.version
        assert sub.model_digest == res.model_digest == model_digest(sd)
        assert_state_equal(sub.state_dict(), {k: v.contiguous() for k, v in sd.items()})
    late = Subscriber(store=store)  # a new subscriber replays from the newest keyframe
    late.sync()
    assert_state_equal(late.state_dict(), {k: v.contiguous() for k, v in versions[-1].items()})


shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(ALL_DTYPES), shape=shapes, density=st.sampled_from([0.0, 0.01, 0.2, 0.5, 1.0]),
       seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 3))
def test_property_any_dtype_shape_density(dtype, shape, density, seed, steps):
    gen = torch.Generator().manual_seed(seed)
    dt = torch_dtype(dtype)
    big = (64, 67)  # large enough for word-wise scanning, sparse and dense ranges
    cur = {"a": random_tensor(dt, shape, gen), "b": random_tensor(dt, big, gen)}
    versions = [cur]
    for _ in range(steps):
        cur = {k: perturb(v, density, gen) for k, v in cur.items()}
        versions.append(cur)
    roundtrip(versions)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_special_values_survive(dtype):
    dt = torch_dtype(dtype)
    if dt.is_floating_point:
        vals = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0]).to(dt)
        t = vals.repeat(50)
        bits = flat_bits(t)
        if dt.itemsize >= 2:
            bits[4] = bits[4] | 1  # a NaN with a payload
    else:
        t = random_tensor(dt, (350,), torch.Generator().manual_seed(1))
    t2 = t.clone()
    flat_bits(t2)[::7] = flat_bits(t)[1::7][: flat_bits(t2)[::7].numel()]
    roundtrip([{"w": t}, {"w": t2}, {"w": t}])


def test_zero_dim_empty_and_noncontiguous():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(40, 30, generator=gen).to(torch.bfloat16)
    v1 = {"scalar": torch.tensor(3.5), "empty": torch.zeros(0, 5), "t": base.t(),  # non-contiguous
          "sliced": base[:, ::3], "count": torch.tensor(7, dtype=torch.int64)}
    v2 = dict(v1, scalar=torch.tensor(-0.0), t=(base + 1).t(), count=torch.tensor(8))
    assert not v1["t"].is_contiguous()
    roundtrip([v1, v2])


def test_tensors_added_removed_reshaped_retyped():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(32, 32, generator=gen).to(torch.bfloat16)
    v1 = {"w": w, "gone": torch.ones(10), "reshape": torch.arange(12.0), "retype": torch.zeros(8)}
    v2 = {"w": w, "new": torch.full((5,), 2.0), "reshape": torch.arange(12.0).reshape(3, 4),
          "retype": torch.zeros(8, dtype=torch.float64)}
    v3 = {"w": perturb(w, 0.1, gen), "new": torch.full((5,), 3.0), "reshape": torch.arange(12.0).reshape(3, 4),
          "retype": torch.ones(8, dtype=torch.float64)}
    roundtrip([v1, v2, v3])


def test_large_tensor_spans_many_ranges_and_chunks():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300_000, generator=gen).to(torch.bfloat16)
    roundtrip([{"w": w}, {"w": perturb(w, 0.01, gen)}, {"w": perturb(w, 0.5, gen)}],
              codec=CodecConfig(block_bytes=64 << 10, chunk_bytes=128 << 10))


def test_keyframe_boundaries_and_late_joiner():
    gen = torch.Generator().manual_seed(6)
    cur = {"w": torch.randn(5000, generator=gen).to(torch.bfloat16)}
    versions = [cur]
    for _ in range(7):
        cur = {"w": perturb(cur["w"], 0.02, gen)}
        versions.append(cur)
    roundtrip(versions, keyframe_every=3)


def test_tensor_through_empty_shape_and_back():
    roundtrip([{"x": torch.arange(4.0)}, {"x": torch.zeros(0)}, {"x": torch.arange(4.0) + 1},
               {"x": torch.zeros(0, dtype=torch.float64)}, {"x": torch.zeros(0)}, {"x": torch.ones(4)}])


def test_bool_views_with_odd_bytes_are_canonical():
    store = memory_store()
    pub, sub = Publisher(store=store), Subscriber(store=store)
    for raw in ([0, 1, 2, 255], [1, 0, 7, 0], [1, 0, 1, 0]):
        pub.publish({"b": torch.tensor(raw, dtype=torch.uint8).view(torch.bool)})
        sub.sync()
        got = sub.state_dict()["b"]
        assert got.view(torch.uint8).tolist() == [int(x != 0) for x in raw]


def test_publish_rejects_bad_steps_and_configs():
    from xcluster.errors import ConfigError

    pub = Publisher(store=memory_store())
    for bad in (-1, True, 2**60, 1.5, "3"):
        with pytest.raises(ConfigError):
            pub.publish({"w": torch.zeros(2)}, step=bad)
    assert pub.version == 0
    with pytest.raises(ConfigError):
        CodecConfig(block_bytes=1 << 32)
    with pytest.raises(ConfigError):
        CodecConfig(chunk_bytes=1 << 40)


# --- codec v2: sparse-exp2 (written) and sparse-exp (written before it, still read) -----------
EXP_DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]


def ulp_steps(t: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """``t`` with about ``density`` of its elements moved by ±1 raw step (a few by more, and some
    wrapping), the way an optimizer step moves low-precision weights."""
    new = t.clone()
    if t.numel() == 0:
        return new
    bits = flat_bits(new)
    mask = torch.rand(t.numel(), generator=gen) < density
    step = torch.randint(0, 2, (t.numel(),), generator=gen, dtype=torch.int64) * 2 - 1
    big = torch.rand(t.numel(), generator=gen) < 0.05
    step = torch.where(big, step * torch.randint(2, 1 << 20, (t.numel(),), generator=gen), step)
    bits[mask] = (bits[mask].to(torch.int64) + step[mask]).to(bits.dtype)
    return new


@contextlib.contextmanager
def always_exp():
    """Write ``sparse-exp2`` for every eligible sparse range, smaller or not (so the property test
    reaches its decoder on every shape)."""
    with mock.patch.object(sparse_exp2, "MIN_SAVING", -float("inf")), \
            mock.patch.object(sparse_exp2, "MIN_CHANGES", 1):
        yield


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(ALL_DTYPES), shape=shapes, density=st.sampled_from([0.001, 0.01, 0.1, 0.3]),
       seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 3), force=st.booleans(), ulp=st.booleans())
def test_property_sparse_exp_any_dtype_shape_density(dtype, shape, density, seed, steps, force, ulp):
    gen = torch.Generator().manual_seed(seed)
    dt = torch_dtype(dtype)
    move = ulp_steps if ulp and dt != torch.bool else perturb
    cur = {"a": random_tensor(dt, shape, gen), "b": random_tensor(dt, (64, 67), gen)}
    versions = [cur]
    for _ in range(steps):
        cur = {k: move(v, density, gen) for k, v in cur.items()}
        versions.append(cur)
    with always_exp() if force else contextlib.nullcontext():
        roundtrip(versions, keyframe_every=2)


def test_sparse_exp_is_chosen_and_late_joiners_agree():
    """A run of ulp steps with a keyframe every 3 versions: sparse-exp2 carries the deltas by
    default; a subscriber that joins at any keyframe decodes the same bytes to the same weights as
    one that followed from the start."""
    gen = torch.Generator().manual_seed(8)
    cur = {"w": (torch.randn(300, 257, generator=gen) * 0.02).to(torch.bfloat16),
           "h": torch.randn(4099, generator=gen).to(torch.float16),
           "f": torch.randn(5000, generator=gen) * 1e-3}
    store = memory_store()
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=3, codec=SMALL))
    follower = Subscriber(store=store)
    joiners = []
    for i in range(8):
        res = pub.publish(cur, step=i)
        assert follower.sync() == res.version
        if res.kind == "keyframe":
            joiners.append(Subscriber(store=store))
        for j in joiners:
            assert j.sync() == res.version
            assert j.model_digest == follower.model_digest
            assert_state_equal(j.state_dict(), follower.state_dict())
        assert_state_equal(follower.state_dict(), cur)
        if res.kind == "delta":
            m = follower.manifest
            assert SPARSE_EXP2 in m.encodings
            assert {m.tensors[s.tensor].dtype for b in m.blocks if b.encoding == SPARSE_EXP2
                    for s in b.segments} == {"bfloat16", "float16", "float32"}
        cur = {k: ulp_steps(v, 0.02, gen) for k, v in cur.items()}  # ≥ EXP_MIN_CHANGES in each range of 4096
    assert len(joiners) == 3


def test_core_only_config_writes_only_core_encodings():
    """``CodecConfig(encodings=CORE_ENCODINGS)``: what a fleet whose readers predate an encoding
    writes; its manifests name only the core."""
    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(20000, generator=gen) * 0.02).to(torch.bfloat16)
    store = memory_store()
    pub = Publisher(store=store, config=PublisherConfig(codec=CodecConfig(encodings=CORE_ENCODINGS)))
    sub = Subscriber(store=store)
    pub.publish({"w": w})
    assert sub.sync() == 1 and sub.manifest.encodings == ("planes",)
    w2 = ulp_steps(w, 0.01, gen)
    pub.publish({"w": w2})
    assert sub.sync() == 2 and sub.manifest.encodings == ("sparse-sub",)
    assert_state_equal(sub.state_dict(), {"w": w2})
    default = memory_store()  # the same versions with the default: sparse-exp2, as it is smaller here
    pub = Publisher(store=default)
    pub.publish({"w": w})
    pub.publish({"w": w2})
    sub = Subscriber(store=default)
    assert sub.sync() == 2 and sub.manifest.encodings == ("sparse-exp2",)
    assert_state_equal(sub.state_dict(), {"w": w2})


def test_sparse_exp_streams_are_checked():
    """Every byte of a sparse-exp2 block is accounted for: flipping any bit is caught by the
    decoder's checks or by the digest, never a crash or a silent wrong weight."""
    from xcluster.codec.encodings import sparse_exp2 as expgroup
    from xcluster.codec.kernels.changes import find_changes, zigzag_diff
    from xcluster.errors import DecodeError

    gen = torch.Generator().manual_seed(11)
    old = (torch.randn(5000, generator=gen) * 0.02).to(torch.bfloat16)
    new = ulp_steps(old, 0.02, gen)
    ob, nb = flat_bits(old).numpy().view("u2"), flat_bits(new).numpy().view("u2")
    pos, ov, nv = find_changes(ob, nb)
    pieces = expgroup.build(ob, pos, zigzag_diff(ov, nv), "bfloat16")
    caught = 0
    for s in range(len(pieces)):
        for byte in range(0, pieces[s].size, max(1, pieces[s].size // 7)):
            bad = [p.copy() for p in pieces]
            bad[s][byte] ^= 1 << (byte % 8)
            try:
                r = expgroup.SegmentReader(bad, 2, "t")
                p2, z2 = r.segment(ob, pos.size, "bfloat16", np.uint16)
                r.finish()
            except DecodeError:
                caught += 1
                continue
            out = ob.copy()
            out[p2] += unzigzag(z2)
            assert not np.array_equal(out, nb) or (np.sort(p2) == pos).all()  # changed bytes, changed weights
    assert caught > 0


def test_ranges_with_few_changes_stay_sparse_sub_without_a_sparse_exp_trial():
    """Below EXP_MIN_CHANGES changes a range is written sparse-sub and sparse-exp is not even built
    (its side information outweighs its gain there, and the trial costs more than the range)."""
    gen = torch.Generator().manual_seed(11)
    old = (torch.randn(16384, generator=gen) * 0.02).to(torch.bfloat16)
    cfg = CodecConfig()
    for n, want in ((sparse_exp2.MIN_CHANGES - 1, SPARSE_SUB), (sparse_exp2.MIN_CHANGES, SPARSE_EXP2)):
        new = old.clone()
        flat_bits(new)[torch.randperm(old.numel(), generator=gen)[:n]] += 1
        built: list[int] = []
        real_build = sparse_exp2.build

        def build(*a, **kw):
            built.append(1)
            return real_build(*a, **kw)

        with mock.patch.object(sparse_exp2, "build", build):
            enc = encode.encode_version({"w": new}, {"w": "0" * 32}, {"w": old}, cfg, lambda e, d: None)
        assert [b.encoding for b in enc.blocks] == [want] and enc.changed_elements == n
        assert built == ([] if want == SPARSE_SUB else [1])


def test_near_idle_ranges_stay_sparse_sub_when_sparse_exp_saves_under_exp_min_saving():
    """sparse-exp must save EXP_MIN_SAVING bits per element of the range (its decoder reads every
    element, sparse-sub's only the changes): a range of 2**22 elements with ~100 changes, where
    sparse-exp is smaller by less than that, stays sparse-sub after a trial; ranges of 2**23
    whose sparse-sub bytes are already under it skip the trial. The torch scan writes the same."""
    cfg = CodecConfig()
    built: list[int] = []
    real_build = sparse_exp2.build

    def build(*a, **kw):
        built.append(1)
        return real_build(*a, **kw)

    def encoded(n: int, step: float, min_saving: float) -> tuple[list[str], int]:
        built.clear()
        master = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02
        old = master.to(torch.bfloat16)  # an update under most elements' half ulp: only the smallest move
        new = (master + step * torch.randn(n, generator=torch.Generator().manual_seed(3)).sign()).to(torch.bfloat16)
        with mock.patch.object(sparse_exp2, "build", build), \
                mock.patch.object(sparse_exp2, "MIN_SAVING", min_saving):
            enc = encode.encode_version({"w": new}, {"w": "0" * 32}, {"w": old}, cfg, lambda e, d: None)
            # the torch scan (as on a GPU) decides alike
            assert encode.encode_version({"w": new}, {"w": "0" * 32}, {"w": old}, replace(cfg, scan="torch"),
                                         lambda e, d: None).blocks == enc.blocks
        segs = [s for b in enc.blocks for s in b.segments]
        assert all(sparse_exp2.MIN_CHANGES <= s.nnz < s.count // 20_000 for s in segs), [s.nnz for s in segs]
        return [b.encoding for b in enc.blocks], sum(s.stored for b in enc.blocks for s in b.streams)

    exp_enc, exp_bytes = encoded(1 << 22, 3e-10, 0.0)  # any saving: sparse-exp2 is smaller here
    sub_enc, sub_bytes = encoded(1 << 22, 3e-10, sparse_exp2.MIN_SAVING)
    assert (exp_enc, sub_enc, built) == ([SPARSE_EXP2], [SPARSE_SUB], [1])
    assert 0 < 8 * (sub_bytes - exp_bytes) < sparse_exp2.MIN_SAVING * (1 << 22)
    enc, size = encoded(1 << 24, 1e-10, sparse_exp2.MIN_SAVING)  # two ranges of 2**23 elements
    assert (enc, built) == ([SPARSE_SUB], []) and 8 * size <= sparse_exp2.MIN_SAVING * (1 << 24)


def test_a_reader_without_an_encoding_refuses_it_by_name_and_keeps_serving():
    """FORMAT.md §8: a writer allowed an encoding before every reader had it. The reader names the
    encoding, fetches no chunk and keeps its weights; restarted on an upgrade, it reads that version."""
    from xcluster.errors import UnknownEncodingError

    gen = torch.Generator().manual_seed(12)
    w = (torch.randn(20000, generator=gen) * 0.02).to(torch.bfloat16)
    store = memory_store()
    Publisher(store=store, config=PublisherConfig(codec=CodecConfig(encodings=CORE_ENCODINGS))).publish({"w": w})
    sub = Subscriber(store=store)
    assert sub.sync() == 1
    w2 = ulp_steps(w, 0.01, gen)
    Publisher(store=store).publish({"w": w2})  # a new publisher: a keyframe, full-exp by default
    fetched = []
    real_get_range = store.get_range
    with without_encodings("full-exp", "sparse-exp2"), \
            mock.patch.object(store, "get_range", lambda k, *a: fetched.append(k) or real_get_range(k, *a)):
        with pytest.raises(UnknownEncodingError, match="uses encoding 'full-exp'.*upgrade xcluster"):
            sub.sync()
    assert not [k for k in fetched if k.endswith(".xc")]
    assert sub.version == 1
    assert_state_equal(sub.state_dict(), {"w": w})
    upgraded = Subscriber(store=store)  # the node restarted on the upgrade
    assert upgraded.sync() == 2
    assert_state_equal(upgraded.state_dict(), {"w": w2})
