"""Bit-exact round trips through encode -> store -> decode, for every dtype and shape."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber, model_digest
from xcluster.dtypes import DTYPE_NAMES, flat_bits, torch_dtype
from tests.unit.helpers import assert_state_equal, memory_store

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
