"""Applying a version to weights: bounded, verified, and exactly undone on failure.

*Bounded*: :func:`check_limits` refuses, from the manifest's sizes alone, a version whose weights,
largest tensor or largest block would exceed the reader's limits, before anything is fetched or
allocated; an allocation the machine refuses anyway is a named error (:func:`alloc`).

*Verified and exact undo*: :func:`patch_and_verify` decodes each block whole (bounds-checked)
before applying any of it, patches the tensors held in place, then checks every digest the
manifest states; on any failure or interrupt it undoes every patch, in reverse, after every
decode worker has stopped (:func:`~xcluster.read.fetch.run_all`), so the weights are bit for bit
those of the version held before. Only a version that verified is handed to ``commit``.

The calls into ``codec.decode`` (``decode_block``, ``fill``, ``patch``, ``block_memory``) are made
here and nowhere else on the read side.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..codec.decode import Fill, Patch, Scatter, block_memory, decode_block, fill, patch
from ..codec.digest import entry_digest, model_digest_from
from ..codec.dtypes import dtype_name, np_bits, torch_dtype
from ..errors import BaseMismatchError, DecodeError, DigestMismatchError, ResourceLimitError
from ..codec.encoding import is_fill
from ..format import INIT_BASE, Manifest, TensorEntry
from .fetch import run_all, shielded

if TYPE_CHECKING:
    from .subscriber import SubscriberConfig


def check_limits(m: Manifest, cfg: SubscriberConfig, where: str) -> None:
    """Refuse, before fetching or allocating anything, a version whose weights exceed the
    configured memory limits."""
    if m.model_bytes > cfg.max_model_bytes:
        raise ResourceLimitError(f"{where}: weights of {m.model_bytes} bytes exceed max_model_bytes "
                                 f"({cfg.max_model_bytes})")
    cap = cfg.max_tensor_bytes
    big = max(m.tensors, key=lambda t: t.nbytes, default=None)
    if cap is not None and big is not None and big.nbytes > cap:
        raise ResourceLimitError(f"{where}: tensor {big.name} ({big.dtype}{list(big.shape)}, {big.nbytes} bytes) "
                                 f"exceeds max_tensor_bytes ({cap})")
    for bi, b in enumerate(m.blocks):
        if (need := block_memory(b)) > cfg.max_block_bytes:
            raise ResourceLimitError(f"{where}: block {bi} ({b.encoding}) needs {need} bytes to decode, more than "
                                     f"max_block_bytes ({cfg.max_block_bytes})")


def alloc(t: TensorEntry, where: str) -> torch.Tensor:
    """A fresh tensor for ``t``; an allocation the machine refuses is a named error."""
    try:
        return torch.empty(t.shape, dtype=torch_dtype(t.dtype))
    except (RuntimeError, MemoryError) as exc:
        raise ResourceLimitError(f"{where}: cannot allocate {t.name} ({t.dtype}{list(t.shape)}, {t.nbytes} "
                                 f"bytes): {str(exc).splitlines()[0][:200]}; lower the model size or raise the "
                                 "memory available to this process") from exc


def alloc_fresh(m: Manifest, where: str) -> dict[int, torch.Tensor]:
    """Empty tensors, by index, for the tensors of ``m`` that do not start from the base
    (``init: none``: a keyframe's, or new ones); their ``planes`` blocks fill them."""
    return {i: alloc(t, where) for i, t in enumerate(m.tensors) if t.init != INIT_BASE}


def fill_block(m: Manifest, bi: int, data: bytes, fresh: dict[int, torch.Tensor], where: str) -> None:
    """Decode ``planes`` block ``bi`` of ``m`` from its chunk's bytes into the fresh tensors."""
    b = m.blocks[bi]
    for op in decode_block(b, data, m.tensors, where=f"{where} block {bi}", into=fresh):
        assert isinstance(op, Fill)
        fill(fresh[op.tensor], op)


def verify_state(state: Mapping[str, torch.Tensor], m: Manifest, *, workers: int,
                 where: str) -> dict[str, torch.Tensor]:
    """Weights kept elsewhere checked against manifest ``m``: names, dtypes, shapes, every
    tensor's digest and the model digest (:class:`DigestMismatchError` otherwise). Returns them
    detached and contiguous, by name."""
    if set(state) != {t.name for t in m.tensors}:
        raise DigestMismatchError(f"{where}: tensor names differ from the manifest's")
    tensors: dict[str, torch.Tensor] = {}
    for t in m.tensors:
        cur = state[t.name]
        if dtype_name(cur.dtype) != t.dtype or tuple(cur.shape) != t.shape:
            raise DigestMismatchError(f"{where}: {t.name} is {dtype_name(cur.dtype)}{tuple(cur.shape)}, the "
                                      f"manifest says {t.dtype}{t.shape}")
        tensors[t.name] = cur.detach().contiguous()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        got = dict(zip(tensors, pool.map(lambda t: entry_digest(tensors[t.name], t.parts), m.tensors)))
    for t in m.tensors:
        if got[t.name] != t.digest:
            raise DigestMismatchError(f"{where}: {t.name} hashes to {got[t.name]}, the manifest says {t.digest}")
    if model_digest_from((t.name, t.dtype, t.shape, t.digest) for t in m.tensors) != m.model_digest:
        raise DigestMismatchError(f"{where}: the manifest's model digest does not match its tensors")
    return tensors


def patch_and_verify(m: Manifest, chunks: dict[int, bytes], fresh: dict[int, torch.Tensor], where: str, *,
                     base: Mapping[str, torch.Tensor], digests: Mapping[str, str], workers: int,
                     commit: Callable[[dict[str, torch.Tensor]], None], verify: bool = True,
                     changes: dict[str, np.ndarray] | None = None) -> int:
    """Patch ``m``'s ``-sub`` blocks onto the tensors of ``base`` (its ``planes`` blocks already
    filled ``fresh``), verify every digest, and hand the new weights, by name, to ``commit``;
    on any failure or interrupt every patch is undone, after every worker has stopped.

    ``digests`` are the verified digests of ``base``'s tensors (empty for a keyframe): a tensor
    carried over unchanged with the same digest is not hashed again. Returns the bytes of the
    elements patched (what a delta wrote into the tensors held).

    ``verify=False`` patches without hashing anything: only for a caller that replays versions
    it verified before onto a copy proven to be their base, and that verifies every tensor of
    the version it ends at (the subscriber then holds no verified digests, so the next version
    hashes every tensor).

    ``changes``, where given, receives once the version verified the flat positions (int64) of
    the elements it changed, by tensor name: what an engine that holds the base version must be
    sent (``follow/engine_update.py``). A tensor the version fills from scratch lists all of them."""
    # tensors of the new state: patched in place (init base) or fresh (init none)
    target: list[torch.Tensor] = []
    for t in m.tensors:
        if t.init == INIT_BASE:
            cur = base.get(t.name)
            if cur is None or cur.dtype != torch_dtype(t.dtype) or tuple(cur.shape) != t.shape:
                raise BaseMismatchError(f"{where}: {t.name} is carried over from the base but this "
                                        "subscriber's tensor differs in name, dtype or shape")
            target.append(cur)
        else:
            target.append(fresh[len(target)])
    applied: list[tuple[torch.Tensor, Patch | Scatter]] = []
    patches = [bi for bi, b in enumerate(m.blocks) if not is_fill(b.encoding)]
    plock = threading.Lock()
    touched = {s.tensor for b in m.blocks for s in b.segments}
    # a tensor is hashed by the worker that patches its last block, while others still decode
    block_tensors = {bi: {s.tensor for s in m.blocks[bi].segments} for bi in patches}
    pending = Counter(i for ts in block_tensors.values() for i in ts)
    hashed: dict[int, str] = {}
    written = [0]
    found: dict[int, list[tuple[int, np.ndarray]]] | None = None if changes is None else {}

    def run_block(bi: int) -> None:
        b = m.blocks[bi]
        ops = decode_block(b, chunks[b.chunk], m.tensors, where=f"{where} block {bi}", base=target)
        for op in ops:  # decoded and bounds-checked whole before any of it is applied
            tgt = target[op.tensor]
            if isinstance(op, Fill):
                fill(tgt, op)
            else:
                patch(tgt, op)
                with plock:
                    applied.append((tgt, op))
                    written[0] += op.diff.size * tgt.element_size()
            if found is not None:
                pos = _changed_positions(op)
                with plock:
                    found.setdefault(op.tensor, []).append((_first(op), pos))
        with plock:
            done = []
            for i in block_tensors[bi]:
                pending[i] -= 1
                if pending[i] == 0:
                    done.append(i)
        for i in done if verify else ():
            hashed[i] = entry_digest(target[i], m.tensors[i].parts)

    ok = False
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="xc-decode") as pool:
        try:
            run_all(pool, lambda k: run_block(patches[k]), len(patches))
            for i, t in enumerate(m.tensors):
                if t.dtype == "bool" and i in touched and bool((np_bits(target[i]) > 1).any()):
                    raise DecodeError(f"{where}: {t.name} holds bool bytes other than 0 and 1")
            # verify: hash what changed; what did not change keeps the digest we verified before,
            # unless the manifest states another one (hashed in other parts: FORMAT.md §6), then hash it
            idx = sorted(touched | {i for i, t in enumerate(m.tensors)
                                    if t.init != INIT_BASE or digests.get(t.name) != t.digest}) if verify else []
            rest = [i for i in idx if i not in hashed]
            hashed.update(zip(rest, run_all(
                pool, lambda k: entry_digest(target[rest[k]], m.tensors[rest[k]].parts), len(rest))))
            for i in idx:
                got = hashed[i]
                if got != m.tensors[i].digest:
                    changed = "after applying" if i in touched or m.tensors[i].init != INIT_BASE else \
                        "unchanged from the verified base"
                    raise DigestMismatchError(f"{where}: {m.tensors[i].name} hashes to {got} ({changed}), "
                                              f"the manifest says {m.tensors[i].digest}")
            got = model_digest_from((t.name, t.dtype, t.shape, t.digest) for t in m.tensors)
            if verify and got != m.model_digest:
                raise DigestMismatchError(f"{where}: model digest {got} != manifest {m.model_digest}")
            # swap before anything else can be interrupted (the pool's shutdown below can be):
            # ``commit`` moves weights and label together in one statement
            if changes is not None:
                changes.update(_collect(m, found, target))
            commit({t.name: target[i] for i, t in enumerate(m.tensors)})
            ok = True
            return written[0]
        finally:
            if not ok:  # every block has stopped (see run_all): undo is not racing a patch
                shielded(lambda: [patch(tgt, op, undo=True) for tgt, op in reversed(applied)])


