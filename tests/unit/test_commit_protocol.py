"""Commit protocol, keyframe policy and chain replay."""

from __future__ import annotations

import json

import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber, model_digest
from xcluster.errors import ConcurrentPublisherError, StoreError
from xcluster.format import HEAD_KEY, parse_head, parse_manifest
from xcluster.store import LocalStore
from xcluster.format.packing import unpack
from tests.unit.helpers import assert_state_equal, make_weights, manifest_bytes, mkey, put_manifest


def weights(step: int) -> dict[str, torch.Tensor]:
    return {**make_weights(step, seed=7, shapes={"w": (128, 128)}, changed=300), "step": torch.tensor(step)}


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


@pytest.mark.parametrize("fail_on", [".xc", "manifest-", HEAD_KEY])
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
    # nothing of version 2 is visible; HEAD still names 1
    assert parse_head(store.get(HEAD_KEY).data).version == 1
    left = store.list("versions/000000000002/")
    if fail_on == ".xc":  # failed before its manifest write: its chunks are deleted
        assert left == []
    else:  # the manifest write was attempted: HEAD could still come to name it, so nothing is deleted
        assert left and all(k.rsplit("/", 1)[1].startswith(("c", "manifest-")) for k in left)
    assert sub.sync() == 1
    assert_state_equal(sub.state_dict(), weights(0))
    # the same publisher retries the same version number, still as a delta, and succeeds
    flaky.armed = False
    res = pub.publish(weights(1))
    assert (res.version, res.kind) == (2, "delta")
    assert sub.sync() == 2
    assert_state_equal(sub.state_dict(), weights(1))


def test_a_restarted_publisher_is_not_refused_by_its_predecessors_leftovers(tmp_path):
    """Killed between writing manifest V and moving HEAD, restarted at once: it commits V under a
    manifest of its own (no grace period, no 'another publisher is committing')."""
    store = LocalStore(tmp_path)
    now = [1000.0]
    Publisher(store=store, clock=lambda: now[0]).publish(weights(0))
    # the predecessor's leftovers: chunks and a complete manifest for version 2, HEAD still at 1
    manifest_v2 = dict(json.loads(manifest_bytes(store, 1)), version=2, keyframe_version=2)
    put_manifest(store, "versions/000000000002/manifest-deadbeef.json.zst", json.dumps(manifest_v2).encode())
    store.put("versions/000000000002/cdeadbeef-000000.xc", b"partial")
    sub = Subscriber(store=store)
    assert sub.sync() == 1  # the leftovers are invisible
    res = Publisher(store=store, clock=lambda: now[0]).publish(weights(1))  # at once, same clock
    assert res.version == 2
    assert sub.sync() == 2
    assert_state_equal(sub.state_dict(), weights(1))
    # the leftovers are untouched (retention's business), the committed manifest is another object
    assert unpack(store.get("versions/000000000002/manifest-deadbeef.json.zst").data, where="m") == json.dumps(manifest_v2).encode()
    assert mkey(store, 2) != "versions/000000000002/manifest-deadbeef.json.zst"


def test_a_publish_costs_the_same_store_calls_whatever_the_store_holds(tmp_path):
    """No sweep: a publish touches only its own version's objects (it lists only its own
    directory, to check its chunks are all there before committing), its in-flight marker and HEAD."""
    calls: list[str] = []
    listed: list[str] = []

    class Counting:
        def __init__(self, inner):
            self.inner, self.url = inner, inner.url

        def __getattr__(self, name):
            fn = getattr(self.inner, name)

            def wrapped(*a, **kw):
                calls.append(name)
                if name == "list":
                    listed.append(a[0])
                return fn(*a, **kw)
            return wrapped

    store = LocalStore(tmp_path)
    pub = Publisher(store=Counting(store), config=PublisherConfig(checkpoint_every=None))
    pub.publish(weights(0))
    per_publish = []
    for s in range(1, 40):
        calls.clear()
        listed.clear()
        res = pub.publish(weights(s))
        per_publish.append(sorted(calls))
        assert listed == [f"versions/{res.version:012d}/"]
    assert all(cs == per_publish[0] for cs in per_publish)  # constant, not growing with history


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
    m = parse_manifest(manifest_bytes(store, 2))
    assert res.changed_elements == m.changed_elements == 300 + 1  # 300 weights and the step counter
    assert res.kind == "delta" and res.base_version == 1


