"""Digests of weights: what the subscriber proves after every apply.

* tensor digest: xxh3-128 of the tensor's raw bytes, C order, little-endian, as 32 hex digits.
* parts digest (a tensor assembled from parts, e.g. dim-0 slices held by different ranks):
  xxh3-128 of the ASCII lines ``<count> <tensor digest of that part's elements>\\n``, one per part
  in element order, where ``count`` is the part's element count in decimal. Computable by each
  holder of a part without gathering the tensor; the manifest records the counts (``parts``).
* model digest: xxh3-128 over, for each tensor sorted by name, the UTF-8 line
  ``name \\0 dtype \\0 shape-as-comma-joined-ints \\0 tensor-digest \\n`` (the parts digest for a
  tensor with parts).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import xxhash

from .dtypes import dtype_name, np_bytes


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return xxhash.xxh3_128_hexdigest(np_bytes(t.contiguous()))


def combine_part_digests(parts: Iterable[tuple[int, str]]) -> str:
    """The parts digest from ``(element count, tensor digest of the part)`` in element order."""
    h = xxhash.xxh3_128()
    for count, digest in parts:
        h.update(f"{int(count)} {digest}\n".encode("ascii"))
    return h.hexdigest()


def entry_digest(t: torch.Tensor, parts: Sequence[int] | None) -> str:
    """The digest a manifest records for ``t``: the tensor digest, or the parts digest when the
    manifest gives ``parts`` (element counts summing to ``t.numel()``)."""
    if parts is None:
        return tensor_digest(t)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = np_bytes(t.contiguous()).reshape(-1)
    w = t.element_size()
    out, pos = [], 0
    for count in parts:
        out.append((count, xxhash.xxh3_128_hexdigest(flat[pos * w:(pos + count) * w])))
        pos += count
    if pos != t.numel():
        raise ValueError(f"parts cover {pos} elements of a tensor of {t.numel()}")
    return combine_part_digests(out)


def model_digest_from(entries: Iterable[tuple[str, str, tuple[int, ...] | list[int], str]]) -> str:
    """Model digest from ``(name, dtype name, shape, tensor digest)`` entries (any order)."""
    h = xxhash.xxh3_128()
    for name, dtype, shape, digest in sorted(entries, key=lambda e: e[0]):
        h.update(f"{name}\0{dtype}\0{','.join(str(int(s)) for s in shape)}\0{digest}\n".encode())
    return h.hexdigest()


def model_digest(state_dict: Mapping[str, torch.Tensor], *,
                 parts: Mapping[str, Sequence[int]] | None = None) -> str:
    """Model digest of a whole state dict. ``parts`` (name → element counts) gives the tensors a
    sharded publisher hashed in parts (the manifest's ``parts``), so a trainer can compute the
    digest a sharded version will carry."""
    parts = parts or {}
    return model_digest_from(
        (name, dtype_name(t.dtype), tuple(t.shape), entry_digest(t, parts.get(name)))
        for name, t in state_dict.items())
