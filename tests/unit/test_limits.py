"""Resource limits: a hostile manifest that is well-formed by every other rule cannot make a
subscriber allocate past its limits or raise anything but a named XclusterError, and it keeps
serving its last good weights."""

from __future__ import annotations

import os

import pytest

from xcluster import Subscriber, SubscriberConfig
from xcluster.errors import FormatError, ResourceLimitError
from xcluster.format import parse_manifest, xxh3_128
from tests.unit.helpers import manifest_bytes
from tests.unit.test_bad_input import assert_untouched, env, rewrite_manifest  # noqa: F401 - fixture

HUGE = 1 << 39  # 512 GiB of uint8: under the default max_model_bytes (1 TiB)


def add_tensor(o: dict, name: str, shape: list[int]) -> int:
    o["tensors"].append({"name": name, "dtype": "uint8", "shape": shape, "digest": "0" * 32, "init": "none"})
    return len(o["tensors"]) - 1


def add_huge_tensor(o: dict) -> None:
    """A 512 GiB uint8 tensor, fully covered by planes segments in 64 blocks of 8 GiB (each
    within the default max_block_bytes; all well-formed), carried by a 64-byte chunk: only an
    allocation limit stops it."""
    t = add_tensor(o, "zz_huge", [HUGE])
    ci = len(o["chunks"])
    o["chunks"].append({"name": "chuge-000000.xc", "size": 64, "xxh3_128": xxh3_128(b"\0" * 64)})
    per_block = (1 << 33) // (1 << 31)
    for b in range(HUGE // (1 << 33)):
        o["blocks"].append({"chunk": ci, "offset": b, "encoding": "planes", "width": 1,
                            "streams": [["zstd", 1, 1 << 33]],
                            "segments": [[t, (b * per_block + k) << 31, 1 << 31, 1 << 31]
                                         for k in range(per_block)]})


@pytest.mark.parametrize("shape", [[0, 1 << 40, 1 << 30], [1 << 52, 1 << 52, 0], [0] + [1 << 10] * 8])
def test_zero_element_tensor_whose_strides_overflow_is_a_format_error(env, shape):
    """numel is 0, but torch computes strides (and storage size) with every dim counted as at
    least 1: their product overflows int64 inside torch.empty. Refused when parsing."""
    store, _, sub = env
    before = sub.model_digest
    rewrite_manifest(store, 2, lambda o: add_tensor(o, "zz_empty", shape))
    with pytest.raises(FormatError, match="zz_empty"):
        sub.sync()
    assert_untouched(sub, before)


def test_tensor_over_max_tensor_bytes_is_refused_before_fetching(env):
    store, _, _ = env
    sub = Subscriber(store=store, config=SubscriberConfig(max_tensor_bytes=1 << 30))
    sub.sync(until=1)
    before = sub.model_digest
    rewrite_manifest(store, 2, add_huge_tensor)
    fetched = []
    real = store.get_range
    store.get_range = lambda k, s, n: (fetched.append(k), real(k, s, n))[1]
    with pytest.raises(ResourceLimitError, match="zz_huge.*max_tensor_bytes"):
        sub.sync()
    assert not [k for k in fetched if k.endswith(".xc")]  # refused before any chunk was fetched
    assert_untouched(sub, before)


@pytest.mark.skipif(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >= HUGE,
                    reason="this machine could allocate 512 GiB")
def test_allocation_failure_is_a_named_error(env):
    """512 GiB passes every cap of the default config; torch.empty then fails: a named error,
    not a bare RuntimeError, and the last good weights stay."""
    store, _, sub = env
    before = sub.model_digest
    rewrite_manifest(store, 2, add_huge_tensor)
    store.put("versions/000000000002/chuge-000000.xc", b"\0" * 64)
    m = parse_manifest(manifest_bytes(store, 2))
    assert m.model_bytes < SubscriberConfig().max_model_bytes
    with pytest.raises(ResourceLimitError, match="zz_huge"):
        sub.sync()
    assert_untouched(sub, before)


# --- decode memory: one sparse block over a whole uint8 tensor --------------------------------
def sparse_store(tmp_path, n: int, every: int, config: SubscriberConfig | None = None):
    """v1: a uint8 keyframe of ``n`` elements, held by a subscriber; v2: +1 at every
    ``every``-th element, rewritten as one sparse-sub block over the whole tensor, with honest
    chunk, digests and HEAD."""
    import json

    import numpy as np
    import torch

    from xcluster import Publisher, PublisherConfig
    from xcluster.codec import streams
    from xcluster.codec.digest import model_digest, tensor_digest
    from xcluster.store import LocalStore
    from tests.unit.test_bad_input import rewrite_manifest as rewrite

    store = LocalStore(tmp_path / "s", fsync=False)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    u0 = torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)
    pub.publish({"u": u0})
    sub = Subscriber(store=store, config=config)
    assert sub.sync() == 1
    u1 = u0.clone()
    u1[::every] += 1
    pub.publish({"u": u1})
    nnz = len(range(0, n, every))
    gaps = np.full(nnz, every - 1, np.uint32)
    gaps[0] = 0
    planes = [gaps.view(np.uint8).reshape(-1, 4)[:, i].copy() for i in range(4)] + [np.full(nnz, 2, np.uint8)]
    enc = [streams.compress([p], level=1) for p in planes]
    payload = b"".join(p for _, p in enc)
    old = json.loads(manifest_bytes(store, 2))
    key = f"versions/000000000002/{old['chunks'][0]['name']}"
    store.put(key, payload)

    def mutate(o):
        o["chunks"] = [{"name": old["chunks"][0]["name"], "size": len(payload), "xxh3_128": xxh3_128(payload)}]
        o["blocks"] = [{"chunk": 0, "offset": 0, "encoding": "sparse-sub", "width": 1,
                        "streams": [[c, len(p), nnz] for c, p in enc], "segments": [[0, 0, n, nnz]]}]
        o["encodings"] = ["sparse-sub"]
        o["tensors"][0]["digest"] = tensor_digest(u1)
        o["model_digest"] = model_digest({"u": u1})
    rewrite(store, 2, mutate)
    return store, sub, u0, u1


