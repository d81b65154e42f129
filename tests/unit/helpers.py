"""Small helpers shared by unit tests."""

from __future__ import annotations

import math
import uuid

import torch

from xcluster.store import open_store


def memory_store():
    return open_store(f"memory://xc-test-{uuid.uuid4().hex}")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality, dtype and shape included (NaN payloads and -0.0 too)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == \
        bytes(b.contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_state_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert bits_equal(got[k], want[k]), k


def mkey(store, version: int) -> str:
    """The key of the committed manifest of ``version`` (named by HEAD's chain; manifests have
    per-attempt names)."""
    from xcluster.read.chain import find_link, read_head

    head, _ = read_head(store)
    return find_link(store, head, version).key


def bf16_weights(n: int, seed: int = 0, scale: float = 0.02):
    """The raw bits (uint16 numpy) of ``n`` Gaussian bf16 weights."""
    import numpy as np

    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * scale).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def manifest_bytes(store, version: int) -> bytes:
    """The canonical JSON of the committed manifest of ``version`` (stored as one zstd frame)."""
    from xcluster.format.packing import unpack

    key = mkey(store, version)
    return unpack(store.get(key).data, where=key)


def put_manifest(store, key: str, canonical: bytes) -> None:
    """Store ``canonical`` (a manifest's JSON, edited or not) at ``key`` as writers store manifests."""
    from xcluster.format.packing import pack

    store.put(key, pack(canonical))


def follow_blocks(obj, encodings_before) -> None:
    """After a test edited a manifest object by hand: its ``encodings`` follow its blocks (as a
    forger would keep them), unless the edit changed ``encodings`` itself."""
    if not isinstance(obj, dict) or obj.get("encodings") != encodings_before:
        return
    blocks = obj.get("blocks")
    if isinstance(blocks, list) and all(isinstance(b, dict) and isinstance(b.get("encoding"), str) for b in blocks):
        obj["encodings"] = sorted({b["encoding"] for b in blocks})


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def make_weights(step: int = 0, *, shapes=None, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                 dtypes=None, base: str = "randn", changed: int | float = 200, pick: str = "randperm",
                 cumulative: bool = True, bump: int | str = 1) -> dict[str, torch.Tensor]:
    """A small model at training step ``step``: the base tensors ``shapes`` (name -> shape, in
    order; default ``{"w": (64, 64)}``) with a few elements changed per step, as an optimizer step
    changes them.

    ``base``: ``"randn"`` (Gaussian, drawn in order from one generator seeded with ``seed``),
    ``"arange"`` (0, 1, 2, ... in row-major order) or ``"zeros"``; each tensor is cast to
    ``dtypes.get(name, dtype)``.

    A step adds ``bump`` to the raw bits (an ulp for floats) of ``changed`` elements of every
    tensor (a float: that fraction of its elements), picked by ``pick``: ``"randperm"`` (distinct
    elements) or ``"randint"`` (drawn with replacement: fewer when two coincide), from a generator
    seeded with the step; or ``"prefix"`` (step s takes the elements [changed*(s-1), changed*s), so
    version s has its first ``changed*s`` elements bumped). ``cumulative``: version s carries the
    changes of steps 1..s, each version close to the last; otherwise version s is the base with only
    step s's changes (drawn for step 0 too), and ``bump="step"`` adds ``s``."""
    shapes = {"w": (64, 64)} if shapes is None else shapes
    dtypes = dtypes or {}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        dt = dtypes.get(name, dtype)
        if base == "randn":
            t = torch.randn(shape, generator=gen).to(dt)
        elif base == "arange":
            t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).to(dt)
        elif base == "zeros":
            t = torch.zeros(shape, dtype=dt)
        else:
            raise ValueError(f"base {base!r}")
        bits = t.view(_BITS[t.element_size()]).view(-1)
        n = bits.numel()
        k = changed if isinstance(changed, int) else round(changed * n)
        for s in (range(1, step + 1) if cumulative else (step,)):
            bits[_picked(pick, n, k, s)] += step if bump == "step" else bump
        out[name] = t
    return out


def _picked(pick: str, n: int, k: int, s: int):
    """The elements (of ``n``) step ``s`` changes."""
    if pick == "randperm":
        return torch.randperm(n, generator=torch.Generator().manual_seed(s))[:k]
    if pick == "randint":
        return torch.randint(0, n, (k,), generator=torch.Generator().manual_seed(s))
    if pick == "prefix":
        return slice(k * (s - 1), k * s)
    raise ValueError(f"pick {pick!r}")
