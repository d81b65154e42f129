"""The publisher never holds two bases: a keyframe is encoded beside the caller's weights alone."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber
from xcluster.errors import StoreError
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal, make_weights


def _state(seed: int) -> dict[str, torch.Tensor]:
    return make_weights(seed=seed, shapes={"a": (64, 64), "b": (32,)}, dtypes={"b": torch.float32})


class _WatchingStore:
    """Records, at each chunk upload, whether the publisher held a base then."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner, self.url, self.pub, self.base_at_put = inner, inner.url, None, []

    def put(self, key, data, **kw):
        if key.endswith(".xc") and self.pub is not None:
            self.base_at_put.append(self.pub._base is not None)
        return self.inner.put(key, data, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_keyframe_is_encoded_without_the_old_base_and_deltas_stay_right(tmp_path):
    store = _WatchingStore(LocalStore(tmp_path, fsync=False))
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    store.pub = pub
    s0, s1, s2 = _state(0), _state(1), _state(2)
    pub.publish(s0)
    store.base_at_put.clear()
    assert pub.publish(s1).kind == "delta"
    assert store.base_at_put and all(store.base_at_put)  # a delta is taken against the base
    store.base_at_put.clear()
    assert pub.publish(s2, keyframe=True).kind == "keyframe"
    assert store.base_at_put and not any(store.base_at_put)  # the old base was gone while encoding
    host = pub._base.host  # and a new one was made once committed, private to the publisher
    assert all(host[n].data_ptr() != s2[n].data_ptr() for n in host)
    assert_state_equal(host, s2)
    s3 = {k: v.clone() for k, v in s2.items()}
    s3["a"].view(torch.int16).view(-1)[:10] += 1
    assert pub.publish(s3).kind == "delta"  # deltas against the new base are right
    sub = Subscriber(store=store)
    assert sub.sync() == 4
    assert_state_equal(sub.state_dict(), s3)


class _FailingChunks(_WatchingStore):
    def put(self, key, data, **kw):
        if key.endswith(".xc"):
            raise StoreError(f"{key}: disk full")
        return self.inner.put(key, data, **kw)


def test_a_failed_publish_keeps_no_caller_weights(tmp_path):
    """An upload's failure, held by its future, must not reach back to the publisher's frames (a
    cycle: the caller's weights would stay until the cycle collector runs)."""
    pub = Publisher(store=_FailingChunks(LocalStore(tmp_path, fsync=False)), config=PublisherConfig())
    gc.collect()
    gc.disable()
    try:
        state = _state(0)
        ref = weakref.ref(state["a"])
        with pytest.raises(StoreError, match="disk full"):
            pub.publish(state)
        del state
        assert ref() is None, "the caller's weights outlived the failed publish"
    finally:
        gc.enable()


def test_a_deltas_change_positions_are_kept_as_uint32():
    """They live until the version is committed (the base update): a delta's largest array."""
    from xcluster.codec.encode import CodecConfig, encode_version

    base = {"w": torch.zeros(3, 5000, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"].view(-1)[[3, 14_999]] = 1
    enc = encode_version(new, {"w": "-"}, base, CodecConfig(block_bytes=4096, chunk_bytes=4096), lambda e, d: None)
    pos = [p for _, p, _ in enc.update.points]
    assert all(p.dtype == np.uint32 for p in pos) and np.concatenate(pos).tolist() == [3, 14_999]