def test_keyframe_every_above_max_chain_is_refused_with_the_rule():
    from xcluster.errors import ConfigError
    from xcluster.format import MAX_CHAIN

    PublisherConfig(keyframe_every=MAX_CHAIN)
    with pytest.raises(ConfigError, match="lock out every new node"):
        PublisherConfig(keyframe_every=MAX_CHAIN + 1)


def test_a_checkpoint_when_the_deltas_outweigh_a_fraction_of_the_last_one_and_versions_stay_deltas(tmp_path):
    from xcluster.read.checkpoint import list_checkpoints

    def step(s: int) -> dict[str, torch.Tensor]:  # a growing delta every step
        return make_weights(s, shapes={"w": (256, 256)}, base="zeros", changed=2000, pick="prefix")

    store = LocalStore(tmp_path / "on")
    pub = Publisher(store=store, config=PublisherConfig(checkpoint_every=1000, checkpoint_chain_fraction=0.05))
    results = [pub.publish(step(s)) for s in range(12)]
    assert [r.kind for r in results] == ["keyframe"] + ["delta"] * 11  # a follower never gets a full version
    assert any(r.checkpoint_bytes for r in results)
    # every checkpoint comes once the deltas since the last one (or the keyframe) exceed 5% of it
    since, full_bytes = 0, results[0].bytes_written
    for r in results[1:]:
        since += r.bytes_written
        if r.checkpoint_bytes:
            assert since > 0.05 * full_bytes
            since, full_bytes = 0, r.checkpoint_bytes
        else:
            assert since <= 0.05 * full_bytes
    assert sorted(c.version for c in list_checkpoints(store)) == [r.version for r in results if r.checkpoint_bytes]
    off = LocalStore(tmp_path / "off")
    pub = Publisher(store=off, config=PublisherConfig(checkpoint_every=1000, checkpoint_chain_fraction=None))
    assert [pub.publish(step(s)).checkpoint_bytes for s in range(12)] == [0] * 12
    assert list_checkpoints(off) == []
    every = LocalStore(tmp_path / "every")
    pub = Publisher(store=every, config=PublisherConfig(checkpoint_every=4, checkpoint_chain_fraction=None))
    assert [pub.publish(step(s)).kind for s in range(10)] == ["keyframe"] + ["delta"] * 9
    assert [c.version for c in list_checkpoints(every)] == [9, 5]


