"""Digests of weights: what the subscriber proves after every apply.

* tensor digest: xxh3-128 of the tensor's raw bytes, C order, little-endian, as 32 hex digits.
* model digest: xxh3-128 over, for each tensor sorted by name, the UTF-8 line
  ``name \\0 dtype \\0 shape-as-comma-joined-ints \\0 tensor-digest \\n``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import xxhash

from .dtypes import dtype_name, np_bytes


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return xxhash.xxh3_128_hexdigest(np_bytes(t.contiguous()))


def model_digest_from(entries: Iterable[tuple[str, str, tuple[int, ...] | list[int], str]]) -> str:
    """Model digest from ``(name, dtype name, shape, tensor digest)`` entries (any order)."""
    h = xxhash.xxh3_128()
    for name, dtype, shape, digest in sorted(entries, key=lambda e: e[0]):
        h.update(f"{name}\0{dtype}\0{','.join(str(int(s)) for s in shape)}\0{digest}\n".encode())
    return h.hexdigest()


def model_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    return model_digest_from(
        (name, dtype_name(t.dtype), tuple(t.shape), tensor_digest(t)) for name, t in state_dict.items())
