"""Select benchmark: the decoder's pass that finds changed elements by their ranks inside exponent
groups (FORMAT.md §5a), the plain loop vs 64-element masks (codec/expselect.py), side by side.

    .venv/bin/python bench/rank_select.py                 # real weights if installed, else synthetic
    .venv/bin/python bench/rank_select.py --model synthetic --repeat 15

For each tensor of a bf16 model, a share of its elements is chosen at random; their groups and
ranks are what a ``sparse-exp2`` segment carries, and each select is checked to return exactly
those elements. The time is the best of ``--repeat`` passes over the whole model, one thread.
The decoder uses the masks up to one change in ``exprank.DENSE_RANGE`` elements (4%) and the plain
loop above; both columns are shown at every density.
Models: ``real`` (all-MiniLM-L6-v2, 45 MB: bench/realweights.py, ``pip install -e '.[bench]'``) and
``synthetic`` (transformer-shaped Gaussian weights, ``bench/codec.py``'s ``make_master(0.5)``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xcluster.codec.kernels import exprank  # noqa: E402
from xcluster.codec.encodings.sparse_exp2 import group_ranks  # noqa: E402
from xcluster.codec.dtypes import np_bits  # noqa: E402

DENSITIES = (0.001, 0.01, 0.03, 0.05, 0.1)
SHIFT, MASK = np.uint16(7), np.uint16(0xFF)  # bf16's exponent field


def model(name: str) -> dict[str, torch.Tensor]:
    if name == "real":
        try:
            from realweights import load_master
            return {n: t.to(torch.bfloat16) for n, t in load_master().items()}
        except RuntimeError as exc:
            print(f"({exc}; synthetic weights instead)\n")
    from codec import make_master
    return {n: t.to(torch.bfloat16) for n, t in make_master(0.5).items()}


def queries(weights: dict[str, torch.Tensor], density: float, rng: np.random.Generator) -> list[tuple]:
    """Per tensor: select's arguments and the positions it must return."""
    out = []
    for t in weights.values():
        bits = np_bits(t.contiguous()).reshape(-1)
        pos = np.sort(rng.choice(bits.size, max(1, int(bits.size * density)), replace=False)).astype(np.int64)
        _, ranks, _, counts = group_ranks(bits, pos, "bfloat16")  # as the writer groups them
        present = np.flatnonzero(counts)
        starts = np.concatenate([[0], np.cumsum(counts[present])]).astype(np.int64)
        out.append(((bits, present, starts, ranks, SHIFT, MASK, 256), pos))
    return out


def best(fn, qs, repeat: int) -> float:
    for args, pos in qs:  # loads the loop, and checks it
        got, _, ok = fn(*args)
        if not ok or not np.array_equal(got, pos):
            raise SystemExit("select returned other elements than were chosen")
    t = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for args, _ in qs:
            fn(*args)
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("real", "synthetic"), default="real")
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    k = exprank.kernels()
    if k is None or k.select is k.plain_select:
        raise SystemExit("the mask select is not in use here (numba missing, turned off or failing)")
    weights = model(args.model)
    n = sum(t.numel() for t in weights.values())
    print(f"{n / 1e6:.1f}M bf16 elements in {len(weights)} tensors; best of {args.repeat}, one thread\n")
    print("| changed | plain loop ns/element | masks ns/element | plain / masks |")
    print("|---|---|---|---|")
    rng = np.random.default_rng(0)
    for d in DENSITIES:
        qs = queries(weights, d, rng)
        plain, masks = best(k.plain_select, qs, args.repeat), best(k.select, qs, args.repeat)
        print(f"| {d:.1%} | {plain / n * 1e9:.3f} | {masks / n * 1e9:.3f} | {plain / masks:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
