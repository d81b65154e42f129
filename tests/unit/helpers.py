"""Small helpers shared by unit tests."""

from __future__ import annotations

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
