"""What the daemon costs the store: one conditional GET of HEAD per poll (docs/DAEMON.md §1).

Found by bench/load.py: each loop polled HEAD twice (once in the daemon, once more inside
``Subscriber.sync``), doubling the idle cost of a fleet."""

from __future__ import annotations

from collections import Counter

import torch

from xcluster import Publisher, PublisherConfig
from xcluster.follow.daemon import Daemon, DaemonConfig
from xcluster.format import HEAD_KEY
from xcluster.store.local import LocalStore


class CountingStore(LocalStore):
    def __init__(self, root) -> None:
        super().__init__(root, fsync=False)
        self.gets: Counter[str] = Counter()

    def get(self, key, *, if_none_match=None):
        self.gets[key] += 1
        return super().get(key, if_none_match=if_none_match)


def weights(step: int) -> dict[str, torch.Tensor]:
    w = torch.arange(4096, dtype=torch.float32).reshape(64, 64).to(torch.bfloat16)
    w.view(torch.int16).view(-1)[: 40 * step] += 1
    return {"w": w}


def test_each_daemon_loop_reads_head_once_idle_or_not(tmp_path):
    store = CountingStore(tmp_path / "store")
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=4))
    pub.publish(weights(0))
    d = Daemon(store=store, config=DaemonConfig(out=tmp_path / "out", lease_every_s=0))
    d.resume()
    store.gets.clear()
    assert d.step() and d.state.version == 1  # a new version: still one read of HEAD
    assert store.gets[HEAD_KEY] == 1
    for _ in range(5):  # idle: nothing but one conditional GET per loop
        d.step()
    assert store.gets[HEAD_KEY] == 6 and d.state.version == 1
    pub.publish(weights(1))
    pub.publish(weights(2))
    assert d.step() and d.state.version == 3
    assert store.gets[HEAD_KEY] == 7
