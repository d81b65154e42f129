"""Publish in the background: ``publish()`` returns once the weights are snapshotted.

``Publisher(url, config=PublisherConfig(background=True))`` hands every ``publish()`` to a
:class:`BackgroundPublisher`: the call copies the tensors (the *snapshot*) and returns a
:class:`PublishTicket`; one worker thread runs the synchronous publisher (encode, upload,
commit) on one snapshot at a time.

- **Latest wins.** At most one snapshot waits behind the one in flight. A newer ``publish()``
  replaces it (copying into its buffers, so nothing is allocated), its ticket is marked
  superseded and the ``coalesced`` counter grows. Memory: the publisher's base + the snapshot
  in flight + one pending. Deltas are always against the last *committed* version, since the
  synchronous publisher advances its base only on commit.
- **Errors are never swallowed.** A failed background publish fails its ticket and is raised,
  as :class:`BackgroundPublishError` with the original as ``__cause__``, by the next
  ``publish()`` / ``flush()`` / ``close()``. Nothing of a failed version is visible and the
  publisher keeps working: the next snapshot is a fresh attempt.
- **Shutdown is bounded.** The worker is a daemon thread, so it can never hold the interpreter
  open. A hook on threading's exit list (it runs when the main thread has finished, before
  non-daemon threads are joined and before ``concurrent.futures`` stops taking work) drops the
  pending snapshot with a warning and gives the version in flight ``close_timeout_s`` to commit.
  A version only becomes visible when HEAD names it, so one cut short stays invisible and the
  next publisher removes what it left.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..codec.dtypes import dtype_name
from ..errors import (BackgroundPublishError, PublishCancelledError, PublisherClosedError, PublishTimeoutError,
                     XclusterError)
from ..format import check_tensor_name

log = logging.getLogger(__name__)
SNAPSHOT_MODES = ("device", "pinned")

if TYPE_CHECKING:  # pragma: no cover - publisher imports this module lazily
    from .publisher import PublishResult


# --- snapshot ------------------------------------------------------------------------------------
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


# --- tickets -------------------------------------------------------------------------------------
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


@dataclass(slots=True)
class _Job:
    ticket: PublishTicket
    snapshot: Snapshot
    keyframe: bool | None


PublishFn = Callable[[dict[str, torch.Tensor], "int | None", "bool | None"], "PublishResult"]


# --- the worker ----------------------------------------------------------------------------------
class BackgroundPublisher:
    """Runs ``publish_fn`` (the synchronous publish) on snapshots, in a worker thread.

    ``where`` names the store in messages; ``on_commit`` is called in the worker thread with each
    committed :class:`~xcluster.PublishResult`, before its ticket resolves.
    """

    def __init__(self, publish_fn: PublishFn, *, where: str, snapshot: str = "device",
                 close_timeout_s: float = 60.0, on_commit: Callable[[PublishResult], None] | None = None) -> None:
        if snapshot not in SNAPSHOT_MODES:
            raise ValueError(f"snapshot mode must be one of {SNAPSHOT_MODES}, got {snapshot!r}")
        self._publish_fn = publish_fn
        self.where = where
        self.snapshot_mode = snapshot
        self.close_timeout_s = close_timeout_s
        self._on_commit = on_commit
        self._cond = threading.Condition()
        self._submit_lock = threading.Lock()  # one snapshot at a time
        self._pending: _Job | None = None
        self._inflight: _Job | None = None
        self._spare: dict[str, torch.Tensor] | None = None  # buffers of the last published snapshot
        self._last_ticket: PublishTicket | None = None
        self._error: tuple[str, BaseException] | None = None  # first failure not yet raised
        self._more_errors = 0
        self._closed = False
        self._stop = False
        self._counts = dict(submitted=0, committed=0, coalesced=0, failed=0, cancelled=0)
        self._thread = threading.Thread(target=self._run, name="xc-background-publish", daemon=True)
        self._thread.start()
        _register(self)

    # --- the trainer's side ---------------------------------------------------------------------
    def submit(self, state_dict: Mapping[str, torch.Tensor], *, step: int | None = None,
               keyframe: bool | None = None, dtype: torch.dtype | None = None) -> PublishTicket:
        """Snapshot ``state_dict`` and queue it; returns as soon as the copy is made (or enqueued
        on the CUDA stream). Raises the first unreported background failure instead of
        submitting (see :class:`BackgroundPublishError`)."""
        check_state(state_dict, dtype)  # refuse bad input before touching the pending snapshot
        with self._submit_lock:
            with self._cond:
                self._check_usable()
                self._raise_error()
                old, self._pending = self._pending, None
                reuse = old.snapshot.tensors if old is not None else self._spare
                self._spare = None
            try:
                snap = take_snapshot(state_dict, mode=self.snapshot_mode, dtype=dtype, reuse=reuse)
            except BaseException:
                with self._cond:
                    if old is not None:  # its buffers may be half overwritten: it cannot be published
                        self._cancel(old, "a newer publish() that reused its buffers failed while copying")
                    self._cond.notify_all()
                raise
            with self._cond:
                ticket = PublishTicket(self._counts["submitted"] + 1, step)
                self._counts["submitted"] += 1
                if old is not None:
                    keyframe = True if old.keyframe or keyframe else keyframe  # a requested keyframe sticks
                    old.ticket._supersede(ticket)
                    self._counts["coalesced"] += 1
                    log.debug("%s: step %s replaces step %s, which was still waiting (coalesced %d)",
                              self.where, step, old.ticket.step, self._counts["coalesced"])
                self._pending = _Job(ticket, snap, keyframe)
                self._last_ticket = ticket
                self._cond.notify_all()
            return ticket

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything submitted so far is committed (or failed: then raise it)."""
        with self._cond:
            target = self._last_ticket

            def settled() -> bool:
                inflight = self._inflight
                return (target is None or target.done()) and (
                    inflight is None or target is None or inflight.ticket.seq > target.seq)

            ok = self._cond.wait_for(settled, timeout)
            self._raise_error()
            if not ok:
                raise PublishTimeoutError(f"{self.where}: background publish not finished within {timeout} s "
                                          f"(step {target.step if target else None}); call flush() again")

    def close(self, timeout: float | None = None) -> None:
        """Stop taking snapshots, flush, then stop the worker. On timeout or error the pending
        snapshot is dropped (a version in flight still finishes or stays invisible) and the
        error is raised. Closing twice is harmless."""
        with self._cond:
            self._closed = True
        try:
            self.flush(timeout)
        finally:
            with self._cond:
                self._stop = True
                if self._pending is not None:
                    self._cancel(self._pending, "the publisher was closed before it was published")
                    self._pending = None
                idle = self._inflight is None
                self._cond.notify_all()
            if idle and self._thread is not threading.current_thread():
                self._thread.join(timeout)
            _LIVE.discard(self)

    def stats(self) -> BackgroundStats:
        with self._cond:
            return BackgroundStats(**self._counts, pending=self._pending is not None,
                                   in_flight=self._inflight is not None)

    @property
    def coalesced(self) -> int:
        """Snapshots replaced by a newer one before they were published."""
        return self._counts["coalesced"]

    # --- helpers, called with the lock held -----------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise PublisherClosedError(f"publisher for {self.where} is closed; create a new one to publish again")
        if not self._thread.is_alive():
            raise BackgroundPublishError(f"the background publish thread for {self.where} has stopped "
                                         "(see the log); create a new publisher")

    def _raise_error(self) -> None:
        if self._error is None:
            return
        (msg, cause), more = self._error, self._more_errors
        self._error, self._more_errors = None, 0
        if more:
            msg += f" ({more} later background publishes failed as well; see the log)"
        raise BackgroundPublishError(msg) from cause

    def _cancel(self, job: _Job, why: str) -> None:
        job.ticket._fail(PublishCancelledError, f"step {job.ticket.step} to {self.where} was not published: {why}")
        self._counts["cancelled"] += 1

    # --- the worker's side ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._pending is not None or self._stop)
                    job, self._pending = self._pending, None
                    if job is None:
                        return
                    self._inflight = job
                self._publish(job)
        except BaseException:  # a bug here must not leave callers waiting forever
            log.exception("background publish thread for %s stopped", self.where)
            with self._cond:
                for job in (self._inflight, self._pending):
                    if job is not None and not job.ticket.done():
                        self._cancel(job, "the background publish thread stopped")
                self._inflight = self._pending = None
                self._cond.notify_all()
            raise

    def _publish(self, job: _Job) -> None:
        step = job.ticket.step
        result = failure = None
        try:
            job.snapshot.wait()
            result = self._publish_fn(job.snapshot.tensors, step, job.keyframe)
        except Exception as exc:
            failure = exc
            log.warning("%s: background publish of step %s failed: %s: %s", self.where, step,
                        type(exc).__name__, exc)
        callback_error = None
        if result is not None and self._on_commit is not None:
            try:
                self._on_commit(result)
            except Exception as exc:
                callback_error = exc
                log.exception("%s: on_commit raised for version %d", self.where, result.version)
        with self._cond:
            if failure is not None:
                msg = (f"background publish of step {step} to {self.where} failed: {type(failure).__name__}: "
                       f"{failure}. Nothing of it is visible; the next publish() is a fresh attempt")
                job.ticket._fail(BackgroundPublishError, msg, failure)
                self._counts["failed"] += 1
                self._record(msg, failure)
            else:
                assert result is not None
                job.ticket._resolve(result)
                self._counts["committed"] += 1
                if callback_error is not None:
                    self._record(f"on_commit raised for version {result.version} of {self.where} (the version is "
                                 f"committed): {type(callback_error).__name__}: {callback_error}", callback_error)
            self._inflight = None
            if self._spare is None:
                self._spare = job.snapshot.tensors  # the next snapshot copies into these buffers
            self._cond.notify_all()

    def _record(self, msg: str, cause: BaseException) -> None:
        if self._error is None:
            self._error = (msg, cause)
        else:
            self._more_errors += 1

    # --- interpreter exit -----------------------------------------------------------------------
    def _shutdown_at_exit(self) -> None:
        """Drop the pending snapshot, give the one in flight ``close_timeout_s`` to commit."""
        deadline = time.monotonic() + self.close_timeout_s
        if not self._cond.acquire(timeout=self.close_timeout_s):
            log.error("%s: background publisher busy at exit; abandoning it (uncommitted work stays invisible)",
                      self.where)
            return
        try:
            self._closed = self._stop = True
            if self._pending is not None:
                log.warning("%s: interpreter exiting: dropping step %s, which was not yet published",
                            self.where, self._pending.ticket.step)
                self._cancel(self._pending, "the interpreter exited first")
                self._pending = None
            if self._error is not None:
                log.error("%s: unreported background publish failure at exit: %s", self.where, self._error[0])
            self._cond.notify_all()
            if self._inflight is not None:
                step = self._inflight.ticket.step
                log.info("%s: interpreter exiting: waiting up to %.0f s for step %s to commit",
                         self.where, self.close_timeout_s, step)
                if not self._cond.wait_for(lambda: self._inflight is None, max(0.0, deadline - time.monotonic())):
                    log.error("%s: step %s did not commit within close_timeout_s=%.0f; abandoning it (it stays "
                              "invisible; the next publisher removes its objects)", self.where, step,
                              self.close_timeout_s)
        finally:
            self._cond.release()


# --- exit hook -----------------------------------------------------------------------------------
_LIVE: weakref.WeakSet[BackgroundPublisher] = weakref.WeakSet()
_REGISTERED = threading.Lock()
_hooked = False


def _at_exit() -> None:
    for hook in list(_LIVE):
        hook._shutdown_at_exit()


def _register(hook: BackgroundPublisher) -> None:
    """Track ``hook`` for the exit hook. threading's exit list runs before non-daemon threads
    are joined and, being registered after ``concurrent.futures`` was imported, before it refuses
    new work (the publisher's thread pools); plain atexit is the fallback."""
    global _hooked
    with _REGISTERED:
        if not _hooked:
            register = getattr(threading, "_register_atexit", None)
            try:
                (register or atexit.register)(_at_exit)
            except RuntimeError:  # created while the interpreter is already shutting down
                atexit.register(_at_exit)
            _hooked = True
        _LIVE.add(hook)
