"""Scan benchmark: GB/s of model scanned, numpy scan vs torch scan, at RL-like densities.

What is timed is what a delta costs before zstd: finding the changed elements and building the
delta streams' inputs (gaps, zigzag diffs, byte planes) on the host, i.e. iterating
``codec.encode.scan_version`` over the model. The model is bf16 (transformer-shaped matrices of
``--mib`` MiB in all) on the best device present; each density moves that fraction of elements by
±1 ulp.

- ``numpy``: the tensors are copied to the host first when they live on a GPU (what the publisher
  does with ``scan="numpy"``), then scanned there; the copy is part of the time.
- ``torch``: ``scan="torch"``, the base on the same device (``base_on="device"``); only the
  changes cross.
- ``torch, base on host`` (GPU only): the base is on the host and crosses range by range
  (``base_on="host"``).

    .venv/bin/python bench/scan.py                 # on a GPU machine: cuda; else cpu
    .venv/bin/python bench/scan.py --mib 4096 --workers 4
"""

from __future__ import annotations

import argparse
import time

import torch

from xcluster.codec.encode import CodecConfig, scan_version
from xcluster.codec.dtypes import flat_bits

DENSITIES = (0.003, 0.01, 0.03)


def make_model(mib: int, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    d, out, left, i = 2048, {}, mib << 20, 0
    while left > 0:
        rows = min(4 * d, max(1, left // (2 * d)))
        out[f"layers.{i}.weight"] = (torch.randn(rows, d, generator=g, device=device) * 0.02).to(torch.bfloat16)
        left -= rows * d * 2
        i += 1
    return out


def step(base: dict[str, torch.Tensor], density: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """``base`` with about ``density`` of its elements moved by ±1 ulp."""
    out = {}
    for j, (n, t) in enumerate(base.items()):
        g = torch.Generator(device=t.device).manual_seed(seed * 1000 + j)
        new = t.clone()
        bits = flat_bits(new)
        mask = torch.rand(bits.shape, generator=g, device=t.device) < density
        sign = torch.randint(0, 2, bits.shape, generator=g, device=t.device, dtype=torch.int16) * 2 - 1
        bits += mask.to(torch.int16) * sign
        out[n] = new
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_scan(new, base, cfg: CodecConfig, device: torch.device, *, to_host: bool, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        n_in = {k: v.cpu() for k, v in new.items()} if to_host else new  # what prepare_state does
        nnz = sum(r.nnz for r in scan_version(n_in, base, cfg))
        sync(device)
        best = min(best, time.perf_counter() - t0)
    assert nnz > 0
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="model size in MiB of bf16 (default 512)")
    ap.add_argument("--workers", type=int, default=2, help="scan threads (CodecConfig.workers)")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base = make_model(args.mib, device)
    gb = sum(t.numel() * t.element_size() for t in base.values()) / 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"scan of {gb:.2f} GB of bf16 on {name}, workers={args.workers}, best of {args.repeat}")
    # (label, scan, copy new to the host first, base on the host)
    paths = [("numpy", "numpy", True, True), ("torch", "torch", False, False)]
    if device.type == "cuda":
        paths.append(("torch, base on host", "torch", False, True))
    host_base = {k: v.cpu() for k, v in base.items()} if device.type == "cuda" else base
    print("density  " + "  ".join(f"{p[0]:>20}" for p in paths) + "   (GB/s of model scanned)")
    for density in DENSITIES:
        new = step(base, density)
        row = []
        for _, scan, to_host, base_host in paths:
            cfg = CodecConfig(scan=scan, workers=args.workers)
            s = time_scan(new, host_base if base_host else base, cfg, device, to_host=to_host, repeat=args.repeat)
            row.append(gb / s)
        print(f"{density:7.1%}  " + "  ".join(f"{v:20.2f}" for v in row))
        del new


if __name__ == "__main__":
    main()
