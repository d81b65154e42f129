"""Warming the codec's compiled loops up before the first version (codec/warm.py), and the daemon
doing it on a thread of its own as it starts."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from xcluster import Publisher, PublisherConfig
from xcluster.codec import warm
from xcluster.codec.kernels import exprank
from xcluster.follow import daemon as daemon_mod
from xcluster.follow.daemon import Daemon, DaemonConfig
from xcluster.store.local import LocalStore

ROOT = Path(__file__).resolve().parents[2]

# In a fresh interpreter (a process that ran codec tests already has its loops loaded): which
# argument types the decoder's loops are loaded for, before and after warm_up().
PROBE = """
import json
from xcluster.codec.kernels import exprank, scatter
from xcluster.codec.warm import warm_up

def loaded():
    k, s = exprank._kernels(), scatter._kernels()
    if k is None or s is None:
        return None
    width = lambda sig: str(sig[0].dtype)
    return {"select": sorted(width(x) for x in k[2].signatures), "rice": len(k[3].signatures),
            "scatter": sorted(width(x) for x in s[0].signatures), "undo": sorted(width(x) for x in s[1].signatures)}

before = loaded()
seen = sorted(warm_up())
print(json.dumps({"before": before, "after": loaded(), "seen": seen}))
"""


def _probe(env_extra: dict[str, str] | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not exprank.compiled(), reason="numba missing or turned off: nothing to warm up")
def test_warm_up_loads_every_decoder_loop_for_every_width_a_fresh_process_would_meet():
    got = _probe()
    assert got["before"]["select"] in ([], ["uint16"])  # at most the width its check at load ran
    assert got["before"]["rice"] == 0  # loaded on first call, per type
    assert len(got["before"]["scatter"]) < 3  # its smoke run loads one width
    widths = ["uint16", "uint32", "uint8"]
    assert sorted(got["after"]["select"]) == sorted(widths)
    assert got["after"]["rice"] >= 1
    assert sorted(got["after"]["scatter"]) == sorted(widths) == sorted(got["after"]["undo"])
    assert set(got["seen"]) >= {"sparse-sub", "sparse-exp2", "full-exp"}


def test_warm_up_does_nothing_without_numba():
    got = _probe({"XCLUSTER_NO_NUMBA": "1"})
    assert got == {"before": None, "after": None, "seen": []}


def _publish(tmp_path) -> LocalStore:
    store = LocalStore(tmp_path / "store", fsync=False)
    w = (torch.randn(64, 64) * 0.02).to(torch.bfloat16)
    Publisher(store=store, config=PublisherConfig()).publish({"w": w})
    return store


def test_the_daemon_warms_up_on_a_thread_of_its_own_and_waits_for_it_before_it_returns(tmp_path, monkeypatch):
    events: list[str] = []

    def fake(done: threading.Event) -> None:  # a warm-up still compiling when the daemon is stopped
        events.append(f"start on {threading.current_thread().name}")
        assert done.wait(30)
        time.sleep(0.2)
        events.append("finished")

    monkeypatch.setattr(daemon_mod, "_warm_up", fake)
    d = Daemon(store=_publish(tmp_path), config=DaemonConfig(out=tmp_path / "out", poll_s=0.05, lease_every_s=0))
    assert _follow_then_stop(d, events) == 0
    assert events == ["start on xc-warm-up", "finished", "run returned 0"]


def _follow_then_stop(d: Daemon, events: list[str]) -> int:
    """Run ``d`` until it holds version 1 (it follows meanwhile), then stop it: run()'s result."""
    result: list[int] = []
    runner = threading.Thread(target=lambda: (result.append(d.run()), events.append(f"run returned {result[0]}")))
    runner.start()
    deadline = time.monotonic() + 30
    while (d.state is None or d.state.version != 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert d.state is not None and d.state.version == 1
    d.stop()
    runner.join(30)
    return result[0]


def test_no_warm_up_when_turned_off_or_for_a_once_run(tmp_path, monkeypatch):
    calls: list[object] = []
    monkeypatch.setattr(daemon_mod, "_warm_up", calls.append)
    off = Daemon(store=_publish(tmp_path), config=DaemonConfig(out=tmp_path / "a", poll_s=0.05, lease_every_s=0,
                                                               warm_up=False))
    assert _follow_then_stop(off, []) == 0
    once = Daemon(store=off.subscriber.store, config=DaemonConfig(out=tmp_path / "b", lease_every_s=0, once=True))
    assert once.run() == 0 and once.state.version == 1
    assert calls == []


def test_warm_up_stops_between_steps_once_told():
    stop = threading.Event()
    stop.set()
    assert warm.warm_up(stop) == set()


def test_a_failing_warm_up_is_logged_and_costs_nothing_else(tmp_path, monkeypatch, caplog):
    def broken(_stop) -> set[str]:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(warm, "warm_up", broken)
    with caplog.at_level(logging.WARNING, logger="xcluster.follow.daemon"):
        daemon_mod._warm_up(threading.Event())
    assert "no compiler here" in caplog.text and "load when first used" in caplog.text
    store = _publish(tmp_path)  # and the daemon still follows
    d = Daemon(store=store, config=DaemonConfig(out=tmp_path / "out", once=True, lease_every_s=0))
    assert d.run() == 0 and d.state.version == 1
