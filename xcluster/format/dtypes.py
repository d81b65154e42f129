"""Dtype names of the format and their widths, torch-free (the manifest parser needs only these).

xcluster/codec/dtypes.py maps them to torch dtypes; a reader whose torch lacks one of the rarer ones
refuses it when it applies a version.
"""

from __future__ import annotations

from ..errors import FormatError

WIDTHS: dict[str, int] = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "bool": 1,
}
DTYPE_NAMES: frozenset[str] = frozenset(WIDTHS)


def itemsize(name: str) -> int:
    try:
        return WIDTHS[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype {name!r} (supported: {', '.join(sorted(DTYPE_NAMES))})") from None
