"""Fault soak: trust nothing in the bucket, the network or the processes.

    .venv/bin/python bench/soak.py                       # ≥ 150 versions, ≥ 1,000 faults, ≥ 50 kill -9s
    .venv/bin/python bench/soak.py --versions 40 --min-faults 200 --min-kills 10 --subscribers 3

A real SeaweedFS (``weed mini`` on 127.0.0.1) behind two fault proxies (resets mid-body,
truncated and bit-flipped bodies, 503 SlowDown, 500, latency spikes); a trainer process
publishing RL-like bf16 updates (fp32 master + Adam-like steps, ~2% of elements change,
keyframe every 10); ``--subscribers`` ``xcluster subscribe`` daemons through the proxies;
``kill -9`` of the trainer and the daemons at random moments; ``xcluster gc --apply`` every few
seconds with a short grace and lease TTL, while one daemon stays offline until its chain is gone.
The referee hashes (SHA-256) every model directory a daemon exposes at ``OUT/current`` and
compares it with the truth it computes itself. See tests/support/soak.py.

Runs until every target is met (versions, faults, kills, the offline daemon back) or
``--duration``; then stops the trainer and gives the fleet ``--converge-timeout`` to reach HEAD.
Prints a table; exits 1 unless there were 0 corrupt observations, every daemon converged to the
trainer's final weights, the offline daemon came back through a keyframe, and the targets were met.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from tests.support.soak import ModelSpec, SoakConfig, add_spec_args, run_soak

    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", type=int, default=d.versions, help="publish at least this many versions")
    p.add_argument("--subscribers", type=int, default=d.subscribers)
    p.add_argument("--min-faults", type=int, default=d.min_faults)
    p.add_argument("--min-kills", type=int, default=d.min_kills)
    p.add_argument("--duration", type=float, default=d.duration_s, help="cap on the chaos phase (s)")
    p.add_argument("--converge-timeout", type=float, default=d.converge_timeout_s)
    p.add_argument("--keyframe-every", type=int, default=d.keyframe_every)
    p.add_argument("--publish-interval", type=float, default=d.publish_interval_s)
    p.add_argument("--fault-probability", type=float, default=d.fault_probability,
                   help="per request, daemons' proxy")
    p.add_argument("--publisher-fault-probability", type=float, default=d.publisher_fault_probability)
    p.add_argument("--kill-every", type=float, nargs=2, default=d.kill_every_s, metavar=("MIN", "MAX"),
                   help="seconds between kill -9s, uniform")
    p.add_argument("--publisher-kill-share", type=float, default=d.publisher_kill_share)
    p.add_argument("--no-offline", action="store_true", help="no subscriber kept offline through gc")
    p.add_argument("--gc-every", type=float, default=d.gc_every_s)
    p.add_argument("--grace", type=float, default=d.grace_s)
    p.add_argument("--lease-ttl", type=float, default=d.lease_ttl_s)
    p.add_argument("--poll", type=float, default=d.poll_s)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and directories here")
    add_spec_args(p)
    a = p.parse_args()
    cfg = SoakConfig(versions=a.versions, subscribers=a.subscribers, min_faults=a.min_faults,
                     min_kills=a.min_kills, duration_s=a.duration, converge_timeout_s=a.converge_timeout,
                     keyframe_every=a.keyframe_every, publish_interval_s=a.publish_interval,
                     fault_probability=a.fault_probability,
                     publisher_fault_probability=a.publisher_fault_probability,
                     kill_every_s=tuple(a.kill_every), publisher_kill_share=a.publisher_kill_share,
                     offline=not a.no_offline, gc_every_s=a.gc_every, grace_s=a.grace, lease_ttl_s=a.lease_ttl,
                     poll_s=a.poll, seed=a.seed, model=ModelSpec.from_args(a), workdir=a.workdir)
    report = run_soak(cfg)
    print(report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
