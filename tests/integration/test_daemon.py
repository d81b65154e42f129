"""The subscriber daemon as deployed: ``xcluster subscribe`` in its own process.

kill -9 at random moments (local store and SeaweedFS over HTTP), restarts that converge to the
trainer's digest without ever exposing a partial directory at ``current``, SIGTERM, hand-off
failure and recovery against a real HTTP engine stand-in, leases, metrics.
"""

from __future__ import annotations

import http.server
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from xcluster import Publisher, PublisherConfig, model_digest
from xcluster.follow.slots import Slots
from xcluster.format import lease_key, parse_lease
from xcluster.store import open_store
from tests.support.slots import read_current

pytestmark = pytest.mark.integration


def weights(step: int, *, big: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    n = 1024 if big else 128
    sd = {f"layers.{i}.w": torch.randn(n, 256, generator=g).to(torch.bfloat16) for i in range(4)}
    for s in range(1, step + 1):
        gs = torch.Generator().manual_seed(1000 + s)
        for t in sd.values():
            bits = t.view(torch.int16).view(-1)
            idx = torch.randint(0, bits.numel(), (bits.numel() // 50,), generator=gs)
            bits[idx] += 1
    sd["step"] = torch.tensor([step], dtype=torch.int64)
    return sd


def daemon_cmd(url: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "xcluster.cli", "subscribe", url, "--out", str(out), "--poll", "0.05",
            "--lease-interval", "0.2", "--node-id", "node-a", *extra]


def check_current(out: Path, digests: dict[int, str]) -> int | None:
    """``current`` is absent or names a complete directory holding exactly a published version."""
    got = read_current(out)
    if got is None:
        assert not (out / "current").exists()
        return None
    cur, state, _ = got
    assert model_digest(state) == digests[cur], f"current -> version {cur} does not hold that version"
    return cur


def kill_loop(url: str, out: Path, env: dict, trials: int, digests: dict[int, str], rng: random.Random,
              publishing: threading.Event) -> list[int | None]:
    seen = []
    for i in range(trials):
        proc = subprocess.Popen(daemon_cmd(url, out), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        if i == 0:  # let the first run lay down a version, however slow the machine is
            end = time.monotonic() + 90
            while not (out / "state.json").exists() and time.monotonic() < end and proc.poll() is None:
                time.sleep(0.05)
        time.sleep(rng.uniform(0.3, 3.0))  # anywhere: start-up, resume, fetch, apply, dir write, lease
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        seen.append(check_current(out, digests))
    return seen


def run_kill_trials(url: str, tmp_path: Path, env: dict, trials: int) -> None:
    rng = random.Random(1234)
    store = open_store(url)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=4))
    digests: dict[int, str] = {}
    publishing = threading.Event()
    publishing.set()
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            for s in range(14):
                res = pub.publish(weights(s, big=True), step=s)
                digests[res.version] = res.model_digest
                time.sleep(0.3)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            publishing.clear()

    # digests must be known before the daemon can expose a version: publish the first one here
    res = pub.publish(weights(0, big=True), step=0)
    digests[res.version] = res.model_digest
    t = threading.Thread(target=trainer)
    t.start()
    out = tmp_path / "out"
    try:
        seen = kill_loop(url, out, env, trials, digests, rng, publishing)
    finally:
        t.join()
    assert not errors
    # after the last kill, one more run converges to HEAD
    final = subprocess.run(daemon_cmd(url, out, "--once"), env=env, capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stderr[-3000:]
    head = max(digests)
    assert check_current(out, digests) == head
    st = json.loads((out / "state.json").read_text())
    assert st["version"] == head and st["model_digest"] == digests[head]
    assert any(v is not None for v in seen), "no kill ever found a version in place: the trials prove nothing"
    assert not list((out / "slots").glob(".tmp*")), "a temp directory survived a restart"


def subprocess_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    env.update(extra)
    return env


@pytest.mark.slow
def test_kill9_daemon_local_store_converges(tmp_path):
    run_kill_trials(str(tmp_path / "store"), tmp_path, subprocess_env(), trials=14)


@pytest.mark.slow
def test_kill9_daemon_seaweedfs_converges(tmp_path, seaweedfs):
    url = f"s3://{seaweedfs.bucket}/daemon-{uuid.uuid4().hex[:8]}"
    env = subprocess_env(AWS_PROFILE=seaweedfs.profile, AWS_ENDPOINT_URL=seaweedfs.endpoint,
                         AWS_DEFAULT_REGION="us-east-1")
    old = {k: os.environ.get(k) for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")}
    os.environ.update({k: env[k] for k in old})
    try:
        run_kill_trials(url, tmp_path, env, trials=8)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Engine(http.server.ThreadingHTTPServer):
    """A real HTTP engine stand-in for ``--engine http``: answers 503 while ``down`` is set and
    records each hand-off body it accepted."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.accepted: list[dict] = []
        self.refused = 0
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.down.is_set():
                    outer.refused += 1
                    self.send_response(503)
                    self.end_headers()
                    return
                # the engine loads what it is given: the directory must be complete
                path = Path(body["path"])
                Slots(path.parent.parent).map(path.name)
                outer.accepted.append(body)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/reload"


def wait_for(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def read_lease(store):
    try:
        return parse_lease(store.get(lease_key("node-a")).data)
    except Exception:
        return None


@pytest.mark.slow
def test_handoff_failure_recovery_sigterm_lease_and_metrics(tmp_path):
    url = str(tmp_path / "store")
    store = open_store(url)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=3))
    digests = {}
    for s in range(2):
        r = pub.publish(weights(s), step=s)
        digests[r.version] = r.model_digest
    engine = Engine()
    import socket
    with socket.socket() as s_:
        s_.bind(("127.0.0.1", 0))
        port = s_.getsockname()[1]
    out = tmp_path / "out"
    proc = subprocess.Popen(daemon_cmd(url, out, "--engine", "http", "--engine-url", engine.url, "--engine-body",
                                       '{"path": {path}, "version": {version}}', "--metrics-port", str(port),
                                       "--backoff-max", "0.5", "--log-format", "json"),
                            env=subprocess_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: engine.accepted and int(engine.accepted[-1]["version"]) == 2, 60, "hand-off of v2")
        assert Path(engine.accepted[-1]["path"]) == (out / "current").resolve()
        # the engine goes down; the daemon keeps following the store and reports the failure
        engine.down.set()
        r = pub.publish(weights(2), step=2)
        digests[r.version] = r.model_digest
        lease = wait_for(lambda: (l := read_lease(store)) and l.engine_state == "failing" and l, 30, "failing lease")
        assert lease.version == 3 and lease.engine_version == 2 and "503" in (lease.last_error or "")
        r = pub.publish(weights(3), step=3)  # still following while the engine is down
        digests[r.version] = r.model_digest
        wait_for(lambda: (l := read_lease(store)) and l.version == 4, 30, "version 4 applied while engine down")
        assert check_current(out, digests) == 4
        import urllib.request
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        failures = [ln for ln in text.splitlines() if ln.startswith("xcluster_handoff_failures_total")]
        assert failures and float(failures[0].split()[-1]) >= 1
        # the engine comes back: it gets the newest version, not the ones it missed
        engine.down.clear()
        wait_for(lambda: (l := read_lease(store)) and l.engine_state == "ok" and l.engine_version == 4, 30,
                 "recovery")
        assert [int(b["version"]) for b in engine.accepted][-1] == 4
        assert 3 not in [int(b["version"]) for b in engine.accepted]
        assert engine.refused >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        engine.shutdown()
    assert proc.returncode == 0, err[-3000:]
    lines = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]
    assert any("engine took version 4" in ln["message"] for ln in lines)
    assert any(ln["level"] == "error" and "hand-off" in ln["message"] for ln in lines)
    st = json.loads((out / "state.json").read_text())
    assert st["version"] == 4 and st["engine_version"] == 4


def test_in_process_daemon_on_update_and_once(tmp_path):
    from xcluster.follow.daemon import Daemon, DaemonConfig

    url = str(tmp_path / "store")
    pub = Publisher(url, config=PublisherConfig(keyframe_every=10))
    for s in range(3):
        pub.publish(weights(s), step=s)
    seen = []
    d = Daemon(url, config=DaemonConfig(out=tmp_path / "out", once=True, lease_every_s=0))
    d.on_update(lambda path, v: seen.append((path, v)))
    assert d.run() == 0
    assert [v for _, v in seen] == [3]
    assert seen[0][0] == (tmp_path / "out" / "current").resolve()
    # a second run resumes from disk: nothing to fetch, nothing to hand over again
    d2 = Daemon(url, config=DaemonConfig(out=tmp_path / "out", once=True, lease_every_s=0))
    assert d2.run() == 0
    assert d2.subscriber.stats.versions_applied == 0
    assert d2.state.version == 3
