"""safetensors files as the slots lay them out and check them: shard planning, an aligned layout,
the header, and a header check that accounts for every byte of the file.

The format (safetensors' own): an 8-byte little-endian header length N, N bytes of JSON (padded
with spaces; here to a multiple of 8), then every tensor's bytes back to back, no holes, at the
``data_offsets`` the header gives relative to the end of the header.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from ..errors import ModelDirError

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own cap on a header

ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
             torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
for _name, _st in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        ST_DTYPES[getattr(torch, _name)] = _st
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


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


def width(dtype: torch.dtype) -> int:
    """Bytes per element."""
    return torch.empty((), dtype=dtype).element_size()


def spec_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``."""
    n = width(dtype)
    for d in shape:
        n *= d
    return n


def aligned_order(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Widest elements first, by name within a width: after a header padded to 8 bytes every
    tensor then starts at a multiple of its element size (each one before it spans a multiple
    of its own, larger or equal, width)."""
    return sorted(specs, key=lambda s: (-width(s[1]), s[0]))


def header_bytes(order: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str],
                 ) -> tuple[bytes, list[tuple[int, int]]]:
    """The 8-byte length plus the JSON header (padded to a multiple of 8) for tensors laid out
    in ``order``; and each tensor's (begin, end) relative to the end of the header."""
    header: dict[str, object] = {"__metadata__": metadata}
    offsets = []
    offset = 0
    for name, dtype, shape in order:
        n = spec_bytes(dtype, shape)
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offsets.append((offset, offset + n))
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


def read_header(path: Path) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """(8 + header length, name -> (dtype, shape, begin, end)) of a safetensors file, after
    checking that the header accounts for every byte of the file (no holes, no overlaps,
    nothing past the end)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise ValueError(f"header length {n} does not fit in a {size}-byte file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise TypeError("the header is not an object")
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, stop = info["data_offsets"]
            shape = tuple(info["shape"])
            if not (type(begin) is int and type(stop) is int and 0 <= begin <= stop):
                raise ValueError(f"{name!r} has offsets {begin}..{stop}")
            if not all(type(d) is int and d >= 0 for d in shape) or not isinstance(info["dtype"], str):
                raise ValueError(f"{name!r} has shape {shape} / dtype {info['dtype']!r}")
            entries[name] = (info["dtype"], shape, begin, stop)
        spans = sorted((e[2], e[3]) for e in entries.values())
        end = 0
        for begin, stop in spans:
            if begin != end:
                raise ValueError(f"tensor bytes leave a hole or overlap at offset {min(begin, end)}")
            end = stop
        if 8 + n + end != size:
            raise ValueError(f"tensors cover {end} bytes, the file holds {size - 8 - n} after the header")
    except FileNotFoundError:
        raise ModelDirError(f"{path} is missing; the model directory is incomplete") from None
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise ModelDirError(f"{path} is not a valid safetensors file ({exc}); the slot must be rewritten") from exc
    return 8 + n, entries
