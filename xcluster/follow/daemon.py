"""The subscriber daemon a rollout node runs: ``xcluster subscribe URL --out DIR …``.

One loop, one thread:

1. poll HEAD (one conditional GET; exponential backoff with jitter while the store errors);
2. on a new version: fetch, verify and apply it (:class:`~xcluster.Subscriber`) **into the standby
   slot's memory-mapped files** (``slots.py``): a delta patches only the elements it changes, a
   keyframe is written into a fresh directory swapped in as the slot; the engine keeps serving
   the other slot meanwhile. Then the slot is made durable (fsync), recorded (``DIR/state.json``,
   atomic) and ``DIR/current`` switched to it;
3. hand the slot over to the engine (the only step inside the engine's pause); a failed hand-off
   is retried with backoff while the daemon keeps following the store, always with the newest;
4. once the engine confirmed it, bring the other slot to the same version (the same deltas
   again, from the chunk cache; a byte copy of the current slot after a keyframe or when it
   cannot be proven), so the next version again needs one delta (without an engine hand-off
   this waits for the next version: a reader of ``current`` gets a version's interval);
5. every few seconds write ``leases/<node-id>.json`` to the store (what ``xcluster status`` and
   ``xcluster gc`` read).

With ``SlotsConfig(slots=1)`` there is one slot, patched in place with ``current`` unlinked
meanwhile (for GPU nodes whose engine keeps its own copy). docs/DAEMON.md has the crash story:
the state file says which slot ``current`` names and whether the other holds a proven version;
a slot being patched or written is recorded as untrusted first. A restart (``kill -9`` included)
re-hashes ``current``'s slot against its manifest (a mismatch falls back to the newest
keyframe), proves the standby by its digests or repairs it from ``current``. Verified chunks of
deltas are kept under ``DIR/cache`` until both slots have them. SIGTERM/SIGINT finish the step in
progress and exit 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import (ChecksumMismatchError, ConfigError, EngineWeightsMismatchError, HandoffError,
                      ObjectNotFoundError, StoreError, XclusterError)
from ..format import KEYFRAME
from ..format import Lease, Manifest, check_node_id, file_key, lease_key, xxh3_128
from ..codec.encoding import parse_manifest
from ..read.apply import verify_state
from ..util.retry import Backoff
from ..store import Store, resolve_store
from ..read.subscriber import AppliedVersion, Subscriber, SubscriberConfig
from .engine_update import ChangeLog, WeightsUpdate, write_patch
from .handoff import Handoff, HandoffResult
from .metrics import DaemonMetrics
from .keeper import SlotKeeper, listed
from .slots import Slots, SlotsConfig
from .state import DaemonState, StateStore

log = logging.getLogger("xcluster.daemon")
PROGRESS_MIN_BYTES = 64 << 20


def default_node_id() -> str:
    """``<hostname>`` made safe for a lease key."""
    raw = socket.gethostname() or "node"
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in raw).lstrip(".-") or "node"
    return safe[:128]


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """How the daemon follows a store; the CLI only fills this in."""

    out: Path
    """Where the slots, ``current``, ``state.json`` and the chunk cache live (``/dev/shm/xc`` keeps
    them in memory)."""
    poll_s: float = 1.0
    """Seconds between HEAD polls while nothing changes."""
    backoff_max_s: float = 30.0
    """Longest wait between attempts while the store or the engine keeps failing."""
    once: bool = False
    """Apply and hand over what is there, then exit (cron jobs, init containers)."""
    node_id: str = field(default_factory=default_node_id)
    """This subscriber's name in ``leases/<node-id>.json``."""
    lease_every_s: float = 5.0
    """Seconds between lease writes (0 disables leases)."""
    slots: SlotsConfig = field(default_factory=SlotsConfig)
    """Shard size, and one slot or two."""
    subscriber: SubscriberConfig | None = None
    """Fetch and verification settings; ``chunk_cache_dir`` defaults to ``<out>/cache``."""
    notify: bool = False
    """Speak systemd's notify protocol (READY=1 once the first version is in the engine,
    WATCHDOG=1 every loop) on ``notify_socket``."""
    notify_socket: str | None = None
    """``$NOTIFY_SOCKET`` as systemd set it (the CLI passes it in)."""
    progress: bool = False
    """Show a progress bar for large fetches (the CLI turns it on when stderr is a terminal)."""
    write_checkpoints_every: int | None = None
    """Write a checkpoint of the version held into the store followed (FORMAT.md §3a) whenever that
    store's newest checkpoint is this many versions or more behind it: on a cluster-local store
    that a relay fills, joiners then start from a checkpoint that never crossed the WAN. Needs
    write access to ``checkpoints/`` there; readers verify it against the signed chain, so they
    need not trust this node. None: never."""
    warm_up: bool = True
    """Load the codec's compiled loops on a background thread as ``run()`` starts
    (``codec/warm.py``), so the first delta after a start does not wait about 0.9 s for them (not
    with ``once``: that run applies at once, loading what it needs)."""

    def __post_init__(self) -> None:
        if not self.poll_s > 0:
            raise ConfigError(f"poll_s must be > 0, got {self.poll_s}")
        if self.backoff_max_s < self.poll_s:
            raise ConfigError(f"backoff_max_s ({self.backoff_max_s}) must be >= poll_s ({self.poll_s})")
        if self.lease_every_s < 0:
            raise ConfigError("lease_every_s must be >= 0")
        if self.write_checkpoints_every is not None and self.write_checkpoints_every < 1:
            raise ConfigError(f"write_checkpoints_every must be >= 1 or None, got {self.write_checkpoints_every}")
        check_node_id(self.node_id)


