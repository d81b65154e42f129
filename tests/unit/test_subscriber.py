"""Subscriber behaviour: polling cost, rollback, atomic snapshots, interrupts, restore, chunk cache."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber, SubscriberConfig, model_digest
from xcluster.errors import DigestMismatchError, RollbackError
from xcluster.format import HEAD_KEY
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal
from tests.unit.test_commit_protocol import weights


class CountingStore:
    """Records every call that reaches the store (a real LocalStore underneath)."""

    def __init__(self, inner):
        self.inner, self.url, self.calls = inner, inner.url, []

    def get(self, key, *, if_none_match=None):
        self.calls.append(("get", key, if_none_match is not None))
        return self.inner.get(key, if_none_match=if_none_match)

    def get_range(self, key, start, length):
        self.calls.append(("get_range", key))
        return self.inner.get_range(key, start, length)

    def list(self, prefix=""):
        self.calls.append(("list", prefix))
        return self.inner.list(prefix)

    def stat(self, key):
        self.calls.append(("stat", key))
        return self.inner.stat(key)

    def put(self, *a, **kw):
        return self.inner.put(*a, **kw)

    def delete(self, key):
        return self.inner.delete(key)


def test_sync_until_and_never_back(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    for s in range(5):
        pub.publish(weights(s))
    sub = Subscriber(store=store)
    assert sub.sync(until=3) == 3
    assert_state_equal(sub.state_dict(), weights(2))
    assert sub.sync() == 5
    with pytest.raises(RollbackError, match="keeps serving version 5"):
        sub.sync(until=2)
    assert sub.version == 5
    assert_state_equal(sub.state_dict(), weights(4))


def test_head_rolled_back_raises_rollback_error_and_keeps_weights(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    pub.publish(weights(0))
    pub.publish(weights(1))
    old_head = store.get(HEAD_KEY).data
    pub.publish(weights(2))
    sub = Subscriber(store=store)
    assert sub.sync() == 3
    store.put(HEAD_KEY, old_head)  # whoever can write the bucket moves HEAD back
    for _ in range(2):  # every sync says so, none changes anything
        with pytest.raises(RollbackError, match="holds version 3"):
            sub.sync()
    assert sub.version == 3
    assert_state_equal(sub.state_dict(), weights(2))


def test_a_poll_with_nothing_new_costs_one_conditional_get(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    counting = CountingStore(store)
    sub = Subscriber(store=counting)
    pub.publish(weights(0))
    sub.sync()
    pub.publish(weights(1))
    assert sub.sync() == 2
    for _ in range(3):
        counting.calls.clear()
        assert sub.sync() == 2
        assert counting.calls == [("get", HEAD_KEY, True)]


def test_snapshot_pairs_weights_with_their_version_while_sync_runs(tmp_path):
    """A reader in another thread never sees weights of one version labelled with another."""
    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    states = [{"w": torch.full((256, 256), float(i), dtype=torch.bfloat16),
               "v": torch.tensor([i], dtype=torch.int64)} for i in range(8)]
    sub = Subscriber(store=store)
    pub.publish(states[0])
    sub.sync()
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            snap = sub.snapshot()
            if int(snap.state["v"][0]) != snap.version - 1 or float(snap.state["w"][0, 0]) != snap.version - 1:
                bad.append(f"version {snap.version} with weights of {int(snap.state['v'][0]) + 1}")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for s in states[1:]:
            pub.publish(s)
            sub.sync()
    finally:
        stop.set()
        t.join()
    assert not bad
    assert sub.version == 8


def test_interrupt_during_apply_leaves_the_old_weights(tmp_path, monkeypatch):
    """KeyboardInterrupt in the syncing thread while decode workers still patch: the undo waits
    for every worker, so the weights are exactly the old version's."""
    import xcluster.read.apply as subm  # where the subscriber's patches are applied

    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(
        keyframe_every=100, codec=__import__("xcluster").CodecConfig(block_bytes=4096, chunk_bytes=1 << 20)))
    g = torch.Generator().manual_seed(0)
    w0 = {f"t{i}": torch.randn(64, 64, generator=g).to(torch.bfloat16) for i in range(8)}
    w1 = {k: (v.float() + 0.5).to(torch.bfloat16) for k, v in w0.items()}
    pub.publish(w0)
    sub = Subscriber(store=store, config=SubscriberConfig(decode_workers=2))
    sub.sync()
    pub.publish(w1)
    real_patch = subm.patch
    main = threading.main_thread()
    started = threading.Event()

    def slow_patch(tgt, op, *, undo=False):
        if not undo:
            started.set()
            time.sleep(0.05)  # workers are still patching when the interrupt arrives
        return real_patch(tgt, op, undo=undo)

    monkeypatch.setattr(subm, "patch", slow_patch)

    def interrupt() -> None:
        started.wait(5)
        import signal
        signal.pthread_kill(main.ident, signal.SIGINT)  # a real signal: wakes the blocked wait

    assert threading.current_thread() is main
    threading.Thread(target=interrupt).start()
    with pytest.raises(KeyboardInterrupt):
        sub.sync()
    # the interrupt lands while workers patch (it is sent as the first patch starts); whatever
    # moment it hits, weights and version agree: never v1's label on half-patched weights
    snap = sub.snapshot()
    assert (snap.version, snap.model_digest) in ((1, model_digest(w0)), (2, model_digest(w1)))
    assert_state_equal(snap.state, w0 if snap.version == 1 else w1)
    monkeypatch.setattr(subm, "patch", real_patch)
    assert sub.sync() == 2
    assert_state_equal(sub.state_dict(), w1)


