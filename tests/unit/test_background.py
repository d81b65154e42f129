"""Background publishing: snapshot, latest-wins coalescing, errors surfacing later, flush/close."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from xcluster import (BackgroundConfig, BackgroundPublisher, BackgroundPublishError, Publisher, PublisherConfig,
                      PublishResult, PublishTicket, Subscriber)
from xcluster.write.snapshot import take_snapshot
from xcluster.errors import (ConfigError, PublishCancelledError, PublisherClosedError, PublishTimeoutError,
                             StoreError)
from xcluster.read.chain import find_link, read_head, read_manifest
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal, make_weights

WAIT = 30.0  # generous bound on anything that should happen promptly


class GatedStore:
    """A real LocalStore whose puts wait while the gate is closed (a slow store, on cue) and
    fail while ``fail_puts`` is positive."""

    def __init__(self, root) -> None:
        self.inner = LocalStore(root)
        self.url = self.inner.url
        self.gate = threading.Event()
        self.gate.set()
        self.fail_puts = 0
        self.puts_waiting = threading.Semaphore(0)

    def put(self, key, data, **kw):
        if not self.gate.is_set():
            self.puts_waiting.release()
            assert self.gate.wait(WAIT), "test left the gate closed"
        if self.fail_puts > 0:
            self.fail_puts -= 1
            raise StoreError(f"injected failure writing {self.url}/{key}")
        return self.inner.put(key, data, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def hold(self) -> None:
        """Close the gate; returns once a publish is blocked inside put (so it is in flight)."""
        self.gate.clear()
        self.puts_waiting = threading.Semaphore(0)

    def wait_blocked(self) -> None:
        assert self.puts_waiting.acquire(timeout=WAIT), "no publish reached the store"


def weights(step: int) -> dict[str, torch.Tensor]:
    return {**make_weights(step, seed=3, shapes={"w": (64, 256)}),
            "b": torch.arange(16, dtype=torch.int32) * step, "step": torch.tensor(step)}


@pytest.fixture
def store(tmp_path):
    s = GatedStore(tmp_path / "store")
    yield s
    s.gate.set()  # never leave a worker waiting


def background(store, *, on_commit=None, keyframe_every=8, **options) -> BackgroundPublisher:
    return BackgroundPublisher(store=store, on_commit=on_commit, config=PublisherConfig(keyframe_every=keyframe_every),
                               background=BackgroundConfig(**options))


def committed_steps(store) -> list[int]:
    """The trainer step of every committed version, oldest first (each one verified by a subscriber)."""
    head, _ = read_head(store.inner)
    if head is None:
        return []
    assert Subscriber(store=store.inner).sync() == head.version
    return [read_manifest(store.inner, find_link(store.inner, head, v)).manifest.step
            for v in range(1, head.version + 1)]


def reconstructed(store) -> dict[str, torch.Tensor]:
    sub = Subscriber(store=store.inner)
    assert sub.sync() is not None
    return sub.state_dict()


def test_publish_returns_a_ticket_before_the_slow_store_commits(store):
    pub = background(store)
    store.hold()
    t0 = time.perf_counter()
    ticket = pub.publish(weights(0), step=0)
    returned = time.perf_counter() - t0
    store.wait_blocked()  # the worker is inside put(), held by the store
    assert isinstance(ticket, PublishTicket) and not ticket.done()
    assert returned < WAIT
    with pytest.raises(PublishTimeoutError):
        ticket.result(timeout=0.05)
    with pytest.raises(PublishTimeoutError):
        pub.flush(timeout=0.05)
    assert pub.version == 0 and committed_steps(store) == []  # nothing visible yet
    store.gate.set()
    res = ticket.result(timeout=WAIT)
    assert (res.version, res.kind, res.step) == (1, "keyframe", 0) and ticket.done()
    assert pub.last_result == res
    pub.close()
    assert_state_equal(reconstructed(store), weights(0))


def test_newer_publish_replaces_the_waiting_one(store):
    pub = background(store)
    store.hold()
    first = pub.publish(weights(0), step=0)
    store.wait_blocked()
    waiting = [pub.publish(weights(s), step=s) for s in (1, 2, 3)]
    last = pub.publish(weights(4), step=4)
    assert pub.coalesced == 3 and pub.stats().pending
    assert [t.superseded for t in waiting] == [True, True, True] and not last.superseded
    assert waiting[0].superseded_by is waiting[1] and waiting[2].superseded_by is last
    store.gate.set()
    pub.flush(timeout=WAIT)
    assert first.result().version == 1
    assert {t.result().version for t in waiting} == {last.result().version} == {2}  # the version that replaced them
    assert last.result().step == 4
    assert committed_steps(store) == [0, 4]  # delta 2 is against committed version 1, never against step 1..3
    stats = pub.stats()
    assert (stats.submitted, stats.committed, stats.coalesced, stats.failed) == (5, 2, 3, 0)
    pub.close()
    assert_state_equal(reconstructed(store), weights(4))


def test_coalescing_copies_into_the_waiting_buffers(store):
    pub = background(store)
    store.hold()
    pub.publish(weights(0), step=0)
    store.wait_blocked()
    pub.publish(weights(1), step=1)
    ptr = pub._pending.snapshot.tensors["w"].data_ptr()
    pub.publish(weights(2), step=2)
    assert pub._pending.snapshot.tensors["w"].data_ptr() == ptr  # memory: one pending, no new one
    store.gate.set()
    pub.close(timeout=WAIT)
    assert_state_equal(reconstructed(store), weights(2))


def test_snapshot_is_isolated_from_later_in_place_updates(store):
    pub = background(store)
    store.hold()
    live = weights(0)
    want = {k: v.clone() for k, v in live.items()}
    ticket = pub.publish(live, step=0)
    for v in live.values():  # the optimizer steps on while the store is slow
        v.reshape(-1).view(torch.uint8)[::3] ^= 0x55
    store.gate.set()
    ticket.result(timeout=WAIT)
    pub.close()
    assert_state_equal(reconstructed(store), want)


def test_versions_commit_in_order_and_every_one_verifies(store):
    commits = []
    pub = background(store, keyframe_every=3, on_commit=commits.append)
    tickets = []
    for s in range(12):
        tickets.append(pub.publish(weights(s), step=s))
        time.sleep(0.002 * (s % 4))
    pub.close(timeout=WAIT)
    steps = committed_steps(store)  # Subscriber.sync verifies every version's digests on the way
    assert steps == sorted(steps) and len(set(steps)) == len(steps) and steps[0] == 0 and steps[-1] == 11
    assert [r.step for r in commits] == steps and [r.version for r in commits] == list(range(1, len(steps) + 1))
    assert tickets[-1].result().version == len(steps) == pub.last_result.version
    assert pub.stats().committed + pub.coalesced == 12
    assert_state_equal(reconstructed(store), weights(11))


def test_failure_is_raised_by_the_next_call_then_publishing_recovers(store):
    pub = background(store)
    pub.publish(weights(0), step=0).result(timeout=WAIT)
    store.fail_puts = 1
    failed = pub.publish(weights(1), step=1)
    with pytest.raises(BackgroundPublishError) as info:
        failed.result(timeout=WAIT)
    assert isinstance(info.value.__cause__, StoreError)
    with pytest.raises(BackgroundPublishError, match="step 1") as info:
        pub.publish(weights(2), step=2)  # raised instead of submitting
    assert isinstance(info.value.__cause__, StoreError)
    assert committed_steps(store) == [0]  # nothing of the failed version is visible
    ok = pub.publish(weights(3), step=3)  # the error was reported once; this is a fresh attempt
    assert ok.result(timeout=WAIT).version == 2
    pub.close()
    assert committed_steps(store) == [0, 3]
    assert_state_equal(reconstructed(store), weights(3))


@pytest.mark.parametrize("surface", ["flush", "close"])
def test_failure_is_raised_by_flush_and_close(store, surface):
    pub = background(store)
    store.fail_puts = 1
    pub.publish(weights(0), step=0)
    with pytest.raises(BackgroundPublishError) as info:
        getattr(pub, surface)(timeout=WAIT)
    assert isinstance(info.value.__cause__, StoreError)
    if surface == "close":
        assert not pub._thread.is_alive()
    else:
        pub.flush()  # reported once
        assert pub.publish(weights(1), step=1).result(timeout=WAIT).version == 1
        pub.close()


def test_on_commit_error_is_not_swallowed(store):
    def boom(result):
        raise RuntimeError("callback broke")

    pub = background(store, on_commit=boom)
    ticket = pub.publish(weights(0), step=0)
    assert ticket.result(timeout=WAIT).version == 1  # the version did commit
    with pytest.raises(BackgroundPublishError, match="on_commit") as info:
        pub.flush(timeout=WAIT)
    assert isinstance(info.value.__cause__, RuntimeError)
    pub.close()


def test_close_stops_the_thread_and_refuses_more(store):
    with background(store) as pub:
        pub.publish(weights(0), step=0)
        thread = pub._thread
    assert not thread.is_alive()
    assert committed_steps(store) == [0]
    with pytest.raises(PublisherClosedError):
        pub.publish(weights(1), step=1)
    pub.close()  # twice is harmless


def test_close_timeout_drops_the_pending_snapshot(store):
    pub = background(store)
    store.hold()
    inflight = pub.publish(weights(0), step=0)
    store.wait_blocked()
    pending = pub.publish(weights(1), step=1)
    with pytest.raises(PublishTimeoutError):
        pub.close(timeout=0.05)
    with pytest.raises(PublishCancelledError):
        pending.result(timeout=WAIT)
    store.gate.set()  # the version in flight still commits
    assert inflight.result(timeout=WAIT).version == 1
    pub._thread.join(WAIT)
    assert not pub._thread.is_alive()
    assert committed_steps(store) == [0]


def test_exit_hook_is_bounded_and_drops_the_pending_snapshot(store, caplog):
    pub = background(store, close_timeout_s=0.2)
    store.hold()
    inflight = pub.publish(weights(0), step=0)
    store.wait_blocked()
    pending = pub.publish(weights(1), step=1)
    t0 = time.monotonic()
    pub._shutdown_at_exit()
    assert time.monotonic() - t0 < 5
    assert "dropping step 1" in caplog.text and "did not commit within close_timeout_s" in caplog.text
    with pytest.raises(PublishCancelledError):
        pending.result(timeout=0)
    store.gate.set()
    inflight.result(timeout=WAIT)
    assert committed_steps(store) == [0]


def test_requested_keyframe_survives_coalescing(store):
    pub = background(store)
    pub.publish(weights(0), step=0).result(timeout=WAIT)
    store.hold()
    pub.publish(weights(1), step=1)
    store.wait_blocked()
    pub.publish(weights(2), step=2, keyframe=True)
    last = pub.publish(weights(3), step=3)
    store.gate.set()
    assert last.result(timeout=WAIT).kind == "keyframe"
    pub.close()


def test_dtype_converts_floating_point_tensors_only(store):
    pub = background(store)
    fp32 = {"w": torch.randn(32, 32), "n": torch.arange(5)}
    pub.publish(fp32, step=0, dtype=torch.bfloat16)
    pub.close(timeout=WAIT)
    assert_state_equal(reconstructed(store), {"w": fp32["w"].to(torch.bfloat16), "n": fp32["n"]})


def test_bad_input_is_refused_at_the_call_without_touching_the_pending_snapshot(store):
    pub = background(store)
    store.hold()
    pub.publish(weights(0), step=0)
    store.wait_blocked()
    pending = pub.publish(weights(1), step=1)
    with pytest.raises(TypeError):
        pub.publish({"w": weights(2)["w"], "x": [1, 2]}, step=2)
    store.gate.set()
    assert pending.result(timeout=WAIT).step == 1  # still whole, still published
    pub.close()
    assert_state_equal(reconstructed(store), weights(1))


def test_sync_publisher_keeps_returning_results(store):
    seen = []
    pub = Publisher(store=store, on_commit=seen.append)
    res = pub.publish({"w": torch.randn(8, 8)}, step=0, dtype=torch.float16)
    assert isinstance(res, PublishResult)
    assert res.version == 1 and seen == [res] and pub.last_result == res
    pub.flush()  # nothing to wait for
    pub.close()
    assert pub.publish({"w": torch.randn(8, 8)}, step=1, dtype=torch.float16).version == 2  # nothing held back
    assert reconstructed(store)["w"].dtype == torch.float16


def test_wraps_a_given_publisher(store):
    inner = Publisher(store=store, config=PublisherConfig(keyframe_every=4))
    seen = []
    with BackgroundPublisher(publisher=inner, on_commit=seen.append) as pub:
        assert pub.publisher is inner and pub.config is inner.config and pub.store is store
        ticket = pub.publish(weights(0), step=0, files={"config.json": b"{}"})
        assert isinstance(ticket, PublishTicket)
        res = ticket.result(timeout=WAIT)
    assert seen == [res] and inner.last_result == res == pub.last_result and inner.version == pub.version == 1
    assert inner.publish(weights(1), step=1).version == 2  # the wrapped publisher goes on, synchronously
    assert committed_steps(store) == [0, 1]


def test_wrapping_refuses_mixed_arguments(store):
    with pytest.raises(ConfigError, match="not both"):
        BackgroundPublisher(store=store, publisher=Publisher(store=store))
    with pytest.raises(ConfigError, match="on_commit"):
        BackgroundPublisher(publisher=Publisher(store=store, on_commit=print))
    with pytest.raises(ConfigError, match="BackgroundConfig"):
        BackgroundPublisher(store=store, background=True)


def test_step_is_checked_at_the_call(store):
    pub = background(store)
    with pytest.raises(ConfigError, match="step"):
        pub.publish(weights(0), step=-1)
    assert pub.stats().submitted == 0
    pub.close()


def test_config_is_checked():
    with pytest.raises(ConfigError, match="snapshot"):
        BackgroundConfig(snapshot="gpu")
    with pytest.raises(ConfigError, match="close_timeout_s"):
        BackgroundConfig(close_timeout_s=-1)
    with pytest.raises(TypeError):
        PublisherConfig(background=True)  # the flag is gone: the class says it
    with pytest.raises(TypeError):
        BackgroundConfig("pinned")  # keyword-only


@pytest.mark.parametrize("mode", ["device", "pinned"])
def test_snapshot_modes_copy_on_cpu(mode):
    src = {"a": torch.randn(4, 6).t(), "b": torch.tensor(True)}  # a non-contiguous view too
    snap = take_snapshot(src, mode=mode)
    snap.wait()
    for k, v in src.items():
        assert snap.tensors[k].is_contiguous() and snap.tensors[k].data_ptr() != v.data_ptr()
        assert torch.equal(snap.tensors[k], v)
