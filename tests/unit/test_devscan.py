"""The torch scan (codec/scan_torch.py) writes the numpy scan's bytes, bit for bit.

CI has no GPU: ``scan="torch"`` runs the same torch ops on CPU tensors. Where CUDA is present
the same tests also run with the tensors on the GPU.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber
from xcluster.codec import scan_torch
from xcluster.codec.kernels.changes import zigzag_diff
from xcluster.codec.encodings.sparse_exp2 import EXP_FIELDS
from xcluster.codec.encode import encode_version
from xcluster.codec.dtypes import UINT, dtype_name, np_bits
from xcluster.errors import ConfigError, StoreError
from tests.unit.helpers import assert_state_equal, memory_store
from tests.unit.test_commit_protocol import FailingStore
from tests.unit.test_roundtrip import perturb, random_tensor, ulp_steps

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]
SMALL = dict(block_bytes=4096, chunk_bytes=8192)  # ranges of 4096 / width elements: tensors span several


def _extremes(dt: torch.dtype, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Old/new pairs whose differences wrap around: 0 <-> all ones, top bit flips, ±1 steps,
    NaN payloads, -0.0 <-> 0.0, in a tensor of ``n`` elements (n not a multiple of 8)."""
    w = dt.itemsize
    top = (1 << (8 * w)) - 1
    pairs = [(0, top), (top, 0), (0, 1), (1, 0), (1 << (8 * w - 1), (1 << (8 * w - 1)) - 1),
             ((1 << (8 * w - 1)) - 1, 1 << (8 * w - 1)), (5, 5)]
    if dt.is_floating_point and w >= 2:
        sign, nan = 1 << (8 * w - 1), top >> 1  # -0.0 and a NaN with a full payload
        pairs += [(0, sign), (sign, 0), (nan, nan - 1), (nan, sign | nan)]
    if dt == torch.bool:
        pairs = [(0, 1), (1, 0), (1, 1)]
    old = random_tensor(dt, (n,), gen)
    new = old.clone()
    ob, nb = np_bits(old), np_bits(new)
    for i, (a, b) in enumerate(pairs):
        ob[3 * i], nb[3 * i] = a, b
    return old, new


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous view one element into a buffer (not 8-byte aligned: no word-wise scan)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    buf[1:] = t.reshape(-1)
    return buf[1:].view(t.shape)


