"""The first delta after a daemon restarts: with the codec's loops warmed up at start, and without.

    .venv/bin/python bench/first_delta.py                 # 2 runs of each, 17 MB model
    .venv/bin/python bench/first_delta.py --runs 3 --scale 0.5

Each run: a trainer (this process) publishes a keyframe to a fresh local store; ``xcluster
subscribe --once`` applies it and exits; a long-running ``xcluster subscribe`` starts on that
directory (it resumes at the keyframe, caught up); ``--wait`` seconds later the trainer publishes
one sparse-exp2 delta (1% of the elements moved by an ulp) and the daemon's own log line gives how
long applying it took. The two modes alternate, so the machine's noise hits both.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codec import at_density, make_master  # noqa: E402

from xcluster.write.publisher import Publisher, PublisherConfig  # noqa: E402
from xcluster.store import open_store  # noqa: E402

APPLIED = re.compile(r"applied version 2 \(delta, (\d+) bytes\) in ([0-9.]+)s")


def one_run(base, nxt, *, warm: bool, wait: float) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"file://{tmp}/store"
        pub = Publisher(store=open_store(url), config=PublisherConfig(checkpoint_every=None))
        pub.publish(base, step=0)
        cmd = [sys.executable, "-m", "xcluster.cli", "subscribe", url, "--out", f"{tmp}/out", "--lease-interval", "0",
               "--poll", "0.1"]
        subprocess.run([*cmd, "--once"], check=True, capture_output=True)
        daemon = subprocess.Popen([*cmd] + ([] if warm else ["--no-warm-up"]), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        try:
            time.sleep(wait)
            pub.publish(nxt, step=1)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not list(Path(tmp, "out", "versions").glob("2")):
                time.sleep(0.05)
            time.sleep(0.5)
        finally:
            daemon.terminate()
            log = daemon.communicate(timeout=60)[0]
        m = APPLIED.search(log)
        if m is None or daemon.returncode != 0:
            raise SystemExit(f"the daemon did not apply the delta (exit {daemon.returncode}):\n{log[-2000:]}")
        return float(m.group(2)), int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.25, help="model size (bench/codec.py's make_master)")
    ap.add_argument("--wait", type=float, default=6.0, help="seconds between the daemon's start and the delta")
    args = ap.parse_args()
    base = {n: t.to(torch.bfloat16) for n, t in make_master(args.scale).items()}
    nxt = at_density(base, 0.01)
    mb = sum(t.numel() * t.element_size() for t in base.values()) / 1e6
    print(f"model {mb:.0f} MB bf16, delta at 1% changed, published {args.wait:.0f} s after the daemon started\n")
    print("| run | warm-up | first delta applied in (daemon log) | delta bytes |")
    print("|---|---|---|---|")
    for i in range(args.runs):
        for warm in (True, False):
            s, size = one_run(base, nxt, warm=warm, wait=args.wait)
            print(f"| {i + 1} | {'on (default)' if warm else 'off (--no-warm-up)'} | {s:.3f} s | {size:,} |", flush=True)


if __name__ == "__main__":
    main()