def test_restore_resumes_after_the_restored_version(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    pub.publish(weights(0))
    pub.publish(weights(1))
    first = Subscriber(store=store)
    first.sync()
    snap = first.snapshot()
    from xcluster.read.chain import Link, read_manifest, read_head
    head, _ = read_head(store)
    mdata = read_manifest(store, Link.of_head(head)).data
    pub.publish(weights(2))
    counting = CountingStore(store)
    again = Subscriber(store=counting)
    assert again.restore(snap.state, mdata) == 2
    assert again.sync() == 3
    assert_state_equal(again.state_dict(), weights(2))
    assert not any(c[0] == "get_range" and "000000000001" in c[1] for c in counting.calls)  # no keyframe refetch
    # weights that do not match their manifest are refused and nothing changes
    bad = dict(snap.state)
    bad["w"] = bad["w"].clone()
    bad["w"].view(torch.int16).view(-1)[0] ^= 1
    fresh = Subscriber(store=store)
    with pytest.raises(DigestMismatchError):
        fresh.restore(bad, mdata)
    assert fresh.version is None


def test_chunk_cache_survives_a_failed_apply_and_is_pruned(tmp_path):
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    pub.publish(weights(0))
    cache = tmp_path / "cache"
    counting = CountingStore(store)
    sub = Subscriber(store=counting, config=SubscriberConfig(chunk_cache_dir=str(cache)))
    # the first attempt dies after fetching (a crash stand-in: apply raises)
    orig = sub._patch_and_verify
    sub._patch_and_verify = lambda *a: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        sub.sync()
    assert any(cache.rglob("*.xc"))
    sub2 = Subscriber(store=counting, config=SubscriberConfig(chunk_cache_dir=str(cache)))
    counting.calls.clear()
    assert sub2.sync() == 1
    assert sub2.stats.chunk_cache_hits >= 1
    assert not any(c[0] == "get_range" and c[1].endswith(".xc") for c in counting.calls)
    assert not any(cache.rglob("*.xc"))  # applied: pruned
    del orig


def test_a_keyframe_is_applied_chunk_by_chunk_with_bounded_chunks_in_memory(tmp_path):
    """Issue 10 §3: fetch, verify, decode, release — at most about ``fetch_workers`` chunks of a
    keyframe are alive at once, never every chunk of the version."""
    import threading

    from xcluster import CodecConfig
    from xcluster.store import LocalStore

    live, peak, lock = [0], [0], threading.Lock()

    class Tracked(bytes):
        def __del__(self):
            with lock:
                live[0] -= 1

    class Counting(LocalStore):
        def get_range(self, key, start, length):
            data = super().get_range(key, start, length)
            if not key.endswith(".xc"):
                return data
            with lock:
                live[0] += 1
                peak[0] = max(peak[0], live[0])
            return Tracked(data)

    store = Counting(tmp_path / "s")
    sd = {f"t{i}": torch.randn(64, 64).to(torch.bfloat16) for i in range(24)}
    Publisher(store=store, config=PublisherConfig(codec=CodecConfig(block_bytes=4096, chunk_bytes=4096))).publish(sd)
    chunks = sum(1 for k in store.list("versions/") if k.endswith(".xc"))
    assert chunks >= 16
    sub = Subscriber(store=store, config=SubscriberConfig(fetch_workers=2, decode_workers=1))
    assert sub.sync() == 1
    assert_state_equal(sub.state_dict(), sd)
    assert 1 <= peak[0] <= 4, f"{peak[0]} of {chunks} chunks were held at once"


def test_tensors_are_hashed_as_their_last_block_lands_and_one_split_over_many_blocks_only_then(tmp_path,
                                                                                             monkeypatch):
    """A tensor is hashed by the worker that patches its last block, while the others still decode
    (so the hashing overlaps decoding); one spread over sixteen blocks is hashed once all sixteen
    are applied, whichever worker applies which."""
    import xcluster.read.apply as sub_mod  # where blocks are decoded and tensors hashed
    from xcluster.codec.encode import CodecConfig

    g = torch.Generator().manual_seed(0)
    state = {"big": (torch.randn(64, 1024, generator=g) * 0.02).to(torch.bfloat16),  # 16 ranges of 4096
             "small": (torch.randn(512, generator=g) * 0.02).to(torch.bfloat16)}
    store = LocalStore(tmp_path / "s", fsync=False)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100, codec=CodecConfig(block_bytes=8192)))
    sub = Subscriber(store=store, config=SubscriberConfig(decode_workers=2))
    pub.publish(state)
    sub.sync()
    decoded: list[int] = []  # the tensors (0: big, 1: small) of each block decoded so far
    hashed: list[tuple[int, int]] = []  # (elements hashed, blocks of "big" decoded by then)
    real_decode, real_digest = sub_mod.decode_block, sub_mod.entry_digest

    def decode(*a, **kw):
        ops = real_decode(*a, **kw)
        decoded.extend(sorted({s.tensor for s in a[0].segments}))
        return ops

    def digest(t, parts):
        hashed.append((t.numel(), decoded.count(0)))
        return real_digest(t, parts)

    monkeypatch.setattr(sub_mod, "decode_block", decode)
    monkeypatch.setattr(sub_mod, "entry_digest", digest)
    for step in range(1, 4):  # dense changes: every range of "big" is a block of its own
        bits = state["big"].view(torch.int16).view(-1)
        bits[step % 2::2] += 1
        state["small"].view(torch.int16)[:: 3] -= 1
        res = pub.publish(state)
        decoded.clear()
        hashed.clear()
        assert sub.sync() == res.version
        assert_state_equal(sub.state_dict(), state)
        assert decoded.count(0) == 16
        assert sorted(n for n, _ in hashed) == [512, 64 * 1024]  # each once
        assert dict(hashed)[64 * 1024] == 16  # "big": only after all of its blocks


