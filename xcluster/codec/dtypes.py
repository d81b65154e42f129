"""The dtypes xcluster carries and how their raw bits are viewed.

Every codec operation works on the raw little-endian bits of a tensor viewed as unsigned
integers of the element's width, so any dtype round-trips bit for bit (NaN payloads, -0.0, Inf).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from ..errors import FormatError
from .kernels.changes import UINT  # the one definition (torch-free), used here for views

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("xcluster's format is little-endian; big-endian hosts are not supported")

# name in the manifest -> torch dtype. Names are torch's own (str(dtype) without "torch.").
_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)

DTYPE_NAMES: frozenset[str] = frozenset(_DTYPES)
_NAME_OF = {v: k for k, v in _DTYPES.items()}

# width in bytes -> (signed torch dtype used for views, unsigned numpy dtype used for arithmetic)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} is not supported by xcluster "
                          f"(supported: {', '.join(sorted(DTYPE_NAMES))})") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype {name!r} (supported: {', '.join(sorted(DTYPE_NAMES))})") from None


def itemsize(name: str) -> int:
    return torch_dtype(name).itemsize


def flat_bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of ``t``'s raw bits (``t`` must be contiguous); no copy."""
    flat = t.reshape(-1)
    return flat.view(_INT_VIEW[t.element_size()])


def np_bits(t: torch.Tensor) -> np.ndarray:
    """A flat unsigned numpy view of ``t``'s raw bits (``t`` contiguous, on CPU); no copy."""
    w = t.element_size()
    return flat_bits(t).numpy().view(UINT[w])


def np_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as a flat uint8 numpy view (C order, little-endian); no copy."""
    return t.reshape(-1).view(torch.uint8).numpy()
