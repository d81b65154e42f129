"""What a follower and a relay download over a long run, ÷ the ideal (issue 28 §2).

    .venv/bin/python bench/follow_bytes.py                     # 100 versions, 4M-element bf16 model
    .venv/bin/python bench/follow_bytes.py --versions 100 --elements 8000000 --density 0.01

One run, side by side, same weights, every byte counted (HEAD polls, manifests, chunks, files):

* **default**: ``PublisherConfig()``: versions are deltas, checkpoints are side objects.
* **default + local writer**: the same, and a subscriber in the cluster writes a checkpoint into
  the cluster-local store every 32 versions (``xcluster subscribe --write-checkpoints 32``).
* **keyframes every 32** (the 0.x behaviour): ``PublisherConfig(keyframe_every=32,
  checkpoint_every=None)``: every 32nd version is a full one, which every follower downloads.

For each: a follower syncing every version straight from the store; a relay copying into a
cluster-local store, with a follower behind it; then a late joiner in that cluster. The ideal is
the bytes of the first version plus those of each delta (chunks, manifest, HEAD), as the
publisher wrote them, checkpoints excluded. Target: follower and relay ≤ 1.10 × ideal.

The model: ``--elements`` bf16 Gaussian weights; each step moves ``--density`` of them by one
unit in the last place (the sparse, tiny updates of RL fine-tuning under Adam).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from xcluster import Publisher, PublisherConfig, Subscriber  # noqa: E402
from xcluster.fleet.relay import Relay, RelayConfig  # noqa: E402
from xcluster.store import LocalStore  # noqa: E402


class Counted:
    """A store that counts the bytes every read returns (what crosses the link to it)."""

    def __init__(self, inner):
        self.inner, self.url, self.read = inner, inner.url, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key, **kw):
        blob = self.inner.get(key, **kw)
        self.read += len(blob.data) if blob is not None else 0
        return blob

    def get_range(self, key, start, length):
        data = self.inner.get_range(key, start, length)
        self.read += len(data)
        return data


def run(config: PublisherConfig, *, versions: int, elements: int, density: float, root: Path,
        local_checkpoints: int | None = None) -> dict:
    src, dst = LocalStore(root / "src"), LocalStore(root / "dst")
    pub = Publisher(store=src, config=config)
    follower_view, relay_view = Counted(src), Counted(src)
    follower = Subscriber(store=follower_view)
    relay = Relay(src_store=relay_view, dst_store=dst, config=RelayConfig(once=True, lease_every_s=0))
    local = Subscriber(store=dst)
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(elements, generator=gen) * 0.02).to(torch.bfloat16)
    bits = w.view(torch.int16)
    changed = max(1, int(elements * density))
    ideal = checkpoints = full_versions = 0
    for v in range(versions):
        if v:
            idx = torch.randint(0, elements, (changed,), generator=gen)
            bits[idx] += torch.where(torch.rand(changed, generator=gen) < 0.5, 1, -1).to(torch.int16)
        r = pub.publish({"w": w.view(1000, -1) if elements % 1000 == 0 else w})
        ideal += r.bytes_written if r.kind == "delta" or v == 0 else 0
        full_versions += r.kind == "keyframe"
        checkpoints += r.checkpoint_bytes > 0
        follower.sync()
        relay.step()
        local.sync()
        if local_checkpoints is not None:  # what `xcluster subscribe --write-checkpoints N` does in the cluster
            from xcluster.read.checkpoint import newest_checkpoint_version
            if local.version - (newest_checkpoint_version(dst) or 0) >= local_checkpoints:
                local.write_checkpoint()
    assert follower.model_digest == local.model_digest == r.model_digest
    joiner_view = Counted(dst)
    joiner = Subscriber(store=joiner_view)
    joiner.sync()
    assert joiner.model_digest == r.model_digest
    return {"ideal": ideal, "follower": follower_view.read, "relay": relay_view.read, "joiner": joiner_view.read,
            "full_versions": full_versions, "checkpoints": checkpoints, "model": r.model_bytes,
            "relay_checkpoints": relay.stats.checkpoints_copied}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=100)
    ap.add_argument("--elements", type=int, default=4_000_000)
    ap.add_argument("--density", type=float, default=0.01)
    args = ap.parse_args()
    rows = []
    for label, cfg, local in (("default (checkpoints)", PublisherConfig(), None),
                              ("default + local writer 32", PublisherConfig(), 32),
                              ("keyframes every 32 (0.x)", PublisherConfig(keyframe_every=32, checkpoint_every=None),
                               None)):
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
            rows.append((label, run(cfg, versions=args.versions, elements=args.elements, density=args.density,
                                    root=Path(d), local_checkpoints=local)))
    ideal = rows[0][1]["ideal"]  # the same weights: the first version plus the deltas, as the default wrote them
    print(f"{args.versions} versions of a {rows[0][1]['model'] / 2**20:.1f} MiB bf16 model, {args.density:.1%} of "
          f"the elements changed per step; ideal (first version + deltas) = {ideal / 2**20:.2f} MiB")
    print()
    print(f"{'publisher config':<26} {'full versions':>13} {'checkpoints':>11} {'follower ÷ ideal':>16} "
          f"{'relay ÷ ideal':>13} {'relay ckpts':>11} {'late joiner MiB':>15}")
    print("-" * 112)
    for label, r in rows:
        print(f"{label:<26} {r['full_versions']:>13} {r['checkpoints']:>11} {r['follower'] / ideal:>16.3f} "
              f"{r['relay'] / ideal:>13.3f} {r['relay_checkpoints']:>11} {r['joiner'] / 2**20:>15.2f}")
    ok = rows[0][1]["follower"] / ideal <= 1.10 and rows[0][1]["relay"] / ideal <= 1.10
    print()
    print(f"target follower and relay ≤ 1.10 × ideal with the defaults: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