def case(dt: torch.dtype, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A base and a new state with every kind of range: sparse, dense, unchanged, extremes, added,
    removed, reshaped, retyped, empty, a tail not a multiple of the scan's word, not word-aligned."""
    gen = torch.Generator().manual_seed(seed)
    old = {
        "dense": random_tensor(dt, (3001,), gen),
        "empty": random_tensor(dt, (0, 4), gen),
        "reshaped": random_tensor(dt, (6, 10), gen),
        "removed": random_tensor(dt, (17,), gen),
        "same": random_tensor(dt, (129,), gen),
        "sparse": random_tensor(dt, (50, 191), gen),
        "retyped": random_tensor(dt, (33,), gen),
    }
    new = {
        "dense": perturb(old["dense"], 0.6, gen),
        "empty": old["empty"].clone(),
        "reshaped": random_tensor(dt, (10, 6), gen),
        "same": old["same"].clone(),
        "sparse": perturb(old["sparse"], 0.004, gen),
        "retyped": random_tensor(torch.float32 if dt != torch.float32 else torch.int32, (33,), gen),
        "added": random_tensor(dt, (4099,), gen),
    }
    old["extremes"], new["extremes"] = _extremes(dt, 1003, gen)
    old["threshold"] = random_tensor(dt, (1000,), gen)  # exactly dense_threshold (0.25) changed: dense
    new["threshold"] = old["threshold"].clone()
    np_bits(new["threshold"])[torch.randperm(1000, generator=gen)[:250].numpy()] ^= 1
    old["unaligned"] = _unaligned(random_tensor(dt, (2001,), gen))
    new["unaligned"] = _unaligned(perturb(old["unaligned"], 0.01, gen))
    old["unaligned"] = _unaligned(random_tensor(dt, (2001,), gen))
    new["unaligned"] = _unaligned(perturb(old["unaligned"], 0.01, gen))
    # trained-weight-like values moved by an ulp or so, 2% of them (~80 changes a range): where
    # the exponent groups pay, so float dtypes get sparse-exp2 ranges
    if dt.is_floating_point:
        old["weights"] = (torch.randn(12000, generator=gen) * 0.02).to(dt)
        new["weights"] = ulp_steps(old["weights"], 0.02, gen)
        # a table of which a step changes a few rows (an embedding's): sparse-rows, its second range
        # (from element 4096) starting inside row 102, which changes
        old["table"] = (torch.randn(200, 40, generator=gen) * 0.02).to(dt)
        new["table"] = old["table"].clone()
        for r in (5, 60, 102, 150):
            new["table"][r] = ulp_steps(old["table"][r], 0.5, gen)
    return old, new


def encode_objects(new, base, scan: str) -> tuple[list, list, list, int]:
    chunks: list = []
    enc = encode_version(new, {n: f"{i:032x}" for i, n in enumerate(sorted(new))}, base,
                         CodecConfig(scan=scan, **SMALL), lambda e, d: chunks.append((e, bytes(d))))
    return chunks, enc.tensors, enc.blocks, enc.changed_elements


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_torch_scan_writes_the_numpy_bytes(dt, device):
    old, new = case(dt, seed=DTYPES.index(dt))
    want = encode_objects(new, old, "numpy")
    kinds = {b.encoding for b in want[2]}
    # a float dtype with exponent groups gets sparse-exp2 too (where it is smaller), on both scans
    exp = {"sparse-exp2", "sparse-rows"} if dtype_name(dt) in EXP_FIELDS else set()
    assert kinds == {"planes", "sparse-sub", "dense-sub"} | exp
    got = encode_objects({n: t.to(device) for n, t in new.items()}, {n: t.to(device) for n, t in old.items()},
                         "torch")
    assert got == want
    # a keyframe too
    assert encode_objects({n: t.to(device) for n, t in new.items()}, None, "torch") == encode_objects(new, None,
                                                                                                    "numpy")


def test_torch_scan_base_update_carries_the_new_values():
    old, new = case(torch.bfloat16, seed=7)
    enc = encode_version(new, {n: "0" * 32 for n in new}, old, CodecConfig(scan="torch", **SMALL),
                         lambda e, d: None)
    ranges, points = enc.update.ranges, enc.update.points
    assert ranges and points
    for name, s, e, values in ranges:
        np.testing.assert_array_equal(values, np_bits(new[name])[s:e])
    for name, pos, values in points:
        want = np.flatnonzero(np_bits(old[name]) != np_bits(new[name]))
        assert set(pos.tolist()) <= set(want.tolist()) and pos.dtype == np.int64
        np.testing.assert_array_equal(values, np_bits(new[name])[pos])
    assert sorted(enc.update.full) == ["added", "reshaped", "retyped"]


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_zigzag_bytes_match_numpy_at_every_wrap(width):
    dt = UINT[width]
    top = int(np.iinfo(dt).max)
    vals = [0, 1, 2, top, top - 1, top >> 1, (top >> 1) + 1, 12345 & top]
    a, b = zip(*itertools.product(vals, vals))
    old, new = np.array(a, dtype=dt), np.array(b, dtype=dt)
    want = zigzag_diff(old, new).view(np.uint8).reshape(-1, width)
    signed = np.dtype(f"i{width}") if width > 1 else np.dtype(np.uint8)  # flat_bits' views
    for device in DEVICES:
        got = scan_torch.zigzag_bytes(torch.from_numpy(old.view(signed)).to(device),
                                      torch.from_numpy(new.view(signed)).to(device))
        np.testing.assert_array_equal(got.cpu().numpy(), want)


def test_comparison_detects_a_wrong_scan(monkeypatch):
    """The equality above would catch a torch scan that is off by one bit anywhere."""
    old, new = case(torch.bfloat16, seed=3)
    want = encode_objects(new, old, "numpy")
    real = scan_torch.zigzag_bytes

    def off_by_one(o, n):
        z = real(o, n).clone()
        z[-1:, 0] ^= 1
        return z

    monkeypatch.setattr(scan_torch, "zigzag_bytes", off_by_one)
    assert encode_objects(new, old, "torch") != want


# --- the publisher ---------------------------------------------------------------------------------
def versions(dt: torch.dtype) -> list[dict[str, torch.Tensor]]:
    old, new = case(dt, seed=11)
    gen = torch.Generator().manual_seed(12)
    third = {n: perturb(t, 0.01, gen) for n, t in new.items() if n != "added"}  # a tensor goes again
    third["late"] = random_tensor(dt, (77,), gen)
    fourth = {n: perturb(t, 0.3, gen) for n, t in third.items()}
    return [old, new, third, fourth, {n: perturb(t, 0.001, gen) for n, t in fourth.items()}]


def publish_all(vs, *, device: str, scan: str, base_on: str = "device", keyframe_every: int = 4):
    store = memory_store()
    cfg = PublisherConfig(keyframe_every=keyframe_every, checkpoint_chain_fraction=None, base_on=base_on,
                          run_id="devscan",
                          codec=CodecConfig(scan=scan, **SMALL))
    pub = Publisher(store=store, config=cfg, clock=lambda: 1_700_000_000.0, attempt_id=lambda: "a0")
    sub = Subscriber(store=store)
    kinds = []
    for i, sd in enumerate(vs):
        res = pub.publish({n: t.to(device) for n, t in sd.items()}, step=i)
        kinds.append(res.kind)
        assert sub.sync() == res.version
        assert_state_equal(sub.state_dict(), sd)
    return {k: store.get(k).data for k in sorted(store.list())}, kinds, pub


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("base_on", ["device", "host"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.float8_e4m3fn],
                         ids=str)
def test_publisher_on_the_device_writes_the_same_objects(dt, base_on, device):
    vs = versions(dt)
    want, kinds, _ = publish_all(vs, device="cpu", scan="numpy")
    assert kinds == ["keyframe", "delta", "delta", "delta", "keyframe"]
    got, _, pub = publish_all(vs, device=device, scan="torch", base_on=base_on)
    assert list(got) == list(want)
    for k in want:
        assert got[k] == want[k], k
    base = pub._base
    assert all(t.device.type == "cpu" for t in base.host.values())
    if base_on == "host":
        assert base.scan is base.host
    else:
        assert base.scan is not base.host and all(t.device.type == device for t in base.scan.values())
        assert_state_equal({n: t.cpu() for n, t in base.scan.items()}, vs[-1])
    assert_state_equal(base.host, vs[-1])


def test_publisher_switches_between_scans():
    """numpy and torch scans take turns on one publisher (a state on the host, then on the device)."""
    vs = versions(torch.bfloat16)
    want, _, _ = publish_all(vs, device="cpu", scan="numpy", keyframe_every=100)
    store = memory_store()
    pubs = {s: PublisherConfig(keyframe_every=100, checkpoint_chain_fraction=None, run_id="devscan",
                               codec=CodecConfig(scan=s, **SMALL))
            for s in ("numpy", "torch")}
    pub = Publisher(store=store, config=pubs["numpy"], clock=lambda: 1_700_000_000.0, attempt_id=lambda: "a0")
    for i, sd in enumerate(vs):
        pub.config = pubs["torch" if i % 2 else "numpy"]
        pub.publish(sd, step=i)
    assert {k: store.get(k).data for k in sorted(store.list())} == want


def test_bad_scan_settings_are_named():
    with pytest.raises(ConfigError, match="scan"):
        CodecConfig(scan="cuda")
    with pytest.raises(ConfigError, match="base_on"):
        PublisherConfig(base_on="gpu")



@pytest.mark.parametrize("base_on", ["device", "host"])
def test_a_failed_publish_leaves_the_base_as_committed(base_on):
    """The host copy of a version that did not commit never leaks into the base: the next delta
    (of a different state) is still taken against the last committed version."""
    vs = versions(torch.bfloat16)
    store = FailingStore(memory_store(), "manifest")
    cfg = PublisherConfig(keyframe_every=100, checkpoint_chain_fraction=None, base_on=base_on,
                          codec=CodecConfig(scan="torch", **SMALL))
    pub = Publisher(store=store, config=cfg)
    sub = Subscriber(store=store.inner)
    pub.publish(vs[0])
    pub.publish(vs[1])
    store.armed = True
    with pytest.raises(StoreError):
        pub.publish(vs[2])
    store.armed = False
    gen = torch.Generator().manual_seed(5)
    nxt = {n: perturb(t, 0.01, gen) for n, t in vs[1].items()}  # most of what vs[2] changed is back
    for sd in (nxt, {n: perturb(t, 0.01, gen) for n, t in nxt.items()}):
        assert pub.publish(sd).kind == "delta"
        sub.sync()
        assert_state_equal(sub.state_dict(), sd)
