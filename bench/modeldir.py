"""Model-directory benchmark: write (fsync'd), verify-and-reuse, and load speed of ModelDir.

Workload: a transformer-shaped bf16 state (the same shapes as bench/codec.py) written as one
version directory with Hugging Face sharding, then written again (an existing version is verified
bit for bit and reused), then read back (every byte touched; the page cache is warm, so this
is the in-memory cost, not the disk's). Each row is the best of ``--repeat`` runs.

    .venv/bin/python bench/modeldir.py                 # ~128 MiB of bf16 weights
    .venv/bin/python bench/modeldir.py --scale 4 --dir /mnt/nvme/xc-bench
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from xcluster.follow.modeldir import ModelDir, ModelDirConfig


def make_state(scale: float, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = 1024
    layers = max(1, round(4 * scale))
    vocab = max(1024, int(16384 * scale))
    sd = {"embed.weight": torch.randn(vocab, d, generator=g)}
    for i in range(layers):
        p = f"layers.{i}."
        for n in ("q", "k", "v", "o"):
            sd[p + f"attn.{n}.weight"] = torch.randn(d, d, generator=g)
        sd[p + "mlp.up.weight"] = torch.randn(4 * d, d, generator=g)
        sd[p + "mlp.down.weight"] = torch.randn(d, 4 * d, generator=g)
        sd[p + "norm.weight"] = torch.ones(d)
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    state = make_state(args.scale)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    files = {"config.json": b"{}"}
    base = Path(tempfile.mkdtemp(dir=args.dir, prefix="xc-modeldir-bench-"))
    print(f"state: {len(state)} tensors, {nbytes / 2**20:.0f} MiB bf16, under {base}")
    print(f"{'shard size':>12} {'shards':>7} {'operation':>16} {'seconds':>8} {'MiB/s':>8}")
    try:
        for shard_bytes in (5 * 10**9, 64 * 2**20):
            md = ModelDir(base / str(shard_bytes), config=ModelDirConfig(shard_bytes=shard_bytes))
            version = iter(range(10**6))

            def fresh() -> None:
                md.write_version(next(version), state, files)

            rows = [("write (fsync)", best(fresh, args.repeat))]
            shards = len(list(md.path(0).glob("*.safetensors")))
            rows.append(("verify + reuse", best(lambda: md.write_version(0, state, files), args.repeat)))
            # safetensors maps the files lazily: clone so every byte is really read
            rows.append(("load + read", best(lambda: [t.clone() for t in md.load(0)[0].values()], args.repeat)))
            for op, seconds in rows:
                label = f"{shard_bytes / 2**20:.0f} MiB"
                print(f"{label:>12} {shards:>7} {op:>16} {seconds:>8.3f} {nbytes / 2**20 / seconds:>8.0f}")
    finally:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
