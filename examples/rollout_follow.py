"""A rollout node following the trainer: poll, apply, hand verified weights to the engine.

    python examples/rollout_follow.py --store /tmp/xc-store --until-version 12

``load_weights`` stands in for the inference engine's hot-reload call (vLLM/SGLang); it only
ever sees weights whose every digest matched the trainer's.
"""

from __future__ import annotations

import argparse
import json
import time

from xcluster import Subscriber
from xcluster.errors import XclusterError


def load_weights(state_dict, version: int) -> None:  # the engine's hot-reload would go here
    pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--until-version", type=int, required=True)
    ap.add_argument("--poll", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()

    sub = Subscriber(args.store)
    deadline = time.monotonic() + args.timeout
    while (sub.version or 0) < args.until_version:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out at version {sub.version}")
        before = sub.version
        try:
            sub.sync()
        except XclusterError as exc:  # keeps serving the last good weights; tries again next poll
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        if sub.version != before:
            load_weights(sub.state_dict(copy=False), sub.version)
            print(json.dumps({"version": sub.version, "kind": sub.manifest.kind, "digest": sub.model_digest}),
                  flush=True)
        time.sleep(args.poll)


if __name__ == "__main__":
    main()
