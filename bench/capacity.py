"""Capacity model: project a 1T-parameter RL run across regions from figures measured here.

First it measures, in one run, on this machine (bench/codec.py's workload, ±1 ulp at fixed
densities, bf16 and fp8): bits per changed element, keyframe bits per element, encode and apply
speed of model bytes per second. Then it projects a model of ``--params`` parameters (bf16 and
fp8) at 0.3–3% density: bytes per step (with a keyframe every ``--keyframe-every``), WAN egress
per step and per day with and without one relay per region, staleness, publisher scan time per
rank, and memory per node; side by side with full checkpoints and the anchors' published figures.

    .venv/bin/python bench/capacity.py                      # measure (~1 min) and project
    .venv/bin/python bench/capacity.py --measure-scale 0.5  # a bigger sample
    .venv/bin/python bench/capacity.py --ranks 64 128 512 --step-s 300 --wan-gbps 10

Every assumption is a flag; the printed table says which figures are measured and which assumed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from codec import at_density, make_master, measure  # noqa: E402  (bench/codec.py)

GiB = 1 << 30


def measure_figures(scale: float, densities: list[float]) -> dict:
    """bits/changed per (dtype, density), keyframe bits/element, encode/apply MB/s (bf16, 1%)."""
    master = make_master(scale)
    out: dict = {"delta": {}, "keyframe": {}}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        base = {n: t.to(dtype) for n, t in master.items()}
        for d in densities:
            m = measure(base, at_density(base, d), repeat=1)
            out["delta"][(name, d)] = 8 * m["bytes"] / max(m["changed"], 1)
            if name == "bf16" and abs(d - 0.01) < 1e-9:
                out["encode_mbps"], out["apply_mbps"] = m["encode_mbps"], m["apply_mbps"]
        from xcluster.codec.encode import CodecConfig, encode_version
        from xcluster.codec.digest import tensor_digest

        sizes = []
        encode_version(base, {n: tensor_digest(t) for n, t in base.items()}, None, CodecConfig(),
                       lambda e, data: sizes.append(len(data)))
        elems = sum(t.numel() for t in base.values())
        out["keyframe"][name] = 8 * sum(sizes) / elems
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1e12, help="parameters of the projected model")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.003, 0.01, 0.03])
    ap.add_argument("--keyframe-every", type=int, default=32)
    ap.add_argument("--regions", type=int, default=3, help="regions with rollout fleets (the trainer in one)")
    ap.add_argument("--nodes", type=int, default=64, help="rollout nodes per region")
    ap.add_argument("--step-s", type=float, default=300.0, help="seconds per RL step (assumed)")
    ap.add_argument("--egress-usd-per-gb", type=float, default=0.02, help="inter-region egress price (assumed)")
    ap.add_argument("--wan-gbps", type=float, default=10.0, help="WAN bandwidth a relay gets (assumed)")
    ap.add_argument("--lan-gbps", type=float, default=25.0, help="a node's bandwidth to its cluster store")
    ap.add_argument("--node-cores", type=int, default=32, help="cores a rollout node gives the subscriber")
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--rank-cores", type=int, default=4, help="CPU cores per rank for the scan (no GPU path)")
    ap.add_argument("--measure-scale", type=float, default=0.25, help="sample size for the measured figures")
    ap.add_argument("--cores-here", type=int, default=2, help="cores this machine's speeds were measured on")
    ap.add_argument("--memory-factor", type=float, default=2.7,
                    help="subscriber peak RSS / model at a keyframe (measured 2.7 on 1 GiB, issue 10)")
    args = ap.parse_args()

    fig = measure_figures(args.measure_scale, args.densities)
    print(f"measured here (sample {args.measure_scale} × 64M params, {args.cores_here} cores):")
    print(f"  keyframe bits/element: bf16 {fig['keyframe']['bf16']:.2f}, fp8 {fig['keyframe']['fp8']:.2f}")
    for (name, d), bits in sorted(fig["delta"].items()):
        print(f"  delta {name} at {d:.1%}: {bits:.2f} bits per changed element")
    print(f"  encode {fig['encode_mbps']:.0f} MB/s, apply {fig['apply_mbps']:.0f} MB/s of bf16 model bytes at 1%")
    print()

    n = args.params
    day_steps = 86400 / args.step_s
    remote = args.regions - 1
    print(f"projection: {n:.0e} parameters, keyframe every {args.keyframe_every}, {args.regions} regions × "
          f"{args.nodes} nodes, {args.step_s:.0f} s/step, WAN {args.wan_gbps:g} Gb/s per relay, egress "
          f"${args.egress_usd_per_gb}/GB (assumed)")
    hdr = (f"{'dtype':<5} {'density':>7} {'full ckpt':>10} {'delta':>10} {'avg/step':>10} {'WAN/step relay':>15} "
           f"{'WAN/step no relay':>18} {'WAN/day relay':>14} {'$/day relay':>12} {'$/day no relay':>15} "
           f"{'staleness s':>11}")
    print(hdr)
    print("-" * len(hdr))
    for name, width in (("bf16", 2), ("fp8", 1)):
        full = n * width
        key = n * fig["keyframe"][name] / 8
        for d in args.densities:
            delta = n * d * fig["delta"][(name, d)] / 8
            avg = (key + (args.keyframe_every - 1) * delta) / args.keyframe_every
            wan_relay = remote * avg
            wan_direct = remote * args.nodes * avg
            per_day = wan_relay * day_steps
            cost = per_day / 1e9 * args.egress_usd_per_gb
            cost_direct = wan_direct * day_steps / 1e9 * args.egress_usd_per_gb
            apply_s = full / (fig["apply_mbps"] * 1e6 * args.node_cores / args.cores_here)
            stale = 1.0 + delta * 8 / (args.wan_gbps * 1e9) + delta * 8 / (args.lan_gbps * 1e9) + apply_s
            print(f"{name:<5} {d:>7.1%} {fmt_bytes(full):>10} {fmt_bytes(delta):>10} {fmt_bytes(avg):>10} "
                  f"{fmt_bytes(wan_relay):>15} {fmt_bytes(wan_direct):>18} {fmt_bytes(per_day):>14} "
                  f"{cost:>12,.0f} {cost_direct:>15,.0f} {stale:>11.1f}")
    print()
    print("publisher: scan + encode time per rank per step (CPU path, scaled from the measured encode speed)")
    print(f"{'ranks':>6} {'bf16 bytes/rank':>16} {'s/step bf16':>12} {'s/step fp8':>11}")
    for r in args.ranks:
        per = n * 2 / r
        secs = per / (fig["encode_mbps"] * 1e6 * args.rank_cores / args.cores_here)
        print(f"{r:>6} {fmt_bytes(per):>16} {secs:>12.2f} {secs / 2:>11.2f}")
    print()
    print(f"memory per rollout node (subscriber peak at a keyframe, {args.memory_factor}× model, measured factor): "
          f"bf16 {fmt_bytes(n * 2 * args.memory_factor)}, fp8 {fmt_bytes(n * args.memory_factor)}")
    print("anchors (published): Fireworks 1T fp8 — 1 TiB full, ~20 GiB average delta; checkpoint-engine — 1T in "
          "~20 s inside one cluster (RDMA, no compression, no checksums)")


if __name__ == "__main__":
    main()
