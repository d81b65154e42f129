"""A plain PyTorch training loop publishing in the background: the step never waits for S3.

    python examples/plain_loop.py --store /tmp/xc-store --steps 50

``publish()`` copies the weights (cast to bf16 on the way) and returns; encode, upload and
commit run in a worker thread. A step that finds the previous version still uploading replaces
the waiting snapshot (latest wins), so a slow store costs versions, never training time.
SIGTERM (a preempted pod) exits cleanly: the version in flight gets ``close_timeout_s`` to
commit, the waiting one is dropped, and what is not committed stays invisible.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import torch

from xcluster import BackgroundConfig, BackgroundPublisher, PublisherConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True, help="path or URL (s3://bucket/prefix, …)")
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps (0 = until interrupted)")
    ap.add_argument("--width", type=int, default=512, help="MLP width (4 layers: ~4·width² parameters)")
    ap.add_argument("--snapshot", choices=["device", "pinned"], default="device")
    ap.add_argument("--checkpoint-every", type=int, default=16)
    ap.add_argument("--close-timeout", type=float, default=60.0)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwind normally: exit hooks run
    torch.set_num_threads(1)

    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.GELU(), torch.nn.Linear(4 * w, w),
                                torch.nn.LayerNorm(w))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    config = PublisherConfig(checkpoint_every=args.checkpoint_every)
    background = BackgroundConfig(snapshot=args.snapshot, close_timeout_s=args.close_timeout)

    def committed(res) -> None:  # runs in the worker thread
        print(json.dumps({"committed": res.version, "step": res.step, "kind": res.kind,
                          "digest": res.model_digest}), flush=True)

    with BackgroundPublisher(args.store, config=config, background=background, on_commit=committed) as pub:
        step = 0
        while args.steps == 0 or step < args.steps:
            x = torch.randn(32, w)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            t0 = time.perf_counter()
            pub.publish(model.state_dict(), step=step, dtype=torch.bfloat16)  # returns once snapshotted
            print(json.dumps({"step": step, "blocked_ms": round(1000 * (time.perf_counter() - t0), 2)}), flush=True)
            step += 1
        # leaving the block flushes: every step is committed (or coalesced into a later one)
    print(json.dumps({"done": pub.last_result.version, "coalesced": pub.coalesced}), flush=True)


if __name__ == "__main__":
    main()
