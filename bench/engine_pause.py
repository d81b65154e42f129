"""Engine pause benchmark: how long a running vLLM stops generating to take a new version —
a full ``reload_weights`` from the model directory vs xcluster's in-place update (only the changed
elements written into the loaded parameters) — and what checking the engine's weights costs.

Workload: a random Llama of about ``--params`` parameters (bf16; fused q/k/v and gate/up in
vLLM), served by the real vLLM (CPU build, tests/support/vllm_engine.py, with xcluster's worker
extension). Each round changes ``--changed`` of every tensor's elements at random (one ulp, as an
Adam step under bf16 rounding does), writes the new version's model directory, and hands it over
with :class:`~xcluster.follow.handoff.VllmHandoff` — the daemon's own code — alternately in place
and by reload, so both see the same engine in the same run. After each hand-off the engine's
workers hash their parameters and the bench checks that every region matches the version.

    .venv/bin/python bench/engine_pause.py                  # ~330M parameters, 1% changed, 3 rounds
    .venv/bin/python bench/engine_pause.py --params 120e6 --changed 0.001 --rounds 5

Columns: ``pause`` = pause sent .. resume answered (what generation waits; the median of the
rounds, min–max in brackets); ``verify`` = the workers' hashing plus the daemon's hashing of the
slot (outside the pause); ``patch`` = bytes of the patch file the engine reads (in place only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.vllm_engine import ensure_engine_venv, start_vllm  # noqa: E402
from xcluster.demo.hfmodel import PRESETS, build_tokenizer, write_model_dir  # noqa: E402
from xcluster.follow.engine_update import WeightsUpdate, write_patch  # noqa: E402
from xcluster.follow.handoff import HandoffConfig, VllmHandoff  # noqa: E402


def config_for(params: float):
    """A Llama shape of about ``params`` parameters (hidden 1024, 16 heads, MLP 4×)."""
    base = replace(PRESETS["demo"], vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                   num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=1024,
                   max_shard_bytes=512 << 20)
    per_layer = 4 * 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024
    layers = max(1, round((params - 2 * 32000 * 1024) / per_layer))
    return replace(base, num_hidden_layers=layers)


def random_weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    from xcluster.demo.hfmodel import weight_shapes

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        t = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
        out[name] = t.to(torch.bfloat16)
    return out


def step(w: dict[str, torch.Tensor], changed: float, gen: torch.Generator) -> dict[str, np.ndarray]:
    """Bump ``changed`` of each tensor's elements by one ulp in place; returns the positions."""
    pos = {}
    for name, t in w.items():
        n = t.numel()
        k = max(1, int(n * changed))
        idx = torch.randint(0, n, (k,), generator=gen).unique()
        t.view(-1).view(torch.int16)[idx] += 1
        pos[name] = idx.numpy().astype(np.int64)
    return pos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=330e6, help="model size in parameters (default 330e6)")
    ap.add_argument("--changed", type=float, default=0.01, help="fraction of elements changed per version")
    ap.add_argument("--rounds", type=int, default=3, help="hand-offs of each kind")
    ap.add_argument("--dir", help="work directory (default: a temporary one under /dev/shm)")
    args = ap.parse_args()

    ensure_engine_venv()
    cfg = config_for(args.params)
    root = Path(args.dir or tempfile.mkdtemp(prefix="xc-pause-", dir="/dev/shm"))
    tok = build_tokenizer(cfg)
    w = random_weights(cfg)
    n_params = sum(t.numel() for t in w.values())
    model_bytes = sum(t.numel() * t.element_size() for t in w.values())
    print(f"model: {n_params / 1e6:.0f}M parameters ({model_bytes / 2**20:.0f} MiB bf16), {cfg.num_hidden_layers} "
          f"layers; {args.changed:.2%} of elements changed per version; {args.rounds} round(s) each")
    cur = write_model_dir(root / "v0", w, tok, cfg)
    gen = torch.Generator().manual_seed(1)
    tensors = tuple((n, tuple(t.shape), "bfloat16") for n, t in w.items())
    rows: dict[str, list[tuple[float, float, int, float]]] = {"reload": [], "in-place": []}
    with start_vllm(cur, log_dir=root, extension=True, timeout=900) as engine:
        print(f"vLLM up in {engine.start_seconds:.0f} s")
        h = VllmHandoff(engine.url, config=HandoffConfig(timeout_s=600))
        version = 1
        for r in range(2 * args.rounds):
            method = "in-place" if r % 2 == 0 else "reload"
            pos = step(w, args.changed, gen)
            version += 1
            d = write_model_dir(root / f"v{version % 2}", w, tok, cfg)
            patch, size = None, 0
            if method == "in-place":
                patch = root / "patch.safetensors"
                size = write_patch(patch, w, pos)
            update = WeightsUpdate(weights=w, tensors=tensors, patch=patch, base_version=version - 1,
                                   patch_elements=sum(p.size for p in pos.values()))
            t0 = time.perf_counter()
            res = h.hand_over(d, version, update=update)
            total = time.perf_counter() - t0
            assert res.verified and res.method == method, (res.method, res.verified)
            rows[method].append((res.pause_seconds, total - res.pause_seconds, size, res.update_seconds))
            print(f"  version {version}: {method:<8} pause {res.pause_seconds:.3f} s (of which the update "
                  f"{res.update_seconds:.3f} s), verify {total - res.pause_seconds:.3f} s", flush=True)
    print()
    print("| engine update | changed | pause (median, min–max) | the update itself | verify (outside the pause) "
          "| patch file |")
    print("|---|---|---|---|---|---|")
    for method, rs in rows.items():
        pauses = [r[0] for r in rs]
        patch = f"{rs[0][2] / 2**20:.1f} MiB" if method == "in-place" else "-"
        print(f"| {method} | {args.changed:.2%} | {statistics.median(pauses):.3f} s ({min(pauses):.3f}–"
              f"{max(pauses):.3f}) | {statistics.median(r[3] for r in rs):.3f} s | "
              f"{statistics.median(r[1] for r in rs):.3f} s | {patch} |")
    ratio = statistics.median(r[0] for r in rows["reload"]) / statistics.median(r[0] for r in rows["in-place"])
    print(f"\nin-place pause is {1 / ratio:.3f}× the reload's ({ratio:.0f}× shorter)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
