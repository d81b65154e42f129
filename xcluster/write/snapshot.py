"""The snapshot a background publish takes: private copies of a state_dict, made at the call.

:func:`take_snapshot` copies (and converts) the tensors into buffers of its own, reusing those of
an earlier snapshot where they fit, so that the optimizer's later in-place updates cannot reach
what the worker thread of :class:`~xcluster.write.background.BackgroundPublisher` encodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..codec.dtypes import dtype_name
from ..format import check_tensor_name

SNAPSHOT_MODES = ("device", "pinned")


@dataclass(slots=True)
class Snapshot:
    """Private copies of a state_dict, and the CUDA events that mark the copies as done."""

    tensors: dict[str, torch.Tensor]
    events: list

    def wait(self) -> None:
        """Block until every asynchronous copy into the buffers has finished."""
        for ev in self.events:
            ev.synchronize()
        self.events = []


def target_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` for floating-point tensors when given, else the tensor's own dtype."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def check_state(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> None:
    """Everything ``prepare_state`` would refuse, refused before any buffer is written."""
    for name, t in state_dict.items():
        check_tensor_name(name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided:
            raise TypeError(f"state_dict[{name!r}] has layout {t.layout}; only dense tensors are supported")
        dtype_name(target_dtype(t, dtype))


def take_snapshot(state_dict: Mapping[str, torch.Tensor], *, mode: str, dtype: torch.dtype | None = None,
                  reuse: Mapping[str, torch.Tensor] | None = None) -> Snapshot:
    """Copy ``state_dict`` into contiguous buffers of its own, converting floating-point tensors
    to ``dtype`` when given.

    ``mode="device"`` keeps each copy on its tensor's device; ``"pinned"`` copies CUDA tensors
    to page-locked host memory, asynchronously (on a CPU-only host both are a plain copy).
    Buffers of ``reuse`` whose name, dtype, shape and device match are overwritten instead of
    allocating. Copies are ordered on the current CUDA stream, so later in-place updates by the
    optimizer cannot reach them; :meth:`Snapshot.wait` waits for them before the buffers are read.
    """
    if mode not in SNAPSHOT_MODES:
        raise ValueError(f"snapshot mode must be one of {SNAPSHOT_MODES}, got {mode!r}")
    check_state(state_dict, dtype)
    pinned = mode == "pinned" and torch.cuda.is_available()
    reuse = reuse or {}
    out: dict[str, torch.Tensor] = {}
    cuda_devices: set[torch.device] = set()
    for name, t in state_dict.items():
        t = t.detach()
        want = target_dtype(t, dtype)
        device = torch.device("cpu") if pinned else t.device
        buf = reuse.get(name)
        if buf is None or buf.dtype != want or buf.shape != t.shape or buf.device != device:
            buf = torch.empty(t.shape, dtype=want, device=device, pin_memory=pinned)
        buf.copy_(t, non_blocking=t.is_cuda)
        if t.is_cuda:
            cuda_devices.add(t.device)
        out[name] = buf
    events = []
    for dev in cuda_devices:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        events.append(ev)
    return Snapshot(out, events)
