"""safetensors files as the model directory writes and checks them: shard planning, a writer
that streams from the tensors' memory, and a header check that accounts for every byte."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import ModelDirError

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own cap on a header


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(sized: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Fill shards in the given order up to ``limit`` bytes; an oversized tensor gets its own shard.
    There is always at least one shard (an empty state writes one empty file)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sized:
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
              torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def stream_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file straight from the tensors' memory (``safetensors.torch.save_file``
    first turns every tensor into a bytes copy: a whole shard more in RAM). The format: an 8-byte
    little-endian header length, the JSON header (padded with spaces to a multiple of 8), then
    each tensor's bytes back to back in header order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            t = tensors[name]
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def plain_copy(t: torch.Tensor, seen_storage: set[int]) -> torch.Tensor:
    """A detached, contiguous CPU tensor; a copy if its storage was already written (safetensors
    refuses shared storage, and tied weights must come back as separate tensors)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    ptr = t.untyped_storage().data_ptr()
    if ptr and ptr in seen_storage:
        return t.clone()
    if ptr:
        seen_storage.add(ptr)
    return t


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    b = b.detach().to("cpu").contiguous()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def shard_sizes(path: Path) -> dict[str, int]:
    """Tensor name -> byte size from a safetensors header, after checking the header accounts for
    every byte of the file (no holes, nothing past the end)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise ValueError(f"header length {n} does not fit in a {size}-byte file")
            header = json.loads(f.read(n))
        sizes, end = {}, 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, stop = info["data_offsets"]
            if not 0 <= begin <= stop:
                raise ValueError(f"{name!r} has offsets {begin}..{stop}")
            sizes[name] = stop - begin
            end = max(end, stop)
        if sum(sizes.values()) != end or 8 + n + end != size:
            raise ValueError(f"tensors cover {sum(sizes.values())} bytes ending at {end}, the file holds "
                             f"{size - 8 - n} after the header")
    except FileNotFoundError:
        raise ModelDirError(f"{path} is missing; the version directory is incomplete") from None
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise ModelDirError(f"{path} is not a valid safetensors file ({exc}); rewrite this version") from exc
    return sizes
