"""The fault soak: a trainer, a fleet of ``xcluster subscribe`` daemons, a real SeaweedFS between
them behind fault proxies, ``kill -9`` at random moments, ``xcluster gc --apply`` on a short
grace, and a referee that trusts nothing xcluster says about itself.

Used by ``bench/soak.py`` (the long run, with a table) and ``tests/integration/test_soak.py``
(a short one in the suite).

- **Trainer** (``python -m tests.support.soak publish …``, its own process): an fp32 master of a
  small model, Adam-like updates (±lr per element, seeded per step) cast to bf16 each step, so
  about 2% of the bf16 elements change; plus a ``step`` tensor. The weights of step ``s`` are a
  pure function of the seed and ``s``, so after a ``kill -9`` it resumes with step (HEAD's step
  + 1) and the referee knows the truth of every step without asking it. It appends
  ``{"version", "step", "committed_unix"}`` to a journal after each commit.
- **Proxies** (:class:`~tests.support.faultproxy.FaultProxy`): one between the trainer and
  SeaweedFS, one between the daemons and SeaweedFS; resets mid-body, truncated and bit-flipped
  bodies, 503 SlowDown, 500, latency spikes, counted by kind.
- **Daemons**: ``xcluster subscribe`` processes, one ``--out`` each, through the proxy.
- **Chaos**: ``kill -9`` of the trainer or a daemon every few seconds (restarted at once); one
  daemon is kept offline until ``xcluster gc --apply`` (run every few seconds with a short grace
  and lease TTL) has deleted the versions after the one it holds, so it can only come back
  through a keyframe.
- **Referee**: SHA-256 of each tensor's bytes, computed here from the trainer's formula, is the
  truth. Every model directory a daemon exposes at ``OUT/current`` is loaded with safetensors
  and hashed; any difference from the truth of the step it holds (names, bytes, the version's
  step as journaled, a version above HEAD) is a *corrupt observation*.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "soak"
CONFIG_JSON = b'{"model_type": "xcluster-soak", "architectures": ["Soak"]}\n'
log = logging.getLogger("soak")


# --- the trainer's weights, a pure function of (spec, step) ------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    tensors: int = 6
    rows: int = 256
    cols: int = 512
    seed: int = 7
    lr: float = 5e-7
    """Adam-like step size: each fp32 master element moves by lr·N(0,1) per step; with weights
    of std 0.02 about 2% of the bf16 elements change per step."""

    def args(self) -> list[str]:
        return ["--tensors", str(self.tensors), "--rows", str(self.rows), "--cols", str(self.cols),
                "--model-seed", str(self.seed), "--lr", repr(self.lr)]

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> ModelSpec:
        return cls(tensors=a.tensors, rows=a.rows, cols=a.cols, seed=a.model_seed, lr=a.lr)


def add_spec_args(p: argparse.ArgumentParser, spec: ModelSpec = ModelSpec()) -> None:
    p.add_argument("--tensors", type=int, default=spec.tensors)
    p.add_argument("--rows", type=int, default=spec.rows)
    p.add_argument("--cols", type=int, default=spec.cols)
    p.add_argument("--model-seed", type=int, default=spec.seed)
    p.add_argument("--lr", type=float, default=spec.lr)


class TrainerModel:
    """fp32 master weights at ``step``; ``state()`` is what the trainer publishes for it."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        g = torch.Generator().manual_seed(spec.seed)
        self.master = {f"layers.{i}.weight": torch.randn(spec.rows, spec.cols, generator=g) * 0.02
                       for i in range(spec.tensors)}
        self.step = 0

    def advance_to(self, step: int) -> None:
        if step < self.step:
            raise ValueError(f"cannot go back from step {self.step} to {step}")
        for s in range(self.step + 1, step + 1):
            g = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + s)
            for w in self.master.values():
                w.add_(torch.randn(w.shape, generator=g), alpha=self.spec.lr)
        self.step = step

    def state(self) -> dict[str, torch.Tensor]:
        sd = {n: w.to(torch.bfloat16) for n, w in self.master.items()}
        sd["step"] = torch.tensor([self.step], dtype=torch.int64)
        return sd


