"""What each rank of a sharded publish holds, and whether the ranks' parts tile the model.

A rank passes its tensors whole or as dim-0 :class:`Slice` s of a global tensor. :func:`prepare_shard`
turns that into the rank's tensors and its layout rows ``[name, dtype, global shape, element
offset, element count]``; rank 0 checks the gathered rows with :func:`check_layout`
(:class:`ShardLayoutError` unless every tensor is covered exactly once).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass

import torch

from ..codec.dtypes import dtype_name
from ..errors import ShardLayoutError
from ..format import check_tensor_name
from .version import prepare_state


@dataclass(frozen=True, eq=False)
class Slice:
    """Rows ``[offset, offset + tensor.shape[0])`` of the global tensor of shape ``global_shape``
    (a dim-0 slice, contiguous in the global tensor's C order)."""

    tensor: torch.Tensor
    _: KW_ONLY
    offset: int
    global_shape: Sequence[int]


def part_count(entry: dict, offset: int) -> int:
    """Elements of the part at element ``offset`` of a tensor of :func:`check_layout`."""
    return entry["parts"][str(offset)]


def prepare_shard(shard: Mapping[str, torch.Tensor | Slice]) -> tuple[dict[str, torch.Tensor], list[list]]:
    """This rank's tensors (contiguous CPU, by global name) and layout rows
    ``[name, dtype, global shape, element offset, element count]``, sorted by name. A slice of
    no rows is dropped, unless the whole tensor has no elements (then any rank may pass it)."""
    tensors: dict[str, torch.Tensor] = {}
    rows: list[list] = []
    for name, value in shard.items():
        check_tensor_name(name)
        if isinstance(value, Slice):
            t, gshape = value.tensor, value.global_shape
            if (not isinstance(gshape, Sequence) or len(gshape) < 1
                    or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in gshape)):
                raise ShardLayoutError(f"{name}: global_shape {gshape!r} must be at least one non-negative int")
            gshape = tuple(int(d) for d in gshape)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"shard[{name!r}] is a Slice of a {type(t).__name__}, not a tensor")
            off = value.offset
            if isinstance(off, bool) or not isinstance(off, numbers.Integral):
                raise ShardLayoutError(f"{name}: offset {off!r} is not an integer")
            off = int(off)
            if t.dim() != len(gshape) or tuple(t.shape[1:]) != gshape[1:] or not 0 <= off <= gshape[0] - t.shape[0]:
                raise ShardLayoutError(f"{name}: a slice of shape {tuple(t.shape)} at row {off} is not a dim-0 slice "
                                       f"of a tensor of shape {gshape}")
            if t.numel() == 0 and math.prod(gshape) > 0:
                continue  # this rank holds no rows of it
            rows.append([name, dtype_name(t.dtype), list(gshape), off * math.prod(gshape[1:]), t.numel()])
        elif isinstance(value, torch.Tensor):
            t = value
            rows.append([name, dtype_name(t.dtype), list(t.shape), 0, t.numel()])
        else:
            raise TypeError(f"shard[{name!r}] is a {type(value).__name__}, not a tensor or a Slice")
        tensors[name] = t
    return prepare_state(tensors), sorted(rows)


def check_layout(layouts: list[list[list]]) -> dict[str, dict]:
    """The ranks' layouts as one: ``{name: {"dtype", "shape", "parts": {offset: count},
    "ranks": {offset: rank}}}``, or
    :class:`ShardLayoutError` when they do not tile every tensor exactly once."""
    by_name: dict[str, list[tuple[int, int, int, str, tuple]]] = {}
    for rank, rows in enumerate(layouts):
        for name, dtype, shape, off, count in rows:
            by_name.setdefault(name, []).append((off, count, rank, dtype, tuple(shape)))
    out: dict[str, dict] = {}
    problems: list[str] = []
    for name in sorted(by_name):
        ps = sorted(by_name[name])
        kinds = {(d, s) for _, _, _, d, s in ps}
        if len(kinds) != 1:
            problems.append(f"{name}: ranks disagree on dtype/global shape: "
                            + ", ".join(f"rank {r} {d}{list(s)}" for _, _, r, d, s in ps))
            continue
        dtype, shape = kinds.pop()
        numel, pos = math.prod(shape), 0
        for off, count, rank, _, _ in ps:
            if off != pos:
                what = "overlap" if off < pos else "hole"
                problems.append(f"{name}: elements [{min(off, pos)}, {max(off, pos)}) are a {what} (rank {rank}'s "
                                f"part starts at element {off}; parts: "
                                + ", ".join(f"rank {r} [{o}, {o + k})" for o, k, r, _, _ in ps) + ")")
                break
            pos = off + count
        else:
            if pos != numel:
                problems.append(f"{name}: parts cover elements [0, {pos}) of {numel}")
        # the owner of each part is in the layout too: ranks that trade equal parts still diff
        # against bases of their own, so such a version must be a keyframe, not a delta
        out[name] = {"dtype": dtype, "shape": list(shape), "parts": {str(o): k for o, k, _, _, _ in ps},
                     "ranks": {str(o): r for o, _, r, _, _ in ps}}
    if problems:
        raise ShardLayoutError("the ranks' shards do not tile the model: " + "; ".join(problems[:20]))
    return out