def _first(op: Fill | Patch | Scatter) -> int:
    return int(op.positions[0]) if isinstance(op, Scatter) and op.positions.size else getattr(op, "start", 0)


def _changed_positions(op: Fill | Patch | Scatter) -> np.ndarray:
    """Flat positions (int64) of the elements ``op`` changes: where its diff is not zero; all it
    writes for a fill."""
    if isinstance(op, Fill):
        return np.arange(op.start, op.start + op.planes[0].size, dtype=np.int64)
    nz = op.diff != 0
    if isinstance(op, Scatter):
        return op.positions[nz].astype(np.int64, copy=False)
    if op.gaps is None:
        return np.flatnonzero(nz) + op.start
    pos = np.cumsum(op.gaps.astype(np.int64) + 1)
    pos += op.start - 1
    return pos[nz]


def _collect(m: Manifest, found: dict[int, list[tuple[int, np.ndarray]]],
             target: list[torch.Tensor]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i, t in enumerate(m.tensors):
        if t.init != INIT_BASE:
            out[t.name] = np.arange(target[i].numel(), dtype=np.int64)
        elif i in found:
            parts = [p for _, p in sorted(found[i], key=lambda sp: sp[0])]
            out[t.name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out


__all__ = ["alloc", "alloc_fresh", "check_limits", "fill_block", "patch_and_verify", "verify_state"]
