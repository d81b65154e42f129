"""When a publisher writes a full version or a checkpoint: the counters both publishers keep.

:class:`Cadence` is the post-commit bookkeeping of :class:`~xcluster.write.publisher.Publisher`
and :class:`~xcluster.write.sharded.ShardedPublisher`, written once: each committed version and
each checkpoint is recorded here, and the policy (``keyframe_every``, ``checkpoint_every``,
``checkpoint_chain_fraction`` of the publisher config) is asked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def keyframe_due(config: Any, *, since_keyframe: int) -> bool:
    """Whether the next version must be a keyframe by ``keyframe_every`` (off by default)."""
    return config.keyframe_every is not None and since_keyframe + 1 >= config.keyframe_every


def checkpoint_due(config: Any, *, since_checkpoint: int, chain_bytes: int, checkpoint_bytes: int) -> bool:
    """The checkpoint policy, after a committed delta: ``checkpoint_every`` versions since the last
    checkpoint (or keyframe), or the deltas since then outweigh ``checkpoint_chain_fraction`` of it."""
    if config.checkpoint_every is None:
        return False
    if since_checkpoint >= config.checkpoint_every:
        return True
    frac = config.checkpoint_chain_fraction
    return frac is not None and chain_bytes > frac * checkpoint_bytes


@dataclass
class Cadence:
    """Counters since the last keyframe and the last checkpoint (a keyframe counts as both)."""

    keyframe_version: int = 0
    since_keyframe: int = 0
    since_checkpoint: int = 0
    checkpoint_bytes: int = 0
    chain_bytes: int = 0
    """Bytes of the deltas since the last checkpoint (or keyframe)."""

    def committed(self, version: int, *, keyframe: bool, nbytes: int) -> None:
        """Record a committed version of ``nbytes`` (chunks, manifest and HEAD)."""
        if keyframe:
            self.keyframe_version, self.since_keyframe = version, 0
            self.since_checkpoint, self.checkpoint_bytes, self.chain_bytes = 0, nbytes, 0
        else:
            self.since_keyframe += 1
            self.since_checkpoint += 1
            self.chain_bytes += nbytes

    def checkpointed(self, nbytes: int) -> None:
        """Record a checkpoint of ``nbytes`` written for the newest version."""
        self.since_checkpoint, self.checkpoint_bytes, self.chain_bytes = 0, nbytes, 0

    def keyframe_due(self, config: Any) -> bool:
        return keyframe_due(config, since_keyframe=self.since_keyframe)

    def checkpoint_due(self, config: Any) -> bool:
        return checkpoint_due(config, since_checkpoint=self.since_checkpoint, chain_bytes=self.chain_bytes,
                              checkpoint_bytes=self.checkpoint_bytes)
