"""Rollout-node benchmark: what following a store costs the node, per version — host memory,
bytes written, and install time (commit → ``current`` switched) — keyframe vs delta.

Workload: a bf16 model of ``--gib`` GiB (64 MiB matrices), a keyframe, then deltas that change
``--changed`` of the elements (one ulp, at random), a forced keyframe, and more deltas. The
trainer side publishes into a local store on disk; the daemon (``xcluster subscribe``, its own
process, as deployed, with ``--engine exec --exec true`` standing for an engine that confirms each
hand-off at once) follows it into ``--out`` on /dev/shm. A sampler reads the daemon's /proc status
and the bytes under ``--out`` every 20 ms.

``--compare DIR`` runs the same workload, in the same run, with the xcluster checkout at DIR
(e.g. a ``git worktree`` of the commit before the slots) for a side-by-side table.

    .venv/bin/python bench/rollout_node.py                       # 2 GiB model, 2 slots and 1 slot
    .venv/bin/python bench/rollout_node.py --gib 1 --compare /tmp/xc-before

Columns: ``peak`` = the largest (daemon anonymous RSS + bytes of files under --out) seen while
that version was installed, in units of the model; ``rss`` = the daemon's peak VmRSS (it counts
the mapped slot pages again, which live in the tmpfs); ``written`` = bytes the daemon wrote into
model directories for that version (its ``xcluster_slot_bytes_written`` metric; for a checkout
without it, the write() bytes of /proc/PID/io); ``install`` = commit → ``current`` switched, from
the daemon's log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xcluster import Publisher, PublisherConfig  # noqa: E402

GIB = 1 << 30


def make_model(gib: float) -> dict[str, torch.Tensor]:
    n = max(1, round(gib * 16))  # 64 MiB each
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": (torch.randn(4096, 8192, generator=g) * 0.02).to(torch.bfloat16) for i in range(n)}


def step(state: dict[str, torch.Tensor], frac: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        bits = t.view(torch.int16).view(-1)
        idx = torch.randint(0, bits.numel(), (int(bits.numel() * frac),), generator=g)
        bits[idx] += 1


def tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except FileNotFoundError:
                continue
            total += st.st_blocks * 512
    return total


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            k, _, v = line.partition(":")
            if k == "wchar":
                out["wchar"] = int(v)
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


class Sampler(threading.Thread):
    def __init__(self, pid: int, out: Path) -> None:
        super().__init__(daemon=True)
        self.pid, self.out = pid, out
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.peak = self.rss = 0
        self.last: dict[str, int] = {}

    def take(self) -> tuple[int, int]:
        with self.lock:
            got = (self.peak, self.rss)
            self.peak = self.rss = 0
        return got

    def run(self) -> None:
        while not self.stop.is_set():
            s = proc_status(self.pid)
            if s:
                total = s.get("RssAnon", 0) + tree_bytes(self.out)
                with self.lock:
                    self.peak = max(self.peak, total)
                    self.rss = max(self.rss, s.get("VmRSS", 0))
                    self.last = s
            time.sleep(0.02)


def metric(port: int, name: str) -> dict[str, float]:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    got = {}
    for line in text.splitlines():
        if line.startswith(name):
            m = re.match(rf'{name}(?:\{{how="(\w+)"\}})? (\S+)', line)
            if m:
                got[m.group(1) or ""] = float(m.group(2))
    return got


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(label: str, checkout: Path, args, extra: list[str]) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="xc-node-bench-", dir=args.store_dir))
    out = Path(tempfile.mkdtemp(prefix="xc-node-out-", dir=args.out_dir))
    store = work / "store"
    state = make_model(args.gib)
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    pub = Publisher(str(store), config=PublisherConfig(keyframe_every=1000))
    pub.publish(state)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    log_path = work / "daemon.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "xcluster.cli", "subscribe", str(store), "--out", str(out),
                                 "--poll", "0.05", "--lease-interval", "0", "--metrics-port", str(port),
                                 "--log-format", "json", "--engine", "exec", "--exec", "true", *extra],
                                env=env, cwd=checkout, stdout=log,
                                stderr=subprocess.STDOUT)
    sampler = Sampler(proc.pid, out)
    sampler.start()
    rows = []
    try:
        plan = ["keyframe"] + ["delta"] * args.deltas + ["keyframe"] + ["delta"] * 2
        for v, kind in enumerate(plan, start=1):
            if v > 1:
                step(state, args.changed, seed=v)
                sampler.take()
                before_w = metric(port, "xcluster_slot_bytes_written_total")
                before_io = sampler.last.get("wchar", 0)
                pub.publish(state, keyframe=kind == "keyframe")
            else:
                before_w, before_io = {}, 0
            install = wait_current(log_path, v, timeout=600)
            end = time.monotonic() + 60  # the standby's catch-up after the hand-off: before the next version
            while time.monotonic() < end and metric(port, "xcluster_catch_up_duration_seconds_count").get("", v) < v:
                time.sleep(0.05)
            time.sleep(0.1)
            peak, rss = sampler.take()
            after_w = metric(port, "xcluster_slot_bytes_written_total")
            if after_w:
                written = sum(after_w.values()) - sum(before_w.values())
                how = ",".join(f"{k}" for k in after_w if after_w[k] > before_w.get(k, 0))
            else:
                written = sampler.last.get("wchar", 0) - before_io
                how = "write()"
            after_delta = kind == "delta" and plan[v - 2] == "keyframe" and v > 2
            rows.append(dict(design=label, version=v, kind=kind + (" (first after keyframe)" if after_delta else ""),
                             peak=peak / model_bytes, rss=rss / model_bytes, written=written / model_bytes,
                             how=how, install=install))
            print(f"  {label} v{v} {kind}: install {install:.2f}s peak {peak / model_bytes:.2f}x", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        sampler.stop.set()
        pub.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    return rows


def wait_current(log_path: Path, version: int, timeout: float) -> float:
    """Seconds from commit to ``current`` switched, as the daemon logged them for ``version``."""
    pat = re.compile(rf"version {version} is current at .*?([0-9.]+)s after commit")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for line in log_path.read_text().splitlines():
            try:
                msg = json.loads(line)["message"]
            except (ValueError, KeyError):
                continue
            m = pat.search(msg)
            if m:
                return float(m.group(1))
        time.sleep(0.05)
    raise TimeoutError(f"version {version} never became current; see {log_path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="model size in GiB of bf16 (default 2)")
    ap.add_argument("--changed", type=float, default=0.01, help="fraction of elements a delta changes")
    ap.add_argument("--deltas", type=int, default=4, help="deltas after the first keyframe")
    ap.add_argument("--out-dir", default="/dev/shm", help="where --out lives (default /dev/shm)")
    ap.add_argument("--store-dir", default=None, help="where the store lives (default: the system temp dir)")
    ap.add_argument("--compare", type=Path, help="another xcluster checkout to run the same workload with")
    ap.add_argument("--skip-one-slot", action="store_true")
    args = ap.parse_args()
    rows = run("2 slots", REPO, args, [])
    if not args.skip_one_slot:
        rows += run("1 slot", REPO, args, ["--slots", "1"])
    if args.compare:
        rows += run(f"{args.compare.name}", args.compare, args, [])
    print(f"\nmodel {args.gib:g} GiB bf16, deltas change {args.changed:.1%} of the elements; peak and rss in units of "
          "the model; written per version in units of the model")
    print(f"{'design':<14}{'v':>3}  {'kind':<30}{'peak':>7}{'rss':>7}{'written':>9}  {'how':<12}{'install s':>10}")
    for r in rows:
        print(f"{r['design']:<14}{r['version']:>3}  {r['kind']:<30}{r['peak']:>6.2f}x{r['rss']:>6.2f}x"
              f"{r['written']:>8.3f}x  {r['how']:<12}{r['install']:>10.2f}")
    for design in dict.fromkeys(r["design"] for r in rows):
        mine = [r for r in rows if r["design"] == design]
        key = [r["install"] for r in mine if r["kind"] == "keyframe" and r["version"] > 1]
        delta = [r["install"] for r in mine if r["kind"] == "delta"]
        if key and delta:
            print(f"{design}: delta install / keyframe install = {sum(delta) / len(delta) / key[0]:.2f} "
                  f"(steady deltas), peak footprint {max(r['peak'] for r in mine):.2f}x")


if __name__ == "__main__":
    main()
