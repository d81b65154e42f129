"""Commit protocol, keyframe policy and chain replay."""

from __future__ import annotations

import json

import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber, model_digest
from xcluster.errors import ConcurrentPublisherError, StoreError
from xcluster.format import HEAD_KEY, manifest_key, parse_head, parse_manifest
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(128, 128, generator=g).to(torch.bfloat16)
    bits = w.view(torch.int16).reshape(-1)
    for s in range(1, step + 1):
        idx = torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(s))[:300]
        bits[idx] += 1
    return {"w": w, "step": torch.tensor(step)}


class FailingStore:
    """Wraps a store; while armed, fails every put whose key contains ``match``."""

    def __init__(self, inner, match: str):
        self.inner, self.match, self.armed = inner, match, False
        self.url = inner.url

    def put(self, key, data, **kw):
        if self.armed and self.match in key:
            raise StoreError(f"injected failure writing {key}")
        return self.inner.put(key, data, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_first_version_keyframe_then_every_k(tmp_path):
    pub = Publisher(str(tmp_path), config=PublisherConfig(keyframe_every=3))
    kinds = [pub.publish(weights(s), step=s).kind for s in range(7)]
    assert kinds == ["keyframe", "delta", "delta", "keyframe", "delta", "delta", "keyframe"]
    forced = pub.publish(weights(7), keyframe=True)
    assert forced.kind == "keyframe"


@pytest.mark.parametrize("fail_on", [".xc", "manifest.json", HEAD_KEY])
def test_crash_mid_commit_leaves_nothing_visible(tmp_path, fail_on):
    store = LocalStore(tmp_path)
    flaky = FailingStore(store, fail_on)
    pub = Publisher(store=flaky, config=PublisherConfig(keyframe_every=100))
    pub.publish(weights(0))
    sub = Subscriber(store=store)
    assert sub.sync() == 1
    flaky.armed = True
    with pytest.raises(StoreError, match="injected"):
        pub.publish(weights(1))
    # nothing of version 2 is visible or left behind; HEAD still names 1
    assert parse_head(store.get(HEAD_KEY).data).version == 1
    assert store.list("versions/000000000002/") == []
    assert sub.sync() == 1
    assert_state_equal(sub.state_dict(), weights(0))
    # the same publisher retries the same version number, still as a delta, and succeeds
    flaky.armed = False
    res = pub.publish(weights(1))
    assert (res.version, res.kind) == (2, "delta")
    assert sub.sync() == 2
    assert_state_equal(sub.state_dict(), weights(1))


def test_killed_publisher_leftovers_are_replaced_by_the_next(tmp_path):
    store = LocalStore(tmp_path)
    Publisher(store=store).publish(weights(0))
    # a publisher that died after uploading chunks and the manifest, before HEAD
    store.put("versions/000000000002/cdeadbeef-000000.xc", b"partial")
    store.put("versions/000000000002/manifest.json", b"{}")
    sub = Subscriber(store=store)
    assert sub.sync() == 1  # the orphan is invisible
    pub = Publisher(store=store)
    res = pub.publish(weights(1))
    assert res.version == 2
    assert sub.sync() == 2
    m = parse_manifest(store.get(manifest_key(2)).data)
    assert sorted(store.list("versions/000000000002/")) == sorted(
        ["versions/000000000002/manifest.json"] + [f"versions/000000000002/{c.name}" for c in m.chunks])


def test_a_fresh_uncommitted_manifest_is_respected_an_old_one_replaced(tmp_path):
    store = LocalStore(tmp_path)
    now = [1000.0]
    a = Publisher(store=store, clock=lambda: now[0])
    a.publish(weights(0))
    # a live publisher has just written manifest 2 and is about to move HEAD
    manifest_v2 = dict(json.loads(store.get(manifest_key(1)).data), version=2, keyframe_version=2)
    store.put(manifest_key(2), json.dumps(manifest_v2).encode())
    with pytest.raises(ConcurrentPublisherError, match="not an orphan"):
        a.publish(weights(1))
    assert store.get(manifest_key(2)).data == json.dumps(manifest_v2).encode()  # untouched
    now[0] += 3600  # an hour later nobody moved HEAD: it was a dead publisher's
    assert a.publish(weights(1)).version == 2
    assert Subscriber(store=store).sync() == 2


def test_two_publishers_cannot_both_commit(tmp_path):
    store = LocalStore(tmp_path)
    a = Publisher(store=store)
    b = Publisher(store=store)
    a.publish(weights(0))
    with pytest.raises(ConcurrentPublisherError):
        b.publish(weights(5))
    assert parse_head(store.get(HEAD_KEY).data).version == 1
    sub = Subscriber(store=store)
    sub.sync()
    assert sub.model_digest == model_digest(weights(0))
    assert a.publish(weights(1)).version == 2  # the first one carries on, unharmed
    assert sub.sync() == 2


class LandedButFailed:
    """HEAD writes land, then report a failure (a timeout after the server applied it)."""

    def __init__(self, inner, *, head_readable=True):
        self.inner, self.url, self.fail, self.head_readable = inner, inner.url, False, head_readable

    def put(self, key, data, **kw):
        etag = self.inner.put(key, data, **kw)
        if self.fail and key == HEAD_KEY:
            raise StoreError("injected: timed out after the write")
        return etag

    def get(self, key, **kw):
        if self.fail and not self.head_readable and key == HEAD_KEY:
            raise StoreError("injected: HEAD unreadable")
        return self.inner.get(key, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_head_write_that_landed_despite_an_error_counts_as_committed(tmp_path):
    store = LocalStore(tmp_path)
    flaky = LandedButFailed(store)
    pub = Publisher(store=flaky, config=PublisherConfig(keyframe_every=100))
    pub.publish(weights(0))
    flaky.fail = True
    res = pub.publish(weights(1))  # no exception: HEAD was re-read and names this attempt
    assert res.version == 2
    sub = Subscriber(store=store)
    assert sub.sync() == 2
    assert_state_equal(sub.state_dict(), weights(1))


def test_unknown_head_outcome_keeps_objects_and_recovers(tmp_path):
    store = LocalStore(tmp_path)
    flaky = LandedButFailed(store, head_readable=False)
    pub = Publisher(store=flaky, config=PublisherConfig(keyframe_every=100))
    pub.publish(weights(0))
    flaky.fail = True
    with pytest.raises(StoreError, match="injected"):
        pub.publish(weights(1))
    sub = Subscriber(store=store)
    assert sub.sync() == 2  # it had landed: nothing of it was deleted
    flaky.fail = False
    res = pub.publish(weights(2))  # re-reads HEAD, carries on as a keyframe
    assert (res.version, res.kind) == (3, "keyframe")
    assert sub.sync() == 3
    assert_state_equal(sub.state_dict(), weights(2))


def test_new_subscriber_starts_from_newest_keyframe(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=4))
    for s in range(10):
        pub.publish(weights(s), step=s)
    applied = []
    sub = Subscriber(store=store, on_apply=applied.append)
    assert sub.sync() == 10
    assert [(e.version, e.kind) for e in applied] == [(9, "keyframe"), (10, "delta")]
    assert_state_equal(sub.state_dict(), weights(9))


def test_far_behind_subscriber_replays_chain_or_jumps_to_keyframe(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=5))
    applied = []
    sub = Subscriber(store=store, on_apply=applied.append)
    pub.publish(weights(0))
    sub.sync()
    for s in range(1, 4):
        pub.publish(weights(s))
    sub.sync()  # 2, 3, 4 replayed as deltas
    assert [e.version for e in applied] == [1, 2, 3, 4]
    for s in range(4, 12):
        pub.publish(weights(s))
    sub.sync()  # newest keyframe is 11 > 4: load it, skip 5..10
    assert [e.version for e in applied][4:] == [11, 12]
    assert_state_equal(sub.state_dict(), weights(11))


def test_empty_store_sync_returns_none(tmp_path):
    assert Subscriber(str(tmp_path)).sync() is None


def test_state_dict_is_a_snapshot(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    pub.publish(weights(0))
    sub = Subscriber(store=store)
    sub.sync()
    snap = sub.state_dict()
    pub.publish(weights(1))
    sub.sync()
    assert_state_equal(snap, weights(0))  # the copy handed out earlier never changes
    assert_state_equal(sub.state_dict(), weights(1))


def test_publish_result_accounts_every_byte(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    pub.publish(weights(0))
    res = pub.publish(weights(1))
    objects = store.list("versions/000000000002/")
    on_disk = sum(store.stat(k).size for k in objects) + store.stat(HEAD_KEY).size
    assert res.bytes_written == on_disk
    m = parse_manifest(store.get(manifest_key(2)).data)
    assert res.changed_elements == m.changed_elements == 300 + 1  # 300 weights and the step counter
    assert res.kind == "delta" and res.base_version == 1
