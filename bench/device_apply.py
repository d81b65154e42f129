"""Receive-side benchmark on the device: what a rollout node's GPU spends to take a delta.

A published delta (the default codec, a real ``Publisher`` into a memory store) is applied the way
an engine updated in place takes it (docs/DAEMON.md, "In-place engine updates"):

1. ``host decode``: the subscriber fetches, checks and decodes the delta on the host, patching
   the host copy (``Subscriber.sync`` with ``record_changes``: the changed positions come out);
2. ``to device``: the changed elements' positions (int32) and values cross to the device;
3. ``scatter``: ``param.view(-1)[positions] = values`` on the device, per tensor;
4. ``hash``: the device-side check (``vllm_worker.region_digest`` of every tensor, as the
   extension does it: the parameter copied to the host and hashed there).

Each is reported as GB/s of model bytes (model size / seconds), best of ``--repeat``. The weights
on the device are then compared bit for bit with the trainer's. Without a GPU it runs on the CPU
(the same code; the "device" is host memory), so the script is checked here and measures there.

    .venv/bin/python bench/device_apply.py                  # 1 GiB of bf16, 0.1% / 1% / 3% changed
    .venv/bin/python bench/device_apply.py --mib 8192 --device cuda

What a full decode on the device would take (``full-exp`` keyframes, ``sparse-exp2`` deltas) is
in docs/SCALE.md, "Decoding on the device".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scan import make_model, step, sync  # noqa: E402
from xcluster import Publisher, PublisherConfig, Subscriber  # noqa: E402
from xcluster.codec.dtypes import flat_bits  # noqa: E402
from xcluster.follow.vllm_worker import as_2d, region_digest  # noqa: E402
from xcluster.store import open_store  # noqa: E402

DENSITIES = (0.001, 0.01, 0.03)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="model size in MiB of bf16 (default 1024)")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    base = make_model(args.mib, torch.device("cpu"))
    gb = sum(t.numel() * t.element_size() for t in base.values()) / 1e9
    print(f"{gb:.2f} GB of bf16, engine weights on {name}, best of {args.repeat}")
    print("| changed | host decode | to device | scatter | hash (whole model) |")
    print("|---|---|---|---|---|")
    for density in DENSITIES:
        new = step(base, density)
        best = {k: float("inf") for k in ("decode", "h2d", "scatter", "hash")}
        for _ in range(args.repeat):
            store = open_store("memory://device-apply")
            pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
            pub.publish(base)
            sub = Subscriber(store=store)
            sub.sync()
            engine = {n: t.to(device) for n, t in base.items()}
            pub.publish(new)
            sub.record_changes = True
            got = []
            sub.on_apply = got.append
            t0 = time.perf_counter()
            sub.sync()
            t1 = time.perf_counter()
            held = sub.state_dict(copy=False)
            moved = {}
            for n, pos in got[-1].changes.items():
                idx = torch.from_numpy(pos).to(torch.int32)
                moved[n] = (idx, held[n].reshape(-1)[idx.long()])
            sync(device)
            t2 = time.perf_counter()
            on_dev = {n: (i.to(device, non_blocking=True), v.to(device, non_blocking=True)) for n, (i, v) in moved.items()}
            sync(device)
            t3 = time.perf_counter()
            for n, (i, v) in on_dev.items():
                engine[n].view(-1)[i.long()] = v
            sync(device)
            t4 = time.perf_counter()
            for t in engine.values():
                region_digest(as_2d(t), (0, as_2d(t).shape[0]), (0, as_2d(t).shape[1]))
            t5 = time.perf_counter()
            assert all(torch.equal(flat_bits(engine[n].cpu()), flat_bits(new[n])) for n in new), "not bit-exact"
            for k, s in (("decode", t1 - t0), ("h2d", t3 - t2), ("scatter", t4 - t3), ("hash", t5 - t4)):
                best[k] = min(best[k], s)
        print(f"| {density:.1%} | " + " | ".join(f"{gb / best[k]:,.1f} GB/s" for k in ("decode", "h2d", "scatter", "hash"))
              + " |")


if __name__ == "__main__":
    main()