class GarblingStore(CountingStore):
    """Hands back the bytes of ``key`` garbled (``flip``: one bit; ``cut``: the last byte dropped)
    for its next ``times`` reads, as corruption in transit would; the object stays intact."""

    def __init__(self, inner, key, how, times):
        super().__init__(inner)
        self.key, self.how, self.times = key, how, times

    def get_range(self, key, start, length):
        data = super().get_range(key, start, length)
        if key != self.key or self.times <= 0:
            return data
        self.times -= 1
        if self.how == "cut":
            return data[:-1]
        garbled = bytearray(data)
        garbled[len(garbled) // 2] ^= 0x40
        return bytes(garbled)


def _chunk_key(store, version):
    (key, *_) = sorted(k for k in store.list(f"versions/{version:012d}/") if k.endswith(".xc"))
    return key


@pytest.mark.parametrize("how, times, raised, counts", [
    # (refetches, checksum_failures): a chunk is re-fetched only when another attempt follows
    ("flip", 1, None, (1, 1)),
    ("flip", 3, "ChecksumMismatchError", (2, 3)),
    ("cut", 3, "TruncatedObjectError", (2, 0)),
], ids=["garbled once", "garbled every time", "short every time"])
def test_a_chunk_garbled_in_transit_is_fetched_again_then_refused(tmp_path, how, times, raised, counts):
    from xcluster import errors

    store = LocalStore(tmp_path)
    Publisher(store=store, config=PublisherConfig(keyframe_every=100)).publish(weights(0))
    key = _chunk_key(store, 1)
    size = store.stat(key).size
    garbling = GarblingStore(store, key, how, times)
    sub = Subscriber(store=garbling, config=SubscriberConfig(integrity_retries=2))
    if raised is None:
        assert sub.sync() == 1
        assert_state_equal(sub.state_dict(), weights(0))
    else:
        with pytest.raises(getattr(errors, raised), match=key):
            sub.sync()
        assert sub.version is None
    assert (sub.stats.refetches, sub.stats.checksum_failures) == counts
    reads = [c for c in garbling.calls if c == ("get_range", key)]
    assert len(reads) == min(times + 1, 3)  # integrity_retries=2: three attempts at most, no more
    if raised is None:  # every byte read counts, the garbled copy's too
        chunks = sum(store.stat(k).size for k in store.list("versions/000000000001/") if k.endswith(".xc"))
        assert sub.stats.bytes_fetched == chunks + size


@pytest.mark.parametrize("times, raised", [(1, False), (3, True)], ids=["garbled once", "garbled every time"])
def test_a_manifest_garbled_in_transit_is_read_again_then_refused(tmp_path, times, raised):
    from xcluster.errors import ChecksumMismatchError
    from tests.unit.helpers import mkey

    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    pub.publish(weights(0))
    sub = Subscriber(store=store, config=SubscriberConfig(integrity_retries=2))
    sub.sync()
    pub.publish(weights(1))
    key = mkey(store, 2)
    sub.store = garbling = GarblingStore(store, key, "flip", times)
    if raised:
        with pytest.raises(ChecksumMismatchError, match="the manifest is corrupt or was replaced"):
            sub.sync()
        assert sub.version == 1
    else:
        assert sub.sync() == 2
    # a manifest's mismatch counts on every failed read, the last included
    assert (sub.stats.refetches, sub.stats.checksum_failures) == (min(times, 3),) * 2
    assert len([c for c in garbling.calls if c == ("get_range", key)]) == min(times + 1, 3)
