"""What a background publish hands back: a :class:`PublishTicket` per snapshot, and the counters.

Tickets are resolved (committed, failed, cancelled or superseded) by
:class:`~xcluster.write.background.BackgroundPublisher`, under its lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..errors import PublishTimeoutError, XclusterError
from .publisher import PublishResult


class PublishTicket:
    """The handle a background ``publish()`` returns.

    ``result(timeout)`` waits for the :class:`~xcluster.PublishResult` of the version that holds
    this snapshot. A snapshot replaced by a newer ``publish()`` before its turn came is
    ``superseded``: it is never published on its own, ``superseded_by`` is the ticket that
    replaced it, and ``result()`` returns the result of the version that did get committed in
    its place (following the chain). ``result()`` raises :class:`BackgroundPublishError` if
    that version failed, :class:`PublishCancelledError` if it was dropped at close or exit, and
    :class:`PublishTimeoutError` when ``timeout`` runs out.
    """

    __slots__ = ("seq", "step", "superseded_by", "_done", "_result", "_error")

    def __init__(self, seq: int, step: int | None) -> None:
        self.seq = seq
        """Position of this snapshot among the publisher's submissions (1, 2, …)."""
        self.step = step
        self.superseded_by: PublishTicket | None = None
        self._done = threading.Event()
        self._result: PublishResult | None = None
        self._error: tuple[type[XclusterError], str, BaseException | None] | None = None

    def __repr__(self) -> str:
        state = ("superseded" if self.superseded else "failed" if self._error else
                 f"version {self._result.version}" if self._result else "waiting")
        return f"PublishTicket(seq={self.seq}, step={self.step}, {state})"

    @property
    def superseded(self) -> bool:
        return self.superseded_by is not None

    def _last(self) -> PublishTicket:
        t = self
        while t.superseded_by is not None:
            t = t.superseded_by
        return t

    def done(self) -> bool:
        """Has the version holding this snapshot (or what superseded it) been decided?"""
        t = self._last()
        return t._done.is_set() and t.superseded_by is None

    def result(self, timeout: float | None = None) -> PublishResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        t = self
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not t._done.wait(left):
                raise PublishTimeoutError(f"publish of step {self.step} (submission {self.seq}) not committed "
                                          f"within {timeout} s; call result() again to keep waiting")
            if t.superseded_by is None:
                break
            t = t.superseded_by
        if t._error is not None:
            cls, msg, cause = t._error
            raise cls(msg) from cause
        assert t._result is not None
        return t._result

    # resolved by BackgroundPublisher, under its lock
    def _resolve(self, result: PublishResult) -> None:
        self._result = result
        self._done.set()

    def _fail(self, cls: type[XclusterError], msg: str, cause: BaseException | None = None) -> None:
        self._error = (cls, msg, cause)
        self._done.set()

    def _supersede(self, by: PublishTicket) -> None:
        self.superseded_by = by
        self._done.set()


@dataclass(frozen=True, slots=True)
class BackgroundStats:
    submitted: int
    """publish() calls accepted."""
    committed: int
    """Versions committed by the worker."""
    coalesced: int
    """Snapshots replaced by a newer one before their turn (never published on their own)."""
    failed: int
    """Background publishes that failed."""
    cancelled: int
    """Snapshots dropped at close or exit."""
    pending: bool
    in_flight: bool
