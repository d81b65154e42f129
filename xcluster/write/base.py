"""The publisher's private copy of the last committed version: what the next delta is taken against.

- ``host``: contiguous CPU tensors, and their digests. A version scanned on the device has its
  digests taken from this copy brought up to date with the changes the scan sent over (xxh3 runs
  on the host), so its weights never cross whole: only the changes do (new tensors and keyframes
  cross whole). Such a digest proves the transport and the subscriber's apply; that the scan
  found every change is proved by tests/unit/test_devscan.py (same bytes as the numpy scan).
- ``scan``: what the scan compares against. With the torch scan and ``base_on="device"``, a
  copy on each tensor's own device (one model's worth of device memory, no base crossing per
  version); otherwise the host copy itself (the torch scan brings it over range by range).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..codec.encode import BaseUpdate, apply_update
from ..codec.digest import tensor_digest

BASE_ON = ("device", "host")


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` that shares nothing with it."""
    return t.clone() if t.device.type == "cpu" else t.cpu()


def tensor_digests(tensors: Mapping[str, torch.Tensor], workers: int) -> dict[str, str]:
    """Digests of CPU tensors, ``workers`` at a time (xxh3 releases the GIL)."""
    names = sorted(tensors)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(names, pool.map(lambda n: tensor_digest(tensors[n]), names)))


@dataclass(eq=False)
class BaseCopy:
    host: dict[str, torch.Tensor]
    digests: dict[str, str]
    scan: dict[str, torch.Tensor]

    @property
    def scan_is_host(self) -> bool:
        return self.scan is self.host

    @classmethod
    def of(cls, new: Mapping[str, torch.Tensor], host: dict[str, torch.Tensor], digests: Mapping[str, str], *,
           on_device: bool, reuse: BaseCopy | None = None) -> BaseCopy:
        """The copy of a committed version ``new``, taking ownership of its CPU copy ``host``.
        ``on_device``: also keep a scan copy on each tensor's device, written into the buffers of
        ``reuse``'s device copy where they match (the old base is no longer needed once committed)."""
        if not on_device:
            return cls(host, dict(digests), host)
        old = reuse.scan if reuse is not None and not reuse.scan_is_host else {}
        scan = {}
        for name, t in new.items():
            buf = old.get(name)
            if buf is not None and buf.device == t.device and buf.dtype == t.dtype and buf.shape == t.shape:
                scan[name] = buf.copy_(t)
            else:
                scan[name] = t.clone()
        return cls(host, dict(digests), scan)

    def advance_host(self, new: Mapping[str, torch.Tensor], update: BaseUpdate, digests: Mapping[str, str]) -> None:
        """After a committed version scanned on the host: update the host copy in place (any device
        copy is dropped; the next version scanned on the device will make a new one)."""
        apply_update(self.host, new, update)
        self.digests = dict(digests)
        self.scan = self.host

    def host_after(self, new: Mapping[str, torch.Tensor], update: BaseUpdate) -> dict[str, torch.Tensor]:
        """The host copy of ``new``, built from this one and ``update`` without changing this one:
        tensors the update touches are copied and updated, the others are shared."""
        touched = update.touched()
        out = {n: self.host[n].clone() if n in touched else self.host[n] for n in new if n not in update.full}
        apply_update(out, new, update)
        return out

    def digests_after(self, host_new: Mapping[str, torch.Tensor], update: BaseUpdate,
                      workers: int) -> dict[str, str]:
        """Digests of ``host_new`` (from :meth:`host_after`): those of untouched tensors are this copy's."""
        touched = update.touched()
        out = tensor_digests({n: t for n, t in host_new.items() if n in touched}, workers)
        out.update((n, self.digests[n]) for n in host_new if n not in touched)
        return out
