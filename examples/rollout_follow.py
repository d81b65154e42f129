"""A rollout node following the trainer with the daemon, in-process: every new version becomes a
complete model directory, and ``on_update`` hands it to the engine.

    python examples/rollout_follow.py --store /tmp/xc-store --out /tmp/xc-rollout --until-version 12

The same loop runs as a process with ``xcluster subscribe URL --out DIR --engine vllm …``
(see docs/DAEMON.md); here ``load_weights`` stands in for the engine's hot-reload call. It only
ever sees directories whose every digest matched the trainer's.
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

from xcluster.follow.daemon import Daemon, DaemonConfig


def load_weights(model_dir: Path, version: int) -> None:  # the engine's hot-reload would go here
    pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True, help="where the daemon keeps model directories and its state")
    ap.add_argument("--until-version", type=int, required=True)
    ap.add_argument("--poll", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()

    daemon = Daemon(args.store, config=DaemonConfig(out=Path(args.out), poll_s=args.poll, lease_every_s=0))
    timer = threading.Timer(args.timeout, daemon.stop)  # give up after --timeout

    @daemon.on_update
    def handed_over(path: Path, version: int) -> None:
        load_weights(path, version)
        st = daemon.state
        print(json.dumps({"version": version, "kind": daemon.subscriber.manifest.kind, "digest": st.model_digest,
                          "path": str(path)}), flush=True)
        if version >= args.until_version:
            daemon.stop()

    timer.start()
    daemon.run()  # until on_update stops it (or the timer does)
    timer.cancel()
    if (daemon.subscriber.version or 0) < args.until_version:
        raise SystemExit(f"timed out at version {daemon.subscriber.version}")


if __name__ == "__main__":
    main()
