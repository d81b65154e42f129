"""Publish in the background: ``publish()`` returns once the weights are snapshotted.

:class:`BackgroundPublisher` wraps a :class:`~xcluster.write.publisher.Publisher` (built from
the same arguments, or given one)::

    pub = BackgroundPublisher("s3://bucket/run", config=PublisherConfig(checkpoint_every=32),
                              background=BackgroundConfig(snapshot="pinned"))
    ticket = pub.publish(model.state_dict(), step=step)   # a PublishTicket; .result() waits

Each ``publish()`` copies the tensors (the *snapshot*) and returns a :class:`PublishTicket`;
one worker thread runs the wrapped publisher's synchronous ``publish()`` (encode, upload,
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
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..errors import (BackgroundPublishError, ConfigError, PublishCancelledError, PublisherClosedError,
                      PublishTimeoutError, XclusterError)
from ..store import Store
from .publisher import Publisher, PublisherConfig, PublishResult
from .version import check_step
from .snapshot import SNAPSHOT_MODES, Snapshot, check_state, take_snapshot
from .ticket import BackgroundStats, PublishTicket

log = logging.getLogger(__name__)


# --- options -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class BackgroundConfig:
    """What only background publishing needs (the wrapped publisher keeps its :class:`PublisherConfig`)."""

    snapshot: str = "device"
    """Where the snapshot goes. ``"device"`` copies on the tensors' own device (fastest for the
    trainer, costs device memory); ``"pinned"`` copies CUDA tensors to page-locked host memory
    asynchronously (no device memory). On a CPU-only host both are a plain copy."""
    close_timeout_s: float = 60.0
    """At interpreter exit (and on leaving a ``with`` block by an exception): how long the version
    in flight may take to commit before it is abandoned (it stays invisible). The snapshot still
    waiting is dropped with a warning."""

    def __post_init__(self) -> None:
        if self.snapshot not in SNAPSHOT_MODES:
            raise ConfigError(f"snapshot must be 'device' or 'pinned', got {self.snapshot!r}")
        if not self.close_timeout_s >= 0:
            raise ConfigError(f"close_timeout_s must be >= 0 (seconds), got {self.close_timeout_s}")


@dataclass(slots=True)
class _Job:
    ticket: PublishTicket
    snapshot: Snapshot
    keyframe: bool | None


# --- the publisher -------------------------------------------------------------------------------
class BackgroundPublisher:
    """A :class:`~xcluster.write.publisher.Publisher` whose ``publish()`` returns a
    :class:`PublishTicket` once the weights are snapshotted; a worker thread commits them.

    Built from the arguments of ``Publisher`` (``url``, ``store``, ``config``, ``files``), or
    wrapping ``publisher=`` (then none of those). ``on_commit`` is called in the worker thread
    with each committed :class:`~xcluster.PublishResult`, before its ticket resolves; an error it
    raises is raised by the next call (the version is committed). A wrapped publisher must have
    no ``on_commit`` of its own: pass it here. ``background`` holds the options of this mode.
    """

    def __init__(self, url: str | None = None, *, store: Store | None = None, config: PublisherConfig | None = None,
                 files: str | os.PathLike | Mapping[str, bytes] | None = None,
                 on_commit: Callable[[PublishResult], None] | None = None, publisher: Publisher | None = None,
                 background: BackgroundConfig | None = None, clock: Callable[[], float] | None = None,
                 attempt_id: Callable[[], str] | None = None) -> None:
        if background is None:
            background = BackgroundConfig()
        elif not isinstance(background, BackgroundConfig):
            raise ConfigError(f"background must be a BackgroundConfig, got {background!r}")
        if publisher is None:
            hooks = {k: v for k, v in (("clock", clock), ("attempt_id", attempt_id)) if v is not None}
            publisher = Publisher(url, store=store, config=config, files=files, **hooks)
        else:
            given = [k for k, v in (("url", url), ("store", store), ("config", config), ("files", files),
                                    ("clock", clock), ("attempt_id", attempt_id)) if v is not None]
            if given:
                raise ConfigError(f"BackgroundPublisher: pass publisher= or the arguments to build one, not both "
                                  f"(got publisher= and {', '.join(given)})")
            if not isinstance(publisher, Publisher):
                raise TypeError(f"publisher must be a Publisher, got {type(publisher).__name__}")
            if publisher.on_commit is not None:
                raise ConfigError("the wrapped Publisher has an on_commit: pass it to BackgroundPublisher instead, "
                                  "which calls it in the worker thread and reports its errors")
        self.publisher = publisher
        """The wrapped synchronous publisher (the worker thread calls its ``publish()``)."""
        self.background = background
        self.on_commit = on_commit
        self.where = publisher.store.url
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

    # --- what the wrapped publisher knows -------------------------------------------------------
    @property
    def store(self) -> Store:
        return self.publisher.store

    @property
    def config(self) -> PublisherConfig:
        return self.publisher.config

    @property
    def run_id(self) -> str:
        """The training run every version of this publisher belongs to."""
        return self.publisher.run_id

    @property
    def signing_key_id(self) -> str | None:
        return self.publisher.signing_key_id

    @property
    def version(self) -> int:
        """The newest committed version on the store, as the publisher knows it (0 = none)."""
        return self.publisher.version

    @property
    def last_result(self) -> PublishResult | None:
        """The newest version the worker committed."""
        return self.publisher.last_result

    # --- the trainer's side ---------------------------------------------------------------------
    def publish(self, state_dict: Mapping[str, torch.Tensor], *, step: int | None = None,
                keyframe: bool | None = None, dtype: torch.dtype | None = None,
                files: str | os.PathLike | Mapping[str, bytes] | None = None) -> PublishTicket:
        """Snapshot ``state_dict`` and queue it; returns as soon as the copy is made (or enqueued
        on the CUDA stream), with the :class:`PublishTicket` of that snapshot. Arguments as for
        :meth:`Publisher.publish <xcluster.write.publisher.Publisher.publish>` (``dtype`` converts
        while copying; ``files`` applies from the next version committed). Raises the first
        unreported background failure instead of submitting (see :class:`BackgroundPublishError`)."""
        step = check_step(step)
        if files is not None:
            self.publisher.set_files(files)
        check_state(state_dict, dtype)  # refuse bad input before touching the pending snapshot
        with self._submit_lock:
            with self._cond:
                self._check_usable()
                self._raise_error()
                old, self._pending = self._pending, None
                reuse = old.snapshot.tensors if old is not None else self._spare
                self._spare = None
            try:
                snap = take_snapshot(state_dict, mode=self.background.snapshot, dtype=dtype, reuse=reuse)
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

    def __enter__(self) -> BackgroundPublisher:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # already failing: stop, but do not mask the original error
            self.close(self.background.close_timeout_s)
        except XclusterError:
            log.exception("closing the publisher for %s after an error", self.where)

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
            result = self.publisher.publish(job.snapshot.tensors, step=step, keyframe=job.keyframe)
        except Exception as exc:
            failure = exc
            log.warning("%s: background publish of step %s failed: %s: %s", self.where, step,
                        type(exc).__name__, exc)
        callback_error = None
        on_commit = self.on_commit
        if result is not None and on_commit is not None:
            try:
                on_commit(result)
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
        deadline = time.monotonic() + self.background.close_timeout_s
        if not self._cond.acquire(timeout=self.background.close_timeout_s):
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
                         self.where, self.background.close_timeout_s, step)
                if not self._cond.wait_for(lambda: self._inflight is None, max(0.0, deadline - time.monotonic())):
                    log.error("%s: step %s did not commit within close_timeout_s=%.0f; abandoning it (it stays "
                              "invisible; the next publisher removes its objects)", self.where, step,
                              self.background.close_timeout_s)
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
