"""Sharded publishing: publish time and bytes per rank for 1, 2 and 4 ranks.

    .venv/bin/python bench/sharded.py [--mib 256] [--deltas 3] [--ranks 1 2 4]

A synthetic bf16 model of ``--mib`` MiB (eight 2-D tensors) is split in dim-0 slices across
the ranks (gloo process group on 127.0.0.1, one process per rank, a local-directory store).
Each rank publishes only its slices with :class:`xcluster.write.sharded.ShardedPublisher`: one
keyframe, then ``--deltas`` deltas in which ~1% of the elements move by one ulp (an RL step).
Rows: per version kind, the slowest rank's ``publish()`` wall time (median over the deltas),
and the chunk bytes each rank uploaded (rank 0 adds the manifest and HEAD). Every rank encodes
with one thread (``CodecConfig(workers=1)``), so N ranks use up to N cores: on a host with
fewer cores than ranks the ranks share them and the figures show that, not the scaling a
cluster of one GPU host per rank would see.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

TENSORS = 8
COLS = 4096


def full_model(mib: float) -> dict[str, torch.Tensor]:
    rows = max(1, int(mib * (1 << 20) / 2 / COLS / TENSORS))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": (torch.randn(rows, COLS, generator=g) * 0.02).to(torch.bfloat16)
            for i in range(TENSORS)}


def rl_step(state: dict[str, torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for t in state.values():
        bits = t.view(torch.int16).view(-1)
        idx = torch.randint(0, bits.numel(), (max(1, bits.numel() // 100),), generator=g)
        bits[idx] += 1


def _rank(rank: int, world: int, root: str, port: int, mib: float, deltas: int) -> None:
    import torch.distributed as dist

    from xcluster import CodecConfig, PublisherConfig
    from xcluster.write.sharded import ShardedConfig, ShardedPublisher, Slice

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    state = full_model(mib)  # every rank builds the same model and keeps only its rows

    def shard() -> dict:
        out = {}
        for name, t in state.items():
            a, b = t.shape[0] * rank // world, t.shape[0] * (rank + 1) // world
            out[name] = Slice(t[a:b].clone(), offset=a, global_shape=tuple(t.shape))
        return out

    pub = ShardedPublisher(str(Path(root) / "store"), sharded=ShardedConfig(timeout_s=600),
                           config=PublisherConfig(keyframe_every=1000, checkpoint_chain_fraction=None,
                                                  codec=CodecConfig(workers=1)))
    rows = []
    for step in range(deltas + 1):
        if step:
            rl_step(state, step)
        part = shard()
        dist.barrier()
        r = pub.publish(part, step=step)
        rows.append({"kind": r.kind, "seconds": r.publish_seconds, "rank_bytes": r.rank_bytes,
                     "bytes_written": r.bytes_written, "model_bytes": r.model_bytes})
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def run(world: int, mib: float, deltas: int, port: int) -> list[list[dict]]:
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, world, d, port, mib, deltas)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        return [json.loads((Path(d) / f"rank{r}.json").read_text()) for r in range(world)]


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256.0)
    ap.add_argument("--deltas", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    print(f"host: {os.cpu_count()} cores; model {args.mib:g} MiB bf16, {TENSORS} tensors; "
          f"{args.deltas} deltas of ~1% changed by 1 ulp")
    print("| ranks | kind | publish s (slowest rank, median) | per-rank s | per-rank chunk MB | total MB written |")
    print("|---|---|---|---|---|---|")
    for i, world in enumerate(args.ranks):
        logs = run(world, args.mib, args.deltas, 29500 + os.getpid() % 1000 + i)
        for kind, idx in (("keyframe", [0]), ("delta", list(range(1, args.deltas + 1)))):
            if not idx:
                continue
            slowest = statistics.median(max(lg[j]["seconds"] for lg in logs) for j in idx)
            per_s = " / ".join(f"{statistics.median(lg[j]['seconds'] for j in idx):.2f}" for lg in logs)
            per_b = " / ".join(_mb(statistics.median(lg[j]["rank_bytes"] for j in idx)) for lg in logs)
            total = statistics.median(logs[0][j]["bytes_written"] for j in idx)
            print(f"| {world} | {kind} | {slowest:.2f} | {per_s} | {per_b} | {_mb(total)} |")
        time.sleep(0.5)


if __name__ == "__main__":
    main()
