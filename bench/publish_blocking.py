"""How long ``publish()`` holds up the training loop: synchronous vs background, side by side.

    .venv/bin/python bench/publish_blocking.py [--big-gib 1.0] [--steps 6]

Two models, each published to a fresh local-directory store: the demo's Llama (~14M parameters,
bf16) and a synthetic bf16 model of ``--big-gib`` GiB. Between publishes a "training step" of
``--step-ms`` milliseconds flips ~1% of the elements by one ulp (an RL step under Adam). Rows:
trainer-blocked ms per step (median, p95), total wall time, commit latency (submit → committed,
background), versions committed and coalesced. On a CPU-only host "device" and "pinned"
snapshots are the same plain copy, so only "device" is measured; on a GPU host pinned memory
would move the copy off the device.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from xcluster import BackgroundPublisher, Publisher, PublisherConfig


def demo_model() -> dict[str, torch.Tensor]:
    from xcluster.demo.hfmodel import PRESETS, build_model

    model, _ = build_model(PRESETS["demo"], seed=0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def big_model(gib: float) -> dict[str, torch.Tensor]:
    n = int(gib * (1 << 30) / 2)
    per = 64 << 20  # 64 Mi elements (128 MiB) per tensor
    g = torch.Generator().manual_seed(0)
    out, i = {}, 0
    while n > 0:
        k = min(per, n)
        out[f"layers.{i}.weight"] = (torch.randn(k, generator=g) * 0.02).to(torch.bfloat16)
        n -= k
        i += 1
    return out


def rl_step(state: dict[str, torch.Tensor], g: torch.Generator, step_ms: float) -> None:
    t0 = time.perf_counter()
    for t in state.values():
        bits = t.view(torch.int16).view(-1)
        idx = torch.randint(0, bits.numel(), (max(1, bits.numel() // 100),), generator=g)
        bits[idx] += 1
    rest = step_ms / 1000 - (time.perf_counter() - t0)
    if rest > 0:
        time.sleep(rest)  # the rest of the training step (forward/backward) the trainer would spend


def run(name: str, state: dict[str, torch.Tensor], *, background: bool, steps: int, step_ms: float) -> dict:
    state = {k: v.clone() for k, v in state.items()}
    g = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as d:
        pub = (BackgroundPublisher if background else Publisher)(d, config=PublisherConfig(keyframe_every=1000))
        blocked, tickets = [], []
        t_all = time.perf_counter()
        for s in range(steps):
            rl_step(state, g, step_ms)
            t0 = time.perf_counter()
            r = pub.publish(state, step=s)
            blocked.append(time.perf_counter() - t0)
            tickets.append((t0, r))
        pub.flush()
        wall = time.perf_counter() - t_all
        committed = pub.version
        coalesced = pub.stats().coalesced if background else 0
        lat = [r.publish_seconds for _, r in tickets] if not background else \
            [t.result().committed_unix - (time.time() - (time.perf_counter() - t0))
             for t0, t in tickets if not t.superseded]
        pub.close()
    blocked_ms = sorted(1000 * b for b in blocked[1:])  # the first publish is a keyframe either way
    return {"model": name, "mode": "background" if background else "sync",
            "blocked_med": statistics.median(blocked_ms), "blocked_p95": blocked_ms[min(len(blocked_ms) - 1, -(-95 * len(blocked_ms) // 100) - 1)],
            "wall": wall, "lat_med": 1000 * statistics.median(lat), "committed": committed, "coalesced": coalesced}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big-gib", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--step-ms", type=float, default=500.0, help="training time per step besides publish")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, state in (("demo Llama 14M (28 MB bf16)", demo_model()),
                        (f"synthetic {args.big_gib:g} GiB bf16", big_model(args.big_gib))):
        for background in (False, True):
            rows.append(run(name, state, background=background, steps=args.steps, step_ms=args.step_ms))
    print(f"| model | publish | trainer blocked ms/step (median) | p95 | wall s ({args.steps} steps of "
          f"{args.step_ms:g} ms) | submit→committed ms (median) | committed | coalesced |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['blocked_med']:.1f} | {r['blocked_p95']:.1f} | {r['wall']:.1f} | "
              f"{r['lat_med']:.0f} | {r['committed']} | {r['coalesced']} |")


if __name__ == "__main__":
    main()