class Daemon:
    """Follows a store into a model directory and an engine. ``run()`` blocks until stopped."""

    def __init__(self, url: str | None = None, *, config: DaemonConfig, store: Store | None = None,
                 handoff: Handoff | None = None, metrics: DaemonMetrics | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.store = resolve_store(url, store, "Daemon")
        self.out = Path(config.out)
        self.out.mkdir(parents=True, exist_ok=True)
        sub_cfg = config.subscriber or SubscriberConfig()
        if sub_cfg.chunk_cache_dir is None:
            sub_cfg = replace(sub_cfg, chunk_cache_dir=str(self.out / "cache"))
        # the cache keeps deltas' chunks until both slots have them (a keyframe's would be most of a model)
        sub_cfg = replace(sub_cfg, chunk_cache_full=False, chunk_cache_prune=config.slots.slots == 1)
        self.subscriber = Subscriber(store=self.store, config=sub_cfg, on_apply=self._on_apply)
        self.slots = Slots(self.out, config=config.slots)
        self.states = StateStore(self.out)
        self.handoff = handoff
        self.metrics = metrics or DaemonMetrics()
        self.keeper = SlotKeeper(self.slots, self.states, self.subscriber, self.metrics,
                                 fetch_files=self._fetch_files, count_error=self._count_error)
        self._clock = clock
        self._listeners: list[Callable[[Path, int], None]] = []
        self._stop = threading.Event()
        self._files: dict[str, bytes] = {}  # non-weight files by xxh3, as verified
        self._last_error: str | None = None
        self._engine_state = "none" if handoff is None else "pending"
        # an engine updated in place is sent the elements changed since the version it holds
        self._updates = bool(getattr(handoff, "takes_updates", False))
        self.subscriber.record_changes = self._updates
        self._changes = ChangeLog()
        self._engine_update: str | None = None
        self._engine_verified: int | None = None
        self._tensors: tuple[str | None, tuple] = (None, ())  # (manifest hash, its tensors' names/shapes/dtypes)
        self.metrics.set_info(source=self.store.url, out=str(self.out), node=config.node_id,
                              engine=getattr(handoff, "name", "none") if handoff is not None else "none")
        self._lease_at = 0.0
        self._ready_sent = False
        self._store_backoff = Backoff(config.poll_s, config.backoff_max_s)
        self._handoff_backoff = Backoff(config.poll_s, config.backoff_max_s)
        self._handoff_at = 0.0
        self._target: int | None = None
        self._follow_ok = True
        self._checkpoint_checked: int | None = None
        self._stats_seen = (0, 0)
        self._last_applied: AppliedVersion | None = None
        self._bar = None  # (version, tqdm) while a large fetch shows progress
        self._bar_lock = threading.Lock()
        if config.progress:
            self.subscriber.on_chunk = self._progress

    # --- public -------------------------------------------------------------------------------
    def on_update(self, fn: Callable[[Path, int], None]) -> Callable[[Path, int], None]:
        """Call ``fn(path, version)`` in-process after each new version's directory is current."""
        self._listeners.append(fn)
        return fn

    def stop(self) -> None:
        """Ask the loop to finish the step in progress and return."""
        self._stop.set()

    @property
    def state(self) -> DaemonState | None:
        return self._state

    @property
    def _state(self) -> DaemonState | None:  # the keeper's record: one truth for both
        return self.keeper.state

    @_state.setter
    def _state(self, st: DaemonState | None) -> None:
        self.keeper.state = st

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop after the current step (exit 0)."""
        def handler(signum, _frame) -> None:
            log.info("received %s: finishing the current step, then exiting", signal.Signals(signum).name)
            self.stop()
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self) -> int:
        """Follow until stopped (or once, with ``once``); returns the process exit code."""
        if not self.config.warm_up or self.config.once:
            return self._loop()
        done = threading.Event()  # set as run() ends, however it ends
        warm = threading.Thread(target=_warm_up, args=(done,), name="xc-warm-up", daemon=True)
        warm.start()
        try:
            return self._loop()
        finally:  # it stops after its current step: a process that exits while numba compiles aborts
            done.set()
            warm.join()

    def _loop(self) -> int:
        self.resume()
        while not self._stop.is_set():
            ok = self.step()
            if self.config.once:
                return 0 if ok and self._engine_caught_up() else 1
            self._notify("WATCHDOG=1")
            self._stop.wait(self._next_wait(ok))
        self._write_lease(force=True)
        log.info("stopped at version %s", self._state.version if self._state else None)
        return 0

    # --- start-up -----------------------------------------------------------------------------
    def resume(self) -> None:
        """Pick up where a previous run stopped: ``current``'s slot re-verified, the standby proven
        by its digests or repaired from it."""
        for p in self.slots.clean_partial():
            log.info("removed %s, left by an interrupted write", p)
        try:
            rec = self.states.load()
        except XclusterError as exc:
            log.warning("%s", exc)
            self._count_error(exc)
            rec = None
        if rec is None:
            return
        st, mdata = rec
        self.subscriber.refuse_below(st.version)  # whatever happens next, the store may not go backwards
        try:  # the non-weight files as well: the engine is handed the whole directory
            m = parse_manifest(mdata, where="restored manifest")
            views = self.slots.map(st.slot, expected_files=listed(m))
            verify_state(views, m, workers=self.subscriber.config.decode_workers,
                         where=f"slot {st.slot} (version {st.version})")
        except XclusterError as exc:
            log.warning("slot %s does not hold version %d as its manifest says (%s): setting it aside and "
                        "starting from the newest keyframe", st.slot, st.version, exc)
            self._count_error(exc)
            self.slots.discard(st.slot)  # an engine (re)started on `current` must not load it
            return
        self._files.update({xxh3_128(b): b for b in self.slots.files(st.slot).values()})
        self.keeper.resume_current(st, views, mdata)
        st = self.keeper.state
        self.metrics.version_applied(st.version, committed_at=_seconds(st.committed_unix_ms), resumed=True)
        if self.handoff is not None:
            self._engine_state = "ok" if st.engine_version == st.version else "pending"
        log.info("resumed at version %d from %s (digest verified)", st.version, self.slots.path(st.slot))

    # --- one step -----------------------------------------------------------------------------
    def step(self) -> bool:
        """Poll, apply (the standby first brought level), install, hand over, lease. False if
        something failed (it was logged).

        Once the engine has confirmed the version ``current`` names, nothing reads the other slot
        any more: it is brought level right away, off the next version's install path. Without an
        engine hand-off that is left until the next version comes (``_follow``), so a reader that
        resolved ``current`` on its own has a whole version's interval to finish."""
        self._follow_ok = self._follow()
        handed = self._hand_over()
        ready = True
        st = self._state
        if handed and self.handoff is not None and st is not None and st.engine_version == st.version \
                and not self.config.once:
            ready = self.keeper.ready_standby(engine_behind=False)
        self._write_lease()
        self._maybe_checkpoint()
        return self._follow_ok and handed and ready

    def _maybe_checkpoint(self) -> None:
        """With ``write_checkpoints_every``: once per version held, after the engine was served,
        write a checkpoint of it if the store's newest is that many versions behind (one LIST)."""
        every = self.config.write_checkpoints_every
        held = self.subscriber.version
        if every is None or held is None or held == self._checkpoint_checked:
            return
        self._checkpoint_checked = held
        from ..read.checkpoint import newest_checkpoint_version

        try:
            newest = newest_checkpoint_version(self.store) or 0
            if held - newest < every:
                return
            w = self.subscriber.write_checkpoint()
            if w is not None:
                self.metrics.checkpoints_written.inc()
                log.info("wrote a checkpoint of version %d (%d bytes, %.2fs) into %s", w.version, w.bytes_written,
                         w.seconds, self.store.url)
        except Exception as exc:  # noqa: BLE001 - a checkpoint serves joiners: never this node's weights
            log.warning("could not write a checkpoint of version %d: %s", held, exc)
            self._count_error(exc)

    def _follow(self) -> bool:
        ok = True
        head = None
        dirty = False
        try:
            head = self.subscriber.poll()
            if head is not None:
                self.metrics.head_seen(head.version)
                known = self._state.version if self._state is not None else self.subscriber.version
                if known is None or head.version > known:
                    self._target = head.version
                    self._write_lease(force=True)
                    # only now is the standby touched: a reader that resolved `current` to it one
                    # version ago has had a whole version's interval to finish reading. A keyframe
                    # replaces it whole (``keeper.allocate``): nothing to bring level first.
                    if head.kind != KEYFRAME and \
                            not self.keeper.ready_standby(engine_behind=self._engine_behind()):
                        return False  # never patch `current`
                    self.keeper.mark_dirty()
                    dirty = True
                    self.subscriber.sync(poll=False)  # up to the HEAD just read: one request per poll
                elif head.version < known or self.subscriber.version is not None:
                    self.subscriber.sync(poll=False)  # refuses a rollback; else nothing to do
            self._store_backoff.reset()
        except StoreError as exc:
            log.warning("store error (will retry with backoff): %s", exc)
            self._count_error(exc)
            self.metrics.retry("store")
            ok = False
        except XclusterError as exc:  # bad data: keep serving the last good version
            self.keeper.replayed = None  # a replay unverified, then refused on top: never trusted again
            log.error("version not applied, still serving version %s: %s: %s",
                      self._state.version if self._state else None, type(exc).__name__, exc)
            self._count_error(exc)
            ok = False
        finally:
            self._target = None
            self._sync_stats()
        held = self.subscriber.version
        try:  # also after a failure part-way through a chain: the versions before it are good
            if held is not None and (self._state is None or self._state.version != held):
                self._install(head)
            elif dirty:
                self.keeper.mark_clean()  # nothing applied: every patch was undone, bit for bit
        except (OSError, XclusterError) as exc:
            log.error("could not install version %s: %s", held, exc)
            self._count_error(exc)
            ok = False
        finally:
            self.keeper.discard_pending()  # full writes that did not verify
        return ok

    def _engine_behind(self) -> bool:
        """An engine that has not taken ``current`` may still serve the standby's files: loaders
        that keep tensors backed by a mmap of them (transformers on CPU) would see patches made in
        place. Then the standby gets fresh files (a copy) instead; the engine's stay as they were."""
        st = self._state
        return self.handoff is not None and st is not None and st.engine_version not in (None, st.version)

    def _install(self, head) -> None:
        """Make the held version's slot durable and current (``keeper.py``), then tell the metrics,
        the log, the engine's hand-off and the listeners."""
        t0 = time.perf_counter()
        snap = self.subscriber.snapshot(copy=False)  # only this thread patches it
        m = snap.manifest
        assert m is not None and snap.version is not None
        files = self._fetch_files(m)
        ev = self._last_applied
        committed = head.committed_unix_ms if head is not None and head.version == snap.version else None
        path = self.keeper.install(snap, files, committed)
        write_s = time.perf_counter() - t0
        self.metrics.write_dir_seconds.observe(write_s)
        self.metrics.version_applied(snap.version, committed_at=_seconds(committed),
                                     head_version=head.version if head is not None else None)
        lag = f", {self._clock() - committed / 1000:.3f}s after commit" if committed else ""
        log.info("version %d is current at %s (%s; fetch %.3fs, apply %.3fs, install %.3fs%s)", snap.version, path,
                 m.kind, ev.fetch_seconds if ev else 0.0, ev.apply_seconds if ev else 0.0, write_s, lag)
        if self.handoff is not None:
            self._engine_state = "pending"
            self.metrics.set_engine_state("loading")
            self._handoff_backoff.reset()
            self._handoff_at = 0.0
        for fn in self._listeners:
            try:
                fn(path, snap.version)
            except Exception as exc:  # a listener's failure is reported, never fatal
                log.error("on_update listener failed for version %d: %s", snap.version, exc, exc_info=True)
                self._count_error(exc)

    def _fetch_files(self, m: Manifest) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for f in m.files:
            data = self._files.get(f.xxh3_128)
            if data is None:
                key = file_key(f.xxh3_128)
                try:
                    data = self.store.get_range(key, 0, f.size + 1)
                except ObjectNotFoundError:
                    raise ChecksumMismatchError(f"{self.store.url}/{key} ({f.name}) is missing") from None
                if len(data) != f.size or xxh3_128(data) != f.xxh3_128:
                    raise ChecksumMismatchError(f"{self.store.url}/{key} ({f.name}) does not match its manifest "
                                                "entry (size or xxh3-128)")
                self._files[f.xxh3_128] = data
            out[f.name] = data
        live = {f.xxh3_128 for f in m.files}
        for h in [h for h in self._files if h not in live]:
            del self._files[h]
        return out

    def _engine_caught_up(self) -> bool:
        return self.handoff is None or self._state is None or self._state.engine_version == self._state.version

    def _hand_over(self) -> bool:
        st = self._state
        if self.handoff is None or st is None:
            if st is not None:
                self._ready()
            return True
        if st.engine_version == st.version:
            return True
        now = time.monotonic()
        if now < self._handoff_at:
            return False
        path = self.slots.path(st.slot).resolve()
        try:
            if self._updates:
                res: HandoffResult = self.handoff.hand_over(path, st.version, update=self._weights_update(st))
            else:
                res = self.handoff.hand_over(path, st.version)
        except HandoffError as exc:
            if isinstance(exc, EngineWeightsMismatchError):
                self._engine_verified = None  # the engine serves weights nobody proved: status shows it
            delay = self._handoff_backoff.next_delay()
            self._handoff_at = now + delay
            self._engine_state = "failing"
            self._last_error = f"hand-off of version {st.version}: {exc}"
            log.error("engine hand-off of version %d failed (retrying in %.1fs, still following the store): %s",
                      st.version, delay, exc)
            self.metrics.handoff_failed(exc)
            self._last_error = f"hand-off of version {st.version}: {exc}"
            return False
        self._handoff_backoff.reset()
        self._changes.reset(st.version)
        self._drop_patch()
        self._engine_update = "in-place" if res.method == "in-place" else "reload"
        self._engine_verified = st.version if res.verified else None
        self._state = st.with_engine(st.version)
        self.states.save(self._state)
        self._engine_state = "ok"
        self._last_error = None
        self.metrics.handoff_done(res)
        committed = st.committed_unix_ms
        lag = f"; commit → engine {self._clock() - committed / 1000:.3f}s" if committed else ""
        pause = f", engine paused {res.pause_seconds:.3f}s" if res.pause_seconds is not None else ""
        log.info("engine took version %d in %.3fs%s%s (%s%s)", st.version, res.seconds, pause, lag, res.method,
                 ", verified" if res.verified else "")
        self._ready()
        return True

    def _weights_update(self, st: DaemonState) -> WeightsUpdate | None:
        """What an engine updated in place is given: the installed tensors and, when the change log
        reaches back to the engine's version, a file of the elements changed since (else: reload)."""
        views = self.keeper.views.get(st.slot)  # current's slot, as verified when installed or resumed
        if views is None:
            return None
        if self._tensors[0] != st.manifest_xxh3_128:
            m = parse_manifest(self.states.manifest(st.version, st.manifest_xxh3_128), where="installed manifest")
            self._tensors = (st.manifest_xxh3_128, tuple((t.name, tuple(t.shape), t.dtype) for t in m.tensors))
        patch = None
        self._drop_patch()  # one a failed hand-off left
        if self._changes.covers(st.engine_version, st.version) and getattr(self.handoff, "wants_patch", True):
            patch = self.out / "engine" / f"patch-{st.version}.safetensors"
            size = write_patch(patch, views, self._changes.positions)
            log.debug("engine patch %s: %d elements, %d bytes", patch, self._changes.elements(), size)
        return WeightsUpdate(weights=views, tensors=self._tensors[1], patch=patch,
                             patch_elements=self._changes.elements(), base_version=st.engine_version)

    def _drop_patch(self) -> None:
        for p in (self.out / "engine").glob("patch-*"):
            p.unlink(missing_ok=True)

    # --- leases, readiness, errors ------------------------------------------------------------
    def _write_lease(self, *, force: bool = False) -> None:
        if self.config.lease_every_s <= 0:
            return
        now = time.monotonic()
        if not force and now - self._lease_at < self.config.lease_every_s:
            return
        st = self._state
        head = self.subscriber.head
        lease = Lease(node_id=self.config.node_id, version=st.version if st else None, target_version=self._target,
                      model_digest=st.model_digest if st else None, updated_unix_ms=int(self._clock() * 1000),
                      engine_state=self._engine_state, engine_version=st.engine_version if st else None,
                      last_error=self._last_error, committed_unix_ms=st.committed_unix_ms if st else None,
                      head_version=head.version if head else None, engine_update=self._engine_update,
                      engine_verified_version=self._engine_verified)
        try:
            self.store.put(lease_key(self.config.node_id), lease.to_bytes())
            self._lease_at = now
        except Exception as exc:  # leases are advisory: never stop following because of one
            log.warning("could not write %s: %s", lease_key(self.config.node_id), exc)
            self._lease_at = now

    def _ready(self) -> None:
        if not self._ready_sent:
            self._ready_sent = True
            self._notify("READY=1")

    def _notify(self, msg: str) -> None:
        if not self.config.notify or not self.config.notify_socket:
            return
        addr = self.config.notify_socket
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                s.sendall(msg.encode())
        except OSError as exc:
            log.debug("sd_notify(%s) failed: %s", msg, exc)

    def _count_error(self, exc: BaseException) -> None:
        self._last_error = f"{type(exc).__name__}: {exc}"
        self.metrics.error(exc)

    def _next_wait(self, ok: bool) -> float:
        """poll_s normally; backoff with jitter while the store fails (never a tight loop). A
        failing engine does not slow polling: its retries have their own schedule."""
        if ok or self._follow_ok:
            return self.config.poll_s
        return self._store_backoff.next_delay()

    def _progress(self, m: Manifest, nbytes: int) -> None:
        """A progress bar on stderr for fetches above PROGRESS_MIN_BYTES (called from fetch threads)."""
        if m.chunk_bytes < PROGRESS_MIN_BYTES:
            return
        with self._bar_lock:
            if self._bar is None or self._bar[0] != m.version:
                from tqdm import tqdm

                if self._bar is not None:
                    self._bar[1].close()
                self._bar = (m.version, tqdm(total=m.chunk_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                                             desc=f"version {m.version} ({m.kind})", leave=False))
            self._bar[1].update(nbytes)

    def _on_apply(self, ev: AppliedVersion) -> None:
        with self._bar_lock:
            if self._bar is not None:
                self._bar[1].close()
                self._bar = None
        self._last_applied = ev
        if self._updates:
            st = self._state
            self._changes.add(ev.version, ev.changes, st.engine_version if st is not None else None)
        self.keeper.on_applied(ev)
        self.metrics.fetched(ev.bytes_fetched, ev.fetch_seconds)
        self.metrics.apply_seconds.observe(ev.apply_seconds)

    def _sync_stats(self) -> None:
        """Carry the subscriber's counters over to the metrics (as increments)."""
        s, last = self.subscriber.stats, self._stats_seen
        if s.checksum_failures > last[0]:
            for _ in range(s.checksum_failures - last[0]):
                self.metrics.checksum_failure()
        if s.refetches > last[1]:
            self.metrics.retry("fetch", s.refetches - last[1])
        self._stats_seen = (s.checksum_failures, s.refetches)


def _seconds(unix_ms: int | None) -> float | None:
    return None if unix_ms is None else unix_ms / 1000


def _warm_up(stop: threading.Event) -> None:
    """Load the codec's compiled loops (a failure costs only the time it was meant to save)."""
    t0 = time.monotonic()
    try:
        from ..codec.warm import warm_up
        warm_up(stop)
    except Exception as exc:  # noqa: BLE001 - the loops load on first use instead
        log.warning("warming up the codec's compiled loops failed (%s): they load when first used", exc)
        return
    log.debug("codec loops warmed up in %.2fs", time.monotonic() - t0)
