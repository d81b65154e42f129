"""Loading the codec's compiled loops before the first version needs them.

numba is imported on first use (about 0.25 s) and compiles each loop, or loads it from its on-disk
cache, the first time the loop is called with each set of argument types: together about 0.9 s
added to the first delta a fresh process applies. A long-running reader (the follow daemon) runs
:func:`warm_up` on a background thread at start, so that cost overlaps its start-up and first poll
instead of delaying the first version it serves.

Nothing is guessed: a tiny keyframe and delta of every dtype with exponent groups are encoded with
every compiled encoding allowed and decoded, patched and undone exactly as the subscriber does, so
the loops are loaded for the argument types real versions use (tensors this small would never be
written as ``sparse-exp2``, so its segments are built and read directly). Pure and quiet (no I/O,
no logs).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import numpy as np
import torch

from .dtypes import UINT, flat_bits, np_bits
from .encodings import full_exp as fullexp
from .kernels import exprank, scatter
from .kernels.changes import find_changes, unzigzag, zigzag_diff
from .decode import Fill, Scatter, decode_block, patch
from .encode import CodecConfig, encode_version
from .encodings.sparse_exp2 import EXP_FIELDS, SegmentReader, build

DTYPES = tuple(getattr(torch, name) for name in EXP_FIELDS if hasattr(torch, name))
"""One tensor of each dtype with exponent groups (their raw bits are 1, 2 or 4 bytes wide)."""

ELEMENTS = 4096
"""Per tensor: above ``full_exp.MIN_ELEMENTS``, so keyframes take the coded encodings."""


def _state(seed: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for dt in DTYPES:
        t = (torch.randn(ELEMENTS, generator=g) * 0.02).to(dt)
        if step:
            flat_bits(t)[::50] += step  # 2% of the elements moved by an ulp or so: a sparse delta
        out[str(dt).removeprefix("torch.")] = t
    return out


def _roundtrip(new: dict[str, torch.Tensor], base: dict[str, torch.Tensor] | None, cfg: CodecConfig) -> set[str]:
    """Encode ``new`` (against ``base``), decode it onto a copy of ``base`` (or fresh tensors),
    patch and undo: the encodings written."""
    chunks: list[bytes] = []
    enc = encode_version(new, {n: "" for n in new}, base, cfg, lambda _e, data: chunks.append(bytes(data)))
    names = [t.name for t in enc.tensors]
    held = [base[n].clone() if base is not None else torch.empty_like(new[n]) for n in names]
    for b in enc.blocks:
        ops = decode_block(b, chunks[b.chunk], enc.tensors, where="warm-up", base=held,
                           into=None if base is not None else dict(enumerate(held)))
        for op in ops:
            if isinstance(op, Fill):
                continue
            patch(held[op.tensor], op)
            patch(held[op.tensor], op, undo=True)
    for n, t in zip(names, held):  # a broken loop shows here rather than on a real version
        if base is not None and not np.array_equal(np_bits(t), np_bits(base[n])):
            raise RuntimeError(f"warm-up: patch and undo of {n} did not restore it")
    return {b.encoding for b in enc.blocks}


def _exp_roundtrip(new: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> set[str]:
    """Build one ``sparse-exp2`` segment of each tensor's changes, read it back, patch and undo:
    the encodings exercised."""
    for name, t in new.items():
        old, cur = np_bits(base[name]), np_bits(t)
        udt = UINT[t.element_size()]
        pos, ov, nv = find_changes(old, cur)
        z = zigzag_diff(ov, nv)
        pieces = build(old, pos, z, name)
        got, gz = SegmentReader(pieces, t.element_size(), "warm-up").segment(old, pos.size, name, udt)
        if not (np.array_equal(got, pos) and np.array_equal(gz, z)):
            raise RuntimeError(f"warm-up: the {name} sparse-exp2 segment did not read back")
        held = base[name].clone()
        op = Scatter(0, got, unzigzag(gz))
        patch(held, op)
        if not np.array_equal(np_bits(held), cur):
            raise RuntimeError(f"warm-up: patching {name} did not give the new values")
        patch(held, op, undo=True)
    return {"sparse-exp2"}


def warm_up(stop: threading.Event | None = None) -> set[str]:
    """Run every compiled loop a reader uses once, for every width of raw bits (a no-op where
    numba is missing or turned off: then nothing is compiled). Returns the encodings exercised.

    Deltas come first (what a running reader applies next), keyframes after. ``stop``, once set,
    ends the warm-up after the step in progress: a step compiles a few loops at most, so a process
    that joins this thread before it exits (numba must not be compiling then) waits seconds at most."""
    if not any(m.compiled() for m in (exprank, scatter, fullexp)):
        return set()
    key, new = _state(0, 0), _state(0, 1)
    steps: list[Callable[[], set[str]]] = [functools.partial(_exp_roundtrip, {n: new[n]}, {n: key[n]}) for n in new]
    cfg = CodecConfig(workers=1)
    steps.append(functools.partial(_roundtrip, new, key, cfg))  # sparse-sub
    steps.append(functools.partial(_roundtrip, key, None, cfg))  # full-exp keyframes
    seen: set[str] = set()
    for step in steps:
        if stop is not None and stop.is_set():
            break
        seen |= step()
    return seen
