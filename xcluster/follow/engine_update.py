"""The daemon's side of updating a running engine in place (the engine's side: ``vllm_worker.py``).

* :class:`ChangeLog` keeps the positions the deltas changed since the version the engine last
  confirmed (``AppliedVersion.changes``), so the hand-off can send only those elements. It knows
  when it cannot say: after a keyframe, a restart or a gap, :meth:`ChangeLog.covers` is false and
  the engine reloads instead.
* :func:`write_patch` writes those positions and their values, read from the installed slot, into
  a safetensors file the engine's workers read: ``<name>:idx`` (int32 below 2**31 elements, else
  int64) and ``<name>:val`` (the tensor's dtype).
* :func:`expected_digests` hashes, from the installed slot, the rectangles the engine reported for
  its parameters (its layout), the way the engine hashes its own: equal means it holds them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .vllm_worker import as_2d, hashed

INT32_LIMIT = 1 << 31


class ChangeLog:
    """Positions changed since ``base`` (the engine's version) up to ``upto``, by tensor name."""

    def __init__(self) -> None:
        self.base: int | None = None
        self.upto: int | None = None
        self.positions: dict[str, np.ndarray] = {}

    def reset(self, version: int) -> None:
        """The engine now holds ``version``: nothing is owed."""
        self.base = self.upto = version
        self.positions = {}

    def invalidate(self) -> None:
        self.base = self.upto = None
        self.positions = {}

    def add(self, version: int, changes: Mapping[str, np.ndarray] | None, engine_version: int | None) -> None:
        """Take in one applied version's changes (None: a full version, or not recorded)."""
        if self.upto is not None and version <= self.upto:
            return  # the same delta applied again, to the other slot: already counted
        if changes is None:
            self.invalidate()
        elif self.upto is not None and version == self.upto + 1:
            for name, pos in changes.items():
                old = self.positions.get(name)
                self.positions[name] = pos if old is None else np.union1d(old, pos)
            self.upto = version
        elif engine_version is not None and version == engine_version + 1:
            self.base, self.upto, self.positions = engine_version, version, dict(changes)
        else:
            self.invalidate()

    def covers(self, engine_version: int | None, version: int) -> bool:
        """Whether the log holds every change from ``engine_version`` to ``version``."""
        return engine_version is not None and self.base == engine_version and self.upto == version

    def elements(self) -> int:
        return sum(int(p.size) for p in self.positions.values())


def write_patch(path: Path, weights: Mapping[str, torch.Tensor], positions: Mapping[str, np.ndarray]) -> int:
    """Write the elements at ``positions`` of ``weights`` to ``path`` (atomically); returns its size."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    for name, pos in positions.items():
        if not pos.size:
            continue
        t = weights[name]
        idx = torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64))
        out[f"{name}:idx"] = idx.to(torch.int32) if t.numel() < INT32_LIMIT else idx
        out[f"{name}:val"] = t.reshape(-1)[idx].contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(out, str(tmp))
    os.replace(tmp, path)
    return path.stat().st_size


def expected_digests(regions: Sequence[Mapping], weights: Mapping[str, torch.Tensor]) -> list[str]:
    """The digest the engine must report for each of ``regions``, from the installed weights."""
    return hashed([(as_2d(weights[r["tensor"]]), tuple(r["rows"]), tuple(r["cols"])) for r in regions])


@dataclass(frozen=True, slots=True)
class WeightsUpdate:
    """What a hand-off that can update the engine in place is given besides the directory."""

    weights: Mapping[str, torch.Tensor]
    """The installed version's tensors (the slot's mapped files), by name."""
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]
    """Every tensor's name, shape and dtype name, as the manifest lists them."""
    patch: Path | None
    """The elements changed since the engine's version (:func:`write_patch`), or None: reload."""
    patch_elements: int = 0
    base_version: int | None = None
    """The version the patch applies to: the one the engine confirmed last."""