def test_sparse_segment_denser_than_half_is_refused(tmp_path):
    """nnz == count is what no writer produces (dense-sub is smaller from 25% on, and writers
    may not use sparse past half): refused by the format before anything is decoded."""
    store, sub, u0, _ = sparse_store(tmp_path, 1 << 16, 1)
    with pytest.raises(FormatError, match="nnz"):
        sub.sync()
    assert sub.version == 1 and bool((sub.state_dict()["u"] == u0).all())


def test_sparse_decode_memory_is_bounded_by_the_tensor(tmp_path):
    """The densest legal sparse block over a uint8 tensor (every other element changed) is
    decoded without int64 positions for all of it: peak traced memory stays a small multiple
    of the tensor's bytes (it was ~16x)."""
    import tracemalloc

    n = 8 << 20
    store, sub, _, u1 = sparse_store(tmp_path, n, 2, SubscriberConfig(decode_workers=1))
    tracemalloc.start()
    try:
        assert sub.sync() == 2
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert bool((sub.state_dict()["u"] == u1).all())
    assert peak < 4 * n, f"peak {peak / n:.1f}x the tensor"


def test_block_over_max_block_bytes_is_refused_before_fetching(tmp_path):
    store, sub, u0, _ = sparse_store(tmp_path, 1 << 20, 2, SubscriberConfig(max_block_bytes=1 << 20))
    fetched = []
    real = store.get_range
    store.get_range = lambda k, s, n: (fetched.append(k), real(k, s, n))[1]
    with pytest.raises(ResourceLimitError, match="max_block_bytes"):
        sub.sync()
    assert not [k for k in fetched if k.endswith(".xc")]
    assert sub.version == 1 and bool((sub.state_dict()["u"] == u0).all())
