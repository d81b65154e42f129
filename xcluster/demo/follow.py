"""The demo's follower: a separate process that subscribes to the store and proves each version.

Run as ``python -m xcluster.demo.follow --store URL --until-version N --results FILE``. It
polls :meth:`Subscriber.sync` until version ``N`` is applied and, for every version applied,
hashes the weights it now holds with :func:`xcluster.digest.model_digest` and appends one
JSON line to ``FILE``::

    {"event": "ready", "pid": 1234}
    {"event": "applied", "version": 1, "kind": "keyframe", "applied_unix": 1.7e9,
     "model_digest": "…", "subscriber_digest": "…", "bytes_fetched": 123}
    {"event": "done", "version": 20}            # or {"event": "error", "error": "…", "message": "…"}

The trainer compares ``model_digest`` with the digest it published. The file is plain JSON,
flushed line by line, so the trainer can read it while the follower runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..errors import XclusterError


class FollowerError(XclusterError):
    """The follower process failed, timed out, or wrote results that cannot be read."""


# --- the follower process -------------------------------------------------------------------

def _flip_one_bit(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` with the lowest bit of one element of the first floating tensor flipped."""
    import torch

    out = dict(state)
    for name in sorted(out):
        t = out[name]
        if t.is_floating_point() and t.numel():
            raw = t.detach().clone().contiguous().view(-1).view(torch.uint8)
            raw[0] ^= 1
            out[name] = raw.view(t.dtype).view(t.shape)
            return out
    raise FollowerError("--tamper-version: the state dict has no non-empty floating tensor to tamper with")


class _Recorder:
    def __init__(self, sink: TextIO) -> None:
        self.sink = sink

    def write(self, record: dict[str, Any]) -> None:
        self.sink.write(json.dumps(record, sort_keys=True) + "\n")
        self.sink.flush()


def follow(store: str, *, until_version: int, results: TextIO, poll: float, timeout: float,
           tamper_version: int | None = None, clock=time.monotonic, sleep=time.sleep) -> int:
    """Follow ``store`` until ``until_version`` is applied; return the last version applied.

    Gives up with :class:`FollowerError` after ``timeout`` seconds without a new version, or
    as soon as the process that started it has exited.
    """
    from .. import Subscriber, SubscriberConfig
    from ..digest import model_digest

    rec = _Recorder(results)
    parent = os.getppid()
    sub_box: list[Any] = []

    def on_apply(ev: Any) -> None:
        state = sub_box[0].state_dict(copy=False)  # hashed right here, before the next sync
        if ev.version == tamper_version:
            state = _flip_one_bit(state)
        rec.write({"event": "applied", "version": ev.version, "kind": ev.kind,
                   "applied_unix": ev.applied_unix, "model_digest": model_digest(state),
                   "subscriber_digest": ev.model_digest, "bytes_fetched": ev.bytes_fetched})

    sub = Subscriber(store, config=SubscriberConfig(), on_apply=on_apply)
    sub_box.append(sub)
    rec.write({"event": "ready", "pid": os.getpid()})
    last, last_change = None, clock()
    while True:
        version = sub.sync()
        if version is not None and version >= until_version:
            rec.write({"event": "done", "version": version})
            return version
        if version != last:
            last, last_change = version, clock()
        elif clock() - last_change > timeout:
            raise FollowerError(
                f"{store}: no new version for {timeout:g}s (last applied: {version}, waiting for "
                f"{until_version}); is the trainer still publishing?")
        if os.getppid() != parent:
            raise FollowerError(f"{store}: the process that started the follower exited; stopping")
        sleep(poll)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m xcluster.demo.follow", description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True, help="store URL to follow (any URL xcluster accepts)")
    p.add_argument("--until-version", type=int, required=True, help="stop once this version is applied")
    p.add_argument("--results", required=True, type=Path, help="file to write JSON lines to")
    p.add_argument("--poll", type=float, default=0.02, help="seconds between polls (default 0.02)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="give up after this many seconds without a new version (default 60)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    # Test hook: report a digest of the weights with one bit flipped at this version, to prove
    # the trainer's comparison notices. Not for users.
    p.add_argument("--tamper-version", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    torch.set_num_threads(max(1, args.threads))
    with open(args.results, "w", encoding="utf-8") as results:
        try:
            follow(args.store, until_version=args.until_version, results=results, poll=args.poll,
                   timeout=args.timeout, tamper_version=args.tamper_version)
        except XclusterError as exc:
            _Recorder(results).write({"event": "error", "error": type(exc).__name__, "message": str(exc)})
            print(f"xcluster follow: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    return 0


# --- the trainer's side ---------------------------------------------------------------------

@dataclass
class FollowerResults:
    """What the follower has written so far."""

    pid: int | None = None
    applied: dict[int, dict[str, Any]] = field(default_factory=dict)
    done: bool = False
    error: str | None = None


def read_results(path: str | Path) -> FollowerResults:
    """Parse the follower's JSON lines; a trailing partial line (still being written) is skipped."""
    out = FollowerResults()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return out
    lines = text.split("\n")
    for n, line in enumerate(lines[:-1], 1):  # the last element is "" or an unfinished line
        try:
            rec = json.loads(line)
            event = rec["event"]
        except (ValueError, KeyError, TypeError) as exc:
            raise FollowerError(f"{path}:{n}: not a follower record ({exc}): {line[:80]!r}") from exc
        if event == "ready":
            out.pid = int(rec["pid"])
        elif event == "applied":
            out.applied[int(rec["version"])] = rec
        elif event == "done":
            out.done = True
        elif event == "error":
            out.error = f"{rec.get('error')}: {rec.get('message')}"
    return out


class Follower:
    """A running follower subprocess, started by the trainer."""

    def __init__(self, store: str, *, until_version: int, results: str | Path, poll: float = 0.02,
                 timeout: float = 60.0, tamper_version: int | None = None) -> None:
        self.results = Path(results)
        self.results.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "xcluster.demo.follow", "--store", store,
               "--until-version", str(until_version), "--results", str(self.results),
               "--poll", str(poll), "--timeout", str(timeout)]
        if tamper_version is not None:
            cmd += ["--tamper-version", str(tamper_version)]
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so the child imports this xcluster
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float, *, sleep=time.sleep, clock=time.monotonic) -> None:
        deadline = clock() + timeout
        while read_results(self.results).pid is None:
            if self.proc.poll() is not None:
                raise FollowerError(f"follower exited with status {self.proc.returncode} before it was "
                                    f"ready:\n{self._output()}")
            if clock() > deadline:
                raise FollowerError(f"follower not ready after {timeout:g}s")
            sleep(0.05)

    def join(self, timeout: float) -> tuple[int, str]:
        """Wait for the follower to exit (killing it after ``timeout``); return (status, output)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode, self._output()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _output(self) -> str:
        if self.proc.poll() is None or self.proc.stdout is None:
            return ""
        return self.proc.stdout.read()


if __name__ == "__main__":  # pragma: no cover - exercised through the subprocess
    sys.exit(main())
