"""Apply speed of one delta, as a subscriber syncs it: the best of many subscribers.

    .venv/bin/python bench/apply.py                     # both models, sparse-exp2 and sparse-sub
    .venv/bin/python bench/apply.py --model real --subscribers 8

``bench/codec.py``'s speed table takes the best of 3 subscribers, which on a noisy 2-core machine
moves by ±30% from run to run; this takes the best of ``--subscribers`` (each holds the model),
so two trees can be compared: run it in each (``git worktree add``) alternately.

The delta: ``bench/codec.py``'s ``at_density`` (exactly 1% of each tensor's elements moved by ±1
ulp) on bf16 weights, published to an in-memory store; each subscriber first syncs the keyframe,
then one ``sync()`` of the delta is timed (HEAD poll, manifest, chunks, decode, patch, verify).
Models: ``synthetic`` (67 MB transformer-shaped, ``make_master(0.5)``) and ``real``
(all-MiniLM-L6-v2, 45 MB, 103 tensors: bench/realweights.py, ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codec import V1, V2, at_density, make_master  # noqa: E402

from xcluster.write.publisher import Publisher, PublisherConfig  # noqa: E402
from xcluster.store import open_store  # noqa: E402
from xcluster.read.subscriber import Subscriber  # noqa: E402


def model(name: str) -> dict[str, torch.Tensor]:
    if name == "real":
        from realweights import load_master
        master = load_master()
    else:
        master = make_master(0.5)
    return {n: t.to(torch.bfloat16) for n, t in master.items()}


def best_apply(base, new, cfg, subscribers: int) -> float:
    store = open_store(f"memory://bench-apply-{uuid.uuid4().hex}")
    pub = Publisher(store=store, config=PublisherConfig(checkpoint_every=None, codec=cfg))
    pub.publish(base, step=0)
    subs = [Subscriber(store=store) for _ in range(subscribers)]
    for s in subs:
        s.sync()
    res = pub.publish(new, step=1)
    best = float("inf")
    for s in subs:
        t0 = time.perf_counter()
        s.sync()
        best = min(best, time.perf_counter() - t0)
        assert s.model_digest == res.model_digest
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("synthetic", "real", "both"), default="both")
    ap.add_argument("--subscribers", type=int, default=6)
    args = ap.parse_args()
    print(f"torch threads {torch.get_num_threads()}; best of {args.subscribers} subscribers, 1% changed\n")
    print("| model | codec | apply ms | apply MB/s of model |")
    print("|---|---|---|---|")
    for name in (("synthetic", "real") if args.model == "both" else (args.model,)):
        base = model(name)
        new = at_density(base, 0.01)
        mb = sum(t.numel() * t.element_size() for t in base.values()) / 1e6
        for codec, cfg in (("v2 (sparse-exp2)", V2), ("v1 (sparse-sub)", V1)):
            s = best_apply(base, new, cfg, args.subscribers)
            print(f"| {name} ({mb:.0f} MB) | {codec} | {s * 1e3:.1f} | {mb / s:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