def sha256_of(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in memory order (nothing of xcluster's digests)."""
    t = t.detach().contiguous()
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


class Truth:
    """SHA-256 of every tensor of every step, computed forward from the trainer's formula."""

    def __init__(self, spec: ModelSpec) -> None:
        self._model = TrainerModel(spec)
        self._hashes: dict[int, dict[str, str]] = {}
        self._lock = threading.Lock()

    def of(self, step: int) -> dict[str, str]:
        with self._lock:
            while step not in self._hashes:
                if step < self._model.step:
                    raise KeyError(step)
                if self._model.step not in self._hashes:
                    self._hashes[self._model.step] = {n: sha256_of(t) for n, t in self._model.state().items()}
                    continue
                self._model.advance_to(self._model.step + 1)
            return self._hashes[step]


# --- the trainer process ------------------------------------------------------------------------------
def _next_step(store) -> int:
    from xcluster.read.chain import Link, read_head, read_manifest

    head, _ = read_head(store)
    if head is None:
        return 0
    return read_manifest(store, Link.of_head(head)).manifest.step + 1


def publisher_main(argv: list[str]) -> int:
    from xcluster import Publisher, PublisherConfig
    from xcluster.codec.encode import CodecConfig
    from xcluster.errors import ConcurrentPublisherError, XclusterError
    from xcluster.store import open_store

    p = argparse.ArgumentParser(prog="soak publish")
    p.add_argument("url")
    p.add_argument("--journal", required=True)
    p.add_argument("--interval", type=float, default=0.2)
    p.add_argument("--keyframe-every", type=int, default=10)
    p.add_argument("--max-versions", type=int, default=0, help="stop once HEAD reaches this (0: never)")
    p.add_argument("--block-bytes", type=int, default=64 << 10)
    p.add_argument("--chunk-bytes", type=int, default=128 << 10)
    add_spec_args(p)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    spec = ModelSpec.from_args(a)
    cfg = PublisherConfig(keyframe_every=a.keyframe_every,
                          codec=CodecConfig(block_bytes=a.block_bytes, chunk_bytes=a.chunk_bytes))
    store = open_store(a.url)
    journal = open(a.journal, "a", buffering=1)
    done = False
    while not stop.is_set() and not done:
        try:  # (re)start as an operator would: read where HEAD is, continue with the next step
            pub = Publisher(store=store, config=cfg, files={"config.json": CONFIG_JSON})
            step = _next_step(store)
        except XclusterError as exc:
            log.warning("start-up failed, retrying: %s", exc)
            stop.wait(0.5)
            continue
        model = TrainerModel(spec)
        model.advance_to(step)
        log.info("publishing from step %d on top of version %d", step, pub.version)
        while not stop.is_set():
            if a.max_versions and pub.version >= a.max_versions:
                done = True
                break
            try:
                res = pub.publish(model.state(), step=step)
            except ConcurrentPublisherError as exc:  # a killed predecessor's HEAD write landed late
                log.warning("%s: starting over from HEAD", exc)
                break
            except XclusterError as exc:  # nothing became visible: the same step again
                log.warning("publish of step %d failed, retrying: %s: %s", step, type(exc).__name__, exc)
                stop.wait(0.3)
                continue
            journal.write(json.dumps({"version": res.version, "step": step, "kind": res.kind,
                                      "committed_unix": res.committed_unix}) + "\n")
            step += 1
            model.advance_to(step)
            stop.wait(a.interval)
    journal.close()
    return 0


# --- the harness --------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class SoakConfig:
    versions: int = 150
    """At least this many versions are published (more if the fault and kill targets need longer)."""
    subscribers: int = 3
    min_faults: int = 1000
    """Keep going until at least this many faults were injected…"""
    min_kills: int = 50
    """… and this many processes were killed with SIGKILL."""
    duration_s: float = 1800.0
    """Cap on the chaos phase, whether or not the targets were met."""
    converge_timeout_s: float = 180.0
    """After the trainer stops: how long every daemon has to reach HEAD (faults stay on)."""
    keyframe_every: int = 10
    publish_interval_s: float = 0.2
    fault_probability: float = 0.2
    """Per request through the daemons' proxy."""
    publisher_fault_probability: float = 0.05
    """Per request through the trainer's proxy."""
    fault_latency_s: float = 0.5
    kill_every_s: tuple[float, float] = (1.0, 5.0)
    restart_delay_s: tuple[float, float] = (0.0, 1.0)
    publisher_kill_share: float = 0.3
    offline: bool = True
    """Keep the last daemon offline until gc has removed what follows the version it holds."""
    gc_every_s: float = 3.0
    grace_s: float = 5.0
    lease_ttl_s: float = 4.0
    poll_s: float = 0.2
    lease_interval_s: float = 0.5
    seed: int = 0
    model: ModelSpec = field(default_factory=ModelSpec)
    workdir: Path | None = None
    """Where stores' logs and daemons' directories go (a temporary directory if None)."""


@dataclass
class SubReport:
    name: str
    applied: set[int] = field(default_factory=set)
    keyframes_applied: int = 0
    observations: int = 0
    vanished: int = 0
    max_stale_s: float = 0.0
    max_behind: int = 0
    final_version: int | None = None
    converged: bool = False
    kills: int = 0


@dataclass
class SoakReport:
    config: SoakConfig
    faults: Counter = field(default_factory=Counter)
    requests: int = 0
    publisher_kills: int = 0
    subscriber_kills: int = 0
    versions_published: int = 0
    final_step: int | None = None
    subs: dict[str, SubReport] = field(default_factory=dict)
    corrupt: list[str] = field(default_factory=list)
    gc_runs: int = 0
    gc_deleted: int = 0
    offline: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def kills(self) -> int:
        return self.publisher_kills + self.subscriber_kills

    @property
    def offline_ok(self) -> bool:
        o = self.offline
        return not self.config.offline or bool(o.get("chain_gone") and o.get("rejoined_by_keyframe"))

    @property
    def ok(self) -> bool:
        return (not self.corrupt and not self.problems and all(s.converged for s in self.subs.values())
                and self.offline_ok)

    def table(self) -> str:
        c = self.config
        rows = [("faults injected (total)", f"{sum(self.faults.values())} of {self.requests} requests")]
        for k in sorted(self.faults):
            rows.append((f"  {k}", str(self.faults[k])))
        rows += [("kill -9 (publisher / subscribers)", f"{self.publisher_kills} / {self.subscriber_kills}"),
                 ("versions published", f"{self.versions_published} (keyframe every {c.keyframe_every}; "
                                        f"final step {self.final_step})"),
                 ("gc --apply runs / objects deleted", f"{self.gc_runs} / {self.gc_deleted}")]
        o = self.offline
        if c.offline:
            rows.append(("offline subscriber", f"{o.get('name')}: held v{o.get('held')}, away "
                         f"{o.get('away_s', 0):.1f}s; v{o.get('held')}+1 gc'd: {'yes' if o.get('chain_gone') else 'no'};"
                         f" came back by keyframe v{o.get('keyframe')}: "
                         f"{'yes' if o.get('rejoined_by_keyframe') else 'no'}"))
        rows.append(("corrupt observations", str(len(self.corrupt))))
        w = max(len(r[0]) for r in rows)
        out = [f"{k:<{w}}  {v}" for k, v in rows]
        out.append("")
        out.append(f"{'subscriber':<10} {'applied':>7} {'keyframes':>9} {'kills':>5} {'observed':>8} "
                   f"{'max stale':>9} {'max behind':>10} {'final':>6} converged")
        for s in self.subs.values():
            out.append(f"{s.name:<10} {len(s.applied):>7} {s.keyframes_applied:>9} {s.kills:>5} {s.observations:>8} "
                       f"{s.max_stale_s:>8.1f}s {s.max_behind:>10} {s.final_version if s.final_version else '-':>6} "
                       f"{'yes' if s.converged else 'NO'}")
        out.append("")
        out.append(f"elapsed {self.elapsed_s:.0f}s; verdict: {'PASS' if self.ok else 'FAIL'}")
        for msg in self.corrupt[:20]:
            out.append(f"CORRUPT: {msg}")
        for msg in self.problems[:20]:
            out.append(f"PROBLEM: {msg}")
        return "\n".join(out)


class _Proc:
    """A restartable child process with its output appended to a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], logpath: Path) -> None:
        self.name, self.cmd, self.env, self.logpath = name, cmd, env, logpath
        self.proc: subprocess.Popen | None = None
        self.restart_at: float | None = None
        self.kills = 0
        self.log_mark = 0  # the log's size at the last start

    def start(self) -> None:
        with open(self.logpath, "ab") as logf:
            self.log_mark = logf.tell()
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                         stdout=logf, stderr=subprocess.STDOUT)
        self.restart_at = None

    def following(self) -> bool:
        """Has the daemon started since the last start (its signal handlers are installed before
        its loop logs anything from ``xcluster.daemon`` or ``xcluster.read.subscriber``)?"""
        with open(self.logpath, "rb") as f:
            f.seek(self.log_mark)
            tail = f.read()
        return b'"logger": "xcluster.daemon"' in tail or b'"logger": "xcluster.read.subscriber"' in tail

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> bool:
        if not self.alive:
            return False
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.kills += 1
        return True

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(timeout=30)
        return self.proc.returncode


_APPLIED = re.compile(r"applied version (\d+) \((\w+),")


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.truth = Truth(cfg.model)
        self.report = SoakReport(cfg)
        self.report.subs = {f"sub-{i}": SubReport(f"sub-{i}") for i in range(cfg.subscribers)}
        self.journal: dict[int, dict] = {}
        self._journal_pos = 0
        self.head_seen: dict[int, float] = {}  # version -> first time the referee saw HEAD name it
        self.head_version = 0
        self.step_of: dict[int, int] = {}  # version -> step, as observed
        self._verified: dict[str, tuple] = {}
        self._offline_window: dict[str, tuple[float, float]] = {}

    # --- setup ------------------------------------------------------------------------------------
    def run(self) -> SoakReport:
        from tests.support.faultproxy import KINDS, FaultProxy
        from tests.support.seaweed import ACCESS_KEY, SECRET_KEY, start_seaweedfs

        cfg, t0 = self.cfg, time.monotonic()
        with ExitStack() as stack:
            work = cfg.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="xc-soak-")))
            work.mkdir(parents=True, exist_ok=True)
            self.work = work
            sw = stack.enter_context(start_seaweedfs())
            host, port = sw.endpoint.rsplit("//", 1)[1].split(":")
            upstream = (host, int(port))
            base_env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                        "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
            for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
                base_env.pop(k, None)
            self.direct_env = {**base_env, "AWS_ENDPOINT_URL": sw.endpoint}
            self.url = f"s3://{BUCKET}/run"
            self._make_bucket(sw)
            self.direct = self._direct_store(sw.endpoint)
            pub_proxy = stack.enter_context(FaultProxy(upstream, probability=cfg.publisher_fault_probability,
                                                       kinds=KINDS, seed=cfg.seed * 2 + 1,
                                                       fault_latency_s=cfg.fault_latency_s))
            sub_proxy = stack.enter_context(FaultProxy(upstream, probability=cfg.fault_probability, kinds=KINDS,
                                                       seed=cfg.seed * 2 + 2, fault_latency_s=cfg.fault_latency_s))
            self.proxies = (pub_proxy, sub_proxy)
            self.journal_path = work / "journal.jsonl"
            self.publisher = _Proc("publisher", [
                sys.executable, "-m", "tests.support.soak", "publish", self.url, "--journal", str(self.journal_path),
                "--interval", str(cfg.publish_interval_s), "--keyframe-every", str(cfg.keyframe_every),
                *cfg.model.args()], {**base_env, "AWS_ENDPOINT_URL": pub_proxy.endpoint}, work / "publisher.log")
            self.subs: list[_Proc] = []
            for i in range(cfg.subscribers):
                name = f"sub-{i}"
                out = work / name
                self.subs.append(_Proc(name, [
                    sys.executable, "-m", "xcluster.cli", "subscribe", self.url, "--out", str(out),
                    "--poll", str(cfg.poll_s), "--lease-interval", str(cfg.lease_interval_s), "--backoff-max", "2",
                    "--node-id", name, "--log-format", "json", "--no-progress"],
                    {**base_env, "AWS_ENDPOINT_URL": sub_proxy.endpoint}, work / f"{name}.log"))
            try:
                self._chaos(t0)
                self._converge()
            finally:
                for p in [self.publisher, *self.subs]:
                    rc = p.stop()
                    if p is not self.publisher and rc not in (0, None, -signal.SIGKILL):
                        self.report.problems.append(f"{p.name} exited {rc} on SIGTERM (see {p.logpath})")
                self._gc_wait()
            self._read_logs()
            for px in self.proxies:
                self.report.faults.update(px.counts)
                self.report.requests += px.requests
        self.report.elapsed_s = time.monotonic() - t0
        return self.report

    def _make_bucket(self, sw) -> None:
        _client(sw.endpoint).create_bucket(Bucket=BUCKET)

    def _direct_store(self, endpoint: str):
        """The referee's own view of the bucket: straight to SeaweedFS, no proxy."""
        from xcluster.store.s3.store import S3Store

        return S3Store.from_url(self.url, client=_client(endpoint))

    # --- the chaos phase --------------------------------------------------------------------------
    def _targets_met(self) -> bool:
        faults = sum(sum(px.counts.values()) for px in self.proxies)
        cfg = self.cfg
        return (self.head_version >= cfg.versions and faults >= cfg.min_faults and self.report.kills >= cfg.min_kills
                and (self.report.publisher_kills >= 1 or cfg.publisher_kill_share == 0)
                and (not cfg.offline or "rejoined_at" in self.report.offline))

    def _chaos(self, t0: float) -> None:
        cfg, rng = self.cfg, self.rng
        self.publisher.start()
        for s in self.subs:
            s.start()
        offline = self.subs[-1] if cfg.offline and len(self.subs) > 1 else None
        next_kill = time.monotonic() + rng.uniform(*cfg.kill_every_s) + 3.0
        self._next_gc = time.monotonic() + cfg.gc_every_s
        self._gc_proc: subprocess.Popen | None = None
        pub_head = 0  # HEAD when the trainer last (re)started
        while not self._targets_met():
            now = time.monotonic()
            if now - t0 > cfg.duration_s:
                self.report.problems.append(f"targets not met within --duration {cfg.duration_s:.0f}s")
                break
            self._tick()
            if self.publisher.proc.poll() not in (None, -signal.SIGKILL) and self.publisher.restart_at is None:
                self.report.problems.append(f"the trainer exited {self.publisher.proc.returncode} by itself")
                break
            for p in [self.publisher, *self.subs]:
                if p.restart_at is not None and now >= p.restart_at:
                    p.start()
                    if p is self.publisher:
                        pub_head = self.head_version
            if offline is not None:
                self._offline_phase(offline, now)
            if now >= next_kill and self.head_version >= 1:
                next_kill = now + rng.uniform(*cfg.kill_every_s)
                victims = [s for s in self.subs if s.alive and s is not self._away()]
                owed = cfg.publisher_kill_share > 0 and self.report.publisher_kills == 0 and self.report.kills >= 2
                # the trainer is killed again only once it has committed since its restart: it must make progress
                pub_ok = self.publisher.alive and self.head_version > pub_head
                pick = self.publisher if (pub_ok and (owed or rng.random() < cfg.publisher_kill_share)) \
                    else (rng.choice(victims) if victims else None)
                if pick is not None and pick.kill9():
                    if pick is self.publisher:
                        self.report.publisher_kills += 1
                    else:
                        self.report.subscriber_kills += 1
                    pick.restart_at = now + rng.uniform(*cfg.restart_delay_s)
            time.sleep(0.1)
        # stop the trainer (restarting it first if it is down), then let the fleet catch up
        if self.publisher.alive:  # (a trainer killed last stays down: HEAD is where it stopped)
            rc = self.publisher.stop(timeout=120)
            if rc not in (0, -signal.SIGTERM):  # -SIGTERM: it was still starting, before its handler
                self.report.problems.append(f"the trainer exited {rc} on SIGTERM (see {self.publisher.logpath})")
        restarted = [s for s in self.subs if not s.alive]
        for s in restarted:
            s.start()
        # a daemon stopped while still starting dies of SIGTERM before its handler is installed:
        # let the ones just restarted reach their loop (the fleet may already show HEAD on disk)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(s.following() or not s.alive for s in restarted):
            time.sleep(0.1)

    def _away(self) -> _Proc | None:
        o = self.report.offline
        if "since" in o and "rejoined_at" not in o:
            return next(s for s in self.subs if s.name == o["name"])
        return None

    def _offline_phase(self, sub: _Proc, now: float) -> None:
        from xcluster.format import version_dir

        o, cfg = self.report.offline, self.cfg
        if "since" not in o:
            held = self._current_version(sub.name)
            if held is None or self.head_version < max(3, cfg.keyframe_every // 2) or not sub.alive:
                return
            sub.kill9()
            sub.restart_at = None
            self.report.subscriber_kills += 1
            o.update(name=sub.name, since=now, held=self._current_version(sub.name))
            return
        if "rejoined_at" in o:
            return
        held = o["held"]
        if self.head_version < held + cfg.keyframe_every or now - o.get("checked", 0) < 1.0:
            return
        o["checked"] = now
        gone = all(not self.direct.list(version_dir(v) + "/") for v in (held + 1,))
        if gone:
            o.update(chain_gone=True, rejoined_at=now, away_s=now - o["since"], head_at_rejoin=self.head_version)
            self._offline_window[sub.name] = (o["since"], now)
            self._mark_log(sub)
            sub.start()

    def _mark_log(self, sub: _Proc) -> None:
        with open(sub.logpath, "ab") as f:
            f.write(b'{"soak": "rejoin"}\n')

    # --- what the referee watches -----------------------------------------------------------------
    def _tick(self) -> None:
        self._read_journal()
        self._watch_head()
        self._gc()
        now = time.time()
        for s in self.subs:
            self._observe(s.name, now)

    def _read_journal(self) -> None:
        try:
            with open(self.journal_path, "rb") as f:
                f.seek(self._journal_pos)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._journal_pos += end
        for line in data[:end].splitlines():
            rec = json.loads(line)
            if rec["version"] in self.journal and self.journal[rec["version"]]["step"] != rec["step"]:
                self.report.corrupt.append(f"journal: version {rec['version']} recorded with two steps")
            self.journal[rec["version"]] = rec

    def _watch_head(self) -> None:
        from xcluster.read.chain import read_head

        try:
            head, _ = read_head(self.direct)
        except Exception as exc:  # noqa: BLE001 - the referee's own reads go direct; report, go on
            log.warning("referee could not read HEAD: %s", exc)
            return
        if head is not None:
            if head.version < self.head_version:
                self.report.corrupt.append(f"HEAD went back from {self.head_version} to {head.version}")
            self.head_seen.setdefault(head.version, time.time())
            self.head_version = max(self.head_version, head.version)

    def _gc(self) -> None:
        cfg = self.cfg
        if self._gc_proc is not None and self._gc_proc.poll() is not None:
            self._gc_done()
        if self._gc_proc is None and time.monotonic() >= self._next_gc:
            self._next_gc = time.monotonic() + cfg.gc_every_s
            self._gc_proc = subprocess.Popen(
                [sys.executable, "-m", "xcluster.cli", "gc", self.url, "--apply", "--lease-ttl", str(cfg.lease_ttl_s),
                 "--grace", str(cfg.grace_s)], env=self.direct_env, cwd=ROOT, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)

    def _gc_done(self) -> None:
        out = self._gc_proc.stdout.read()
        rc = self._gc_proc.returncode
        self._gc_proc = None
        if rc != 0:
            self.report.problems.append(f"xcluster gc exited {rc}: {out[-500:]}")
            return
        self.report.gc_runs += 1
        m = re.search(r"deleted (\d+) objects", out)
        self.report.gc_deleted += int(m.group(1)) if m else 0

    def _gc_wait(self) -> None:
        if self._gc_proc is not None:
            self._gc_proc.wait(timeout=120)
            self._gc_done()

    def _current_slot(self, name: str) -> Path | None:
        try:
            return self.work / name / os.readlink(self.work / name / "current")
        except FileNotFoundError:
            return None

    def _current_version(self, name: str) -> int | None:
        """The version the slot ``current`` names is tagged with (None: no current, or untagged)."""
        d = self._current_slot(name)
        try:
            return int(json.loads((d / ".xcluster-version").read_bytes())["version"]) if d else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _observe(self, name: str, now: float) -> int | None:
        """Check what ``OUT/current`` exposes against the truth; returns its version."""
        from safetensors.torch import load_file

        d = self._current_slot(name)
        v = self._current_version(name)
        if v is None or d is None:
            return None
        sr = self.report.subs[name]
        try:
            files = sorted(d.glob("*.safetensors"))
            sig = (v, tuple((f.name, *_stat(f)) for f in files))
            if self._verified.get(name) != sig:
                tensors: dict[str, torch.Tensor] = {}
                for f in files:
                    tensors.update(load_file(f))
                if self._current_slot(name) != d or self._current_version(name) != v:
                    sr.vanished += 1  # current moved on while it was read: the read proves nothing
                    return None
                self._check(name, v, tensors)
                self._verified[name] = sig
                sr.observations += 1
        except (FileNotFoundError, NotADirectoryError):
            if self._current_version(name) == v:  # still current, yet incomplete: that is exposure
                self.report.corrupt.append(f"{name}: current -> {d.name} (version {v}) is missing files")
            else:
                sr.vanished += 1  # pruned after current moved on: nothing was exposed wrongly
            return None
        except Exception as exc:  # noqa: BLE001 - an unreadable exposed directory is a finding
            if self._current_version(name) == v:
                self.report.corrupt.append(f"{name}: current -> {d.name} (version {v}) unreadable: {exc!r}")
            return None
        self._staleness(name, v, now)
        return v

    def _check(self, name: str, v: int, tensors: dict[str, torch.Tensor]) -> None:
        bad = self.report.corrupt
        if v > self.head_version:
            self._watch_head()
            if v > self.head_version:
                bad.append(f"{name}: exposes version {v}, above HEAD {self.head_version}")
                return
        st = tensors.get("step")
        if st is None or st.dtype != torch.int64 or st.numel() != 1 or not 0 <= int(st.item()) <= 10**7:
            bad.append(f"{name}: version {v} has no valid step tensor")
            return
        step = int(st.item())
        truth = self.truth.of(step)
        got = {n: sha256_of(t) for n, t in tensors.items()}
        if set(got) != set(truth):
            bad.append(f"{name}: version {v} (step {step}) tensors {sorted(set(got) ^ set(truth))} differ in name")
        for n in sorted(set(got) & set(truth)):
            if got[n] != truth[n]:
                bad.append(f"{name}: version {v} (step {step}) {n} sha256 {got[n][:16]}… != truth {truth[n][:16]}…")
        self._read_journal()
        j = self.journal.get(v)
        if j is not None and j["step"] != step:
            bad.append(f"{name}: version {v} holds step {step}, the trainer journaled step {j['step']}")
        prev = self.step_of.setdefault(v, step)
        if prev != step:
            bad.append(f"{name}: version {v} holds step {step}, seen elsewhere as step {prev}")

    def _staleness(self, name: str, v: int, now: float) -> None:
        sr = self.report.subs[name]
        win = self._offline_window.get(name)
        o = self.report.offline
        if o.get("name") == name and "since" in o and (win is None or v < o.get("head_at_rejoin", 0)):
            return  # planned absence and the catch-up after it, not staleness
        behind = self.head_version - v
        sr.max_behind = max(sr.max_behind, behind)
        if behind > 0:
            since = [t for ver, t in self.head_seen.items() if ver > v]
            since += [r["committed_unix"] for ver, r in self.journal.items() if ver > v]
            if since:
                sr.max_stale_s = max(sr.max_stale_s, now - min(since))

    # --- the end ----------------------------------------------------------------------------------
    def _converge(self) -> None:
        from xcluster.read.chain import Link, read_head, read_manifest

        cfg = self.cfg
        self._read_journal()
        head, _ = read_head(self.direct)
        if head is None:
            self.report.problems.append("nothing was ever published")
            return
        final_step = read_manifest(self.direct, Link.of_head(head)).manifest.step
        self.report.versions_published = head.version
        self.report.final_step = final_step
        self._watch_head()
        if self.journal.get(head.version, {}).get("step", final_step) != final_step:
            self.report.corrupt.append(f"HEAD {head.version}: manifest step {final_step} != journal")
        deadline = time.monotonic() + cfg.converge_timeout_s
        while time.monotonic() < deadline:
            self._tick()
            if all(self._current_version(s.name) == head.version for s in self.subs):
                break
            time.sleep(0.2)
        # final state equal to the trainer's: HEAD's step, hashed from the directory on disk
        truth = self.truth.of(final_step)
        from safetensors.torch import load_file

        for s in self.subs:
            sr = self.report.subs[s.name]
            sr.final_version = self._current_version(s.name)
            self._observe(s.name, time.time())
            if sr.final_version != head.version:
                continue
            d = self._current_slot(s.name)
            tensors: dict[str, torch.Tensor] = {}
            for f in sorted(d.glob("*.safetensors")):
                tensors.update(load_file(f))
            sr.converged = {n: sha256_of(t) for n, t in tensors.items()} == truth

    def _read_logs(self) -> None:
        for s in self.subs:
            sr = self.report.subs[s.name]
            sr.kills = s.kills
            rejoined = False
            for line in s.logpath.read_text(errors="replace").splitlines():
                if line.startswith('{"soak": "rejoin"}'):
                    rejoined = True
                    continue
                m = _APPLIED.search(line)
                if not m:
                    continue
                v, kind = int(m.group(1)), m.group(2)
                sr.applied.add(v)
                sr.keyframes_applied += kind == "keyframe"
                if rejoined:  # the first version applied after coming back
                    rejoined = False
                    self.report.offline.update(rejoined_by_keyframe=kind == "keyframe", keyframe=v)


def _client(endpoint: str):
    import boto3
    from botocore.config import Config

    from tests.support.seaweed import ACCESS_KEY, SECRET_KEY

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY, config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5}))


def _stat(p: Path) -> tuple[int, int, int]:
    st = p.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def run_soak(cfg: SoakConfig) -> SoakReport:
    return Soak(cfg).run()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "publish":
        sys.exit(publisher_main(sys.argv[2:]))
    sys.exit("usage: python -m tests.support.soak publish URL --journal PATH [...]")
