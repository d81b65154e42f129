"""What the daemon costs the store: one conditional GET of HEAD per poll (docs/DAEMON.md §1), and
one GET of each new version's manifest, also when both slots apply it.

Found by bench/load.py: each loop polled HEAD twice (once in the daemon, once more inside
``Subscriber.sync``), doubling the idle cost of a fleet. Found later by profiling a sync: the
manifest of the next version was read (and hashed and parsed) twice, once to plan the chain and
once to apply it — a second round trip per version over a WAN."""

from __future__ import annotations

from collections import Counter

import torch

from xcluster import Publisher, PublisherConfig
from xcluster.follow.daemon import Daemon, DaemonConfig
from xcluster.format import HEAD_KEY
from xcluster.store.local import LocalStore
from tests.unit.helpers import make_weights


class CountingStore(LocalStore):
    def __init__(self, root) -> None:
        super().__init__(root, fsync=False)
        self.gets: Counter[str] = Counter()
        self.manifest_reads: Counter[str] = Counter()

    def get(self, key, *, if_none_match=None):
        self.gets[key] += 1
        return super().get(key, if_none_match=if_none_match)

    def get_range(self, key, start, length):
        if "/manifest" in key:
            self.manifest_reads[key.split("/")[1]] += 1
        return super().get_range(key, start, length)


def weights(step: int) -> dict[str, torch.Tensor]:
    return make_weights(step, base="arange", changed=40, pick="prefix")


def _follower(tmp_path, keyframe_every: int) -> tuple[CountingStore, Publisher, Daemon]:
    """A store with version 1 published and a resumed daemon that has not stepped yet."""
    store = CountingStore(tmp_path / "store")
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=keyframe_every))
    pub.publish(weights(0))
    d = Daemon(store=store, config=DaemonConfig(out=tmp_path / "out", lease_every_s=0))
    d.resume()
    return store, pub, d


def test_each_daemon_loop_reads_head_once_idle_or_not(tmp_path):
    store, pub, d = _follower(tmp_path, 4)
    store.gets.clear()
    assert d.step() and d.state.version == 1  # a new version: still one read of HEAD
    assert store.gets[HEAD_KEY] == 1
    for _ in range(5):  # idle: nothing but one conditional GET per loop
        d.step()
    assert store.gets[HEAD_KEY] == 6 and d.state.version == 1
    pub.publish(weights(1))
    pub.publish(weights(2))
    store.gets.clear()  # the publisher's own reads of HEAD (before and after each swap)
    assert d.step() and d.state.version == 3
    assert store.gets[HEAD_KEY] == 1


def test_each_manifest_is_read_once_by_both_slots_also_along_a_longer_plan(tmp_path):
    store, pub, d = _follower(tmp_path, 8)
    assert d.step() and d.state.version == 1
    assert dict(store.manifest_reads) == {"000000000001": 1}
    pub.publish(weights(1))
    store.manifest_reads.clear()
    assert d.step() and d.state.version == 2
    assert dict(store.manifest_reads) == {"000000000002": 1}
    results = {s + 1: pub.publish(weights(s)) for s in (2, 3, 4)}
    plan = [5]  # what the walk reads, newest first: back to a keyframe or to the held version's child
    while results[plan[-1]].kind != "keyframe" and results[plan[-1]].base_version != 2:
        plan.append(results[plan[-1]].base_version)
    assert len(plan) >= 2  # the byte-based keyframe policy keeps at least 5 a delta
    store.manifest_reads.clear()
    assert d.step() and d.state.version == 5
    # the walk reads each once; applying them, and the standby slot's replay of the same
    # versions, use the bytes read (read_manifest's memo, hash-checked by the link)
    assert dict(store.manifest_reads) == {f"{v:012d}": 1 for v in plan}
    assert d.state.standby_version == 2  # the standby is brought level when the next version comes
    pub.publish(weights(5))
    store.manifest_reads.clear()
    assert d.step() and d.state.version == 6 and d.state.standby_version == 5  # it replayed 3..5
    assert dict(store.manifest_reads) == {"000000000006": 1}
