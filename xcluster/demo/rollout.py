"""The demo's rollout node: the real daemon (``xcluster subscribe``) feeding the demo engine.

Two processes, as deployed: :mod:`xcluster.demo.engine` (an HTTP engine that loads model
directories with transformers) and ``xcluster subscribe URL --out DIR --engine http`` handing each
new version's directory to it. :class:`RolloutNode` starts both, waits, and stops them (SIGTERM:
the daemon finishes its step and exits 0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import XclusterError


class RolloutError(XclusterError):
    """The demo's rollout node (daemon or engine) failed, timed out, or wrote unreadable results."""


@dataclass
class EngineResults:
    """What the demo engine recorded: its pid and port, and each version it loaded."""

    pid: int | None = None
    port: int | None = None
    loaded: dict[int, dict[str, Any]] = field(default_factory=dict)


def read_engine_results(path: str | Path) -> EngineResults:
    out = EngineResults()
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise RolloutError(f"{p}: unreadable line {line!r}") from exc
        if rec.get("event") == "ready":
            out.pid, out.port = rec["pid"], rec["port"]
        elif rec.get("event") == "loaded":
            out.loaded[int(rec["version"])] = rec
    return out


class RolloutNode:
    """Starts the demo engine and the daemon; ``stop()`` ends both."""

    def __init__(self, url: str, out: Path, *, poll: float = 0.05, tamper_version: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.url, self.out, self.poll = url, Path(out), poll
        self.results = self.out / "engine.jsonl"
        self.daemon_log = self.out / "daemon.log"
        self.model_dir = self.out / "rollout"
        self.tamper_version = tamper_version
        self.env = env if env is not None else dict(os.environ)
        self.engine: subprocess.Popen | None = None
        self.daemon: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for p in (self.results, self.daemon_log):
            p.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "xcluster.demo.engine", "--results", str(self.results)]
        if self.tamper_version is not None:
            cmd += ["--tamper-version", str(self.tamper_version)]
        self.engine = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       text=True)
        port = self._wait(lambda: read_engine_results(self.results).port, timeout, "the engine to listen")
        log = open(self.daemon_log, "w", encoding="utf-8")
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "xcluster.cli", "subscribe", self.url, "--out", str(self.model_dir),
             "--poll", str(self.poll), "--engine", "http", "--engine-url", f"http://127.0.0.1:{port}/reload",
             "--engine-body", '{"path": {path}, "version": {version}}', "--node-id", "demo-rollout",
             "--lease-interval", "1", "--log-format", "json", "--backoff-max", "1"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=log)
        log.close()

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the daemon polls the store (it writes its lease after its first poll)."""
        from ..format import lease_key
        from ..store import open_store

        store = open_store(self.url)

        def leased() -> bool:
            try:
                store.stat(lease_key("demo-rollout"))
                return True
            except XclusterError:
                return False
        self._wait(leased, timeout, "the daemon's first poll")

    def wait_for_engine(self, version: int, timeout: float) -> EngineResults:
        """Until the engine loaded ``version`` (or newer)."""
        self._wait(lambda: any(v >= version for v in read_engine_results(self.results).loaded), timeout,
                   f"the engine to load version {version}")
        return read_engine_results(self.results)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM both; returns the daemon's exit code."""
        code = 0
        for proc in (self.daemon, self.engine):
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.daemon is not None:
            code = self.daemon.returncode
        return code

    def daemon_messages(self) -> list[dict[str, Any]]:
        if not self.daemon_log.exists():
            return []
        return [json.loads(ln) for ln in self.daemon_log.read_text(encoding="utf-8").splitlines()
                if ln.startswith("{")]

    def _wait(self, pred, timeout: float, what: str):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = pred()
            if got:
                return got
            for name, proc in (("daemon", self.daemon), ("engine", self.engine)):
                if proc is not None and proc.poll() is not None:
                    tail = self.daemon_log.read_text()[-2000:] if name == "daemon" and self.daemon_log.exists() \
                        else (proc.stderr.read()[-2000:] if proc.stderr else "")
                    raise RolloutError(f"the {name} exited with status {proc.returncode} while waiting for "
                                       f"{what}: {tail}")
            time.sleep(0.05)
        raise RolloutError(f"timed out after {timeout:.0f}s waiting for {what}")
