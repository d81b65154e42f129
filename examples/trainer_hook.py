"""A trainer publishing its weights after every optimizer step.

    python examples/trainer_hook.py --store /tmp/xc-store --steps 12 --checkpoint-every 5

The hook is three lines: build a Publisher once, call ``publish`` after ``optimizer.step()``
with the weights rollout needs (bf16 here), read the result for logging.
"""

from __future__ import annotations

import argparse
import json

import torch

from xcluster import Publisher, PublisherConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True, help="path or URL (s3://bucket/prefix, …)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-5)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    pub = Publisher(args.store, config=PublisherConfig(checkpoint_every=args.checkpoint_every))
    for step in range(args.steps):
        x = torch.randn(64, 256)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        weights = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        res = pub.publish(weights, step=step)  # returns once the version is committed
        print(json.dumps({"version": res.version, "kind": res.kind, "digest": res.model_digest,
                          "bytes": res.bytes_written, "changed": res.changed_elements}), flush=True)


if __name__ == "__main__":
    main()