def test_files_travel_with_every_version_and_are_uploaded_only_when_they_change(tmp_path):
    from xcluster.read.chain import Link, read_head, read_manifest
    from xcluster.format import file_key, xxh3_128

    store = LocalStore(tmp_path / "s")
    puts: list[str] = []

    class Recording:
        def __init__(self, inner):
            self.inner, self.url = inner, inner.url

        def put(self, key, data, **kw):
            puts.append(key)
            return self.inner.put(key, data, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    (model_dir / "tokenizer.json").write_text('{"version": "1.0"}')
    (model_dir / "model-00001-of-00001.safetensors").write_bytes(b"weights are shipped as tensors")
    (model_dir / "model.safetensors.index.json").write_text("{}")
    pub = Publisher(store=Recording(store), files=model_dir)
    pub.publish(weights(0))
    pub.publish(weights(1))
    files_put = [k for k in puts if k.startswith("files/")]
    assert len(files_put) == 2  # config + tokenizer, once, not again for version 2
    head, _ = read_head(store)
    m = read_manifest(store, Link.of_head(head)).manifest
    assert [f.name for f in m.files] == ["config.json", "tokenizer.json"]  # no weights, no index
    for f in m.files:
        data = store.get(file_key(f.xxh3_128)).data
        assert xxh3_128(data) == f.xxh3_128 and len(data) == f.size
    # a changed tokenizer is uploaded (only it), and listed from then on
    puts.clear()
    pub.publish(weights(2), files={"config.json": b'{"model_type": "llama"}', "tokenizer.json": b'{"v": 2}'})
    assert [k for k in puts if k.startswith("files/")] == [file_key(xxh3_128(b'{"v": 2}'))]
    # a new publisher on the same store finds the files there (stat) and uploads nothing
    puts.clear()
    again = Publisher(store=Recording(store), files={"config.json": b'{"model_type": "llama"}'})
    again.publish(weights(3))
    assert not [k for k in puts if k.startswith("files/")]


def test_an_interrupt_inside_the_head_write_deletes_nothing(tmp_path):
    """SIGTERM → sys.exit (SystemExit) raised inside the HEAD request after it landed: the
    version is committed and nothing it needs may be deleted."""
    store = LocalStore(tmp_path)

    class ExitAfterHead:
        def __init__(self, inner):
            self.inner, self.url, self.armed = inner, inner.url, False

        def put(self, key, data, **kw):
            etag = self.inner.put(key, data, **kw)
            if self.armed and key == HEAD_KEY:
                raise SystemExit(0)
            return etag

        def __getattr__(self, name):
            return getattr(self.inner, name)

    wrapped = ExitAfterHead(store)
    pub = Publisher(store=wrapped, config=PublisherConfig(keyframe_every=100))
    pub.publish(weights(0))
    wrapped.armed = True
    with pytest.raises(SystemExit):
        pub.publish(weights(1))
    wrapped.armed = False
    sub = Subscriber(store=store)
    assert sub.sync() == 2  # HEAD names version 2 and everything it needs is there
    assert_state_equal(sub.state_dict(), weights(1))
    # the interrupted publisher carries on: it re-reads HEAD and starts a new chain
    res = pub.publish(weights(2))
    assert (res.version, res.kind) == (3, "keyframe")
    assert sub.sync() == 3


class LandedThenPreconditionStore(FailingStore):
    """The first manifest put lands, then answers "precondition failed", as a retried create-once
    request does when its first try landed but the response was lost; or, with ``other``, another
    object already sits under the name (an attempt id collision)."""

    def __init__(self, inner, other: bytes | None = None):
        super().__init__(inner, "/manifest-")
        self.other, self.done = other, False

    def put(self, key, data, **kw):
        if "/manifest-" in key and not self.done:
            from xcluster.errors import PreconditionFailedError

            self.done = True
            self.inner.put(key, data if self.other is None else self.other)
            raise PreconditionFailedError(f"{key} exists")
        return self.inner.put(key, data, **kw)


def test_a_manifest_write_that_landed_before_its_retry_counts_as_written(tmp_path):
    cfg = PublisherConfig()
    store = LandedThenPreconditionStore(LocalStore(tmp_path / "a"))
    res = Publisher(store=store, config=cfg).publish(weights(0))
    assert res.version == 1 and Subscriber(store=store.inner).sync() == 1
    other = LandedThenPreconditionStore(LocalStore(tmp_path / "b"), other=b"another attempt's manifest")
    with pytest.raises(ConcurrentPublisherError, match="exists with other content"):
        Publisher(store=other, config=cfg).publish(weights(0))


class IgnoresPreconditions:
    """A store whose conditional writes of HEAD always succeed, as a backend that does not enforce
    If-Match would let them (docs/S3.md: SeaweedFS promises it only without concurrency)."""

    def __init__(self, inner):
        self.inner = inner

    def put(self, key, data, **kw):
        if key == HEAD_KEY:
            kw.pop("if_match", None)
            kw.pop("if_none_match", None)
        return self.inner.put(key, data, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_second_publisher_is_refused_where_the_store_does_not_enforce_conditional_writes(tmp_path):
    """Review 2, the HEAD race: on a store that lets a stale conditional write through, a second
    publisher overwrote the version another had committed, and both reported success. HEAD is
    read before the swap: the second is refused, the first's version stays committed."""
    store = IgnoresPreconditions(LocalStore(tmp_path))
    a = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    a.publish(weights(0))
    b = Publisher(store=store, config=PublisherConfig(keyframe_every=100))  # sees version 1
    won = a.publish(weights(1))
    with pytest.raises(ConcurrentPublisherError, match="moved under this publisher"):
        b.publish(weights(5))
    assert parse_head(store.get(HEAD_KEY).data).version == won.version == 2
    sub = Subscriber(store=store.inner)
    assert sub.sync() == 2
    assert_state_equal(sub.state_dict(), weights(1))
