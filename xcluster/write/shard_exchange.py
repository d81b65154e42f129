"""The sharded publisher's exchanges on its process group: small metadata, never weights.

Each exchange carries a dict as JSON bytes in uint8 tensors (never pickle): :meth:`Exchange.gather`
brings every rank's dict to rank 0, :meth:`Exchange.broadcast` rank 0's to every rank. A peer that
closed its connection or timed out (``ShardedConfig.timeout_s``) raises :class:`RankLostError`, and
the exchange stays broken: the group cannot be trusted for another publish.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RankLostError


class Exchange:
    """Metadata exchanges among the ranks of ``group``; ``where`` names the store in messages."""

    def __init__(self, group: Any, *, where: str) -> None:
        self.group = group
        self.where = where
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.root = dist.get_global_rank(group, 0)
        self.device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":  # metadata travels on the group's own device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.broken: str | None = None
        """Why the group cannot be trusted any more (a rank was lost), or None."""

    def check(self) -> None:
        """Raise :class:`RankLostError` if an earlier exchange lost a rank."""
        if self.broken is not None:
            raise RankLostError(f"{self.where}: rank {self.rank}: {self.broken}")

    def _lost(self, exc: BaseException, what: str) -> RankLostError:
        self.broken = (f"a rank was lost while {what} ({exc}); the process group cannot be trusted: "
                       "restart the job (a new ShardedPublisher on a new group)")
        return RankLostError(f"{self.where}: rank {self.rank} of {self.world_size}: {self.broken}")

    def gather(self, obj: dict, what: str) -> list[dict] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        data = json.dumps(obj, separators=(",", ":")).encode()
        dev = self.device
        try:
            size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
            sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
            dist.all_gather(sizes, size, group=self.group)
            n = max(int(s.item()) for s in sizes)
            buf = torch.zeros(n, dtype=torch.uint8)
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            buf = buf.to(dev)
            out = [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(self.world_size)] \
                if self.rank == 0 else None
            dist.gather(buf, out, dst=self.root, group=self.group)
        except RuntimeError as exc:  # DistBackendError: a peer closed its connection or timed out
            raise self._lost(exc, what) from exc
        if out is None:
            return None
        return [json.loads(bytes(t.cpu().numpy()[:int(s.item())])) for t, s in zip(out, sizes)]

    def broadcast(self, obj: dict | None, what: str = "starting") -> dict:
        """Rank 0's ``obj`` on every rank."""
        dev = self.device
        try:
            data = json.dumps(obj, separators=(",", ":")).encode() if self.rank == 0 else b""
            size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
            dist.broadcast(size, src=self.root, group=self.group)
            if self.rank == 0:
                buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
            else:
                buf = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
            dist.broadcast(buf, src=self.root, group=self.group)
        except RuntimeError as exc:
            raise self._lost(exc, what) from exc
        return obj if self.rank == 0 else json.loads(bytes(buf.cpu().numpy()))
