"""Prometheus metrics of the subscriber daemon, and the HTTP exporter that serves them.

Every :class:`DaemonMetrics` has its own :class:`~prometheus_client.CollectorRegistry` unless one
is given, so two daemons (or many tests) in one process never clash over metric names.

Names follow Prometheus conventions: an ``xcluster_`` prefix, base units (seconds, bytes),
``_total`` on counters (prometheus-client appends it), ``_info`` on the info metric.

==============================================  =========  ============================================
metric                                          type       meaning
==============================================  =========  ============================================
xcluster_applied_version                        gauge      version the model directory / engine has
                                                           (NaN before the first)
xcluster_versions_behind                        gauge      HEAD version minus the applied version
xcluster_staleness_seconds                      gauge      now minus the applied version's commit time,
                                                           computed at scrape time (NaN before the first)
xcluster_fetched_bytes_total                    counter    bytes fetched from the store
xcluster_fetch_duration_seconds                 histogram  fetching one version's objects
xcluster_apply_duration_seconds                 histogram  applying one version to the weights
xcluster_write_dir_duration_seconds             histogram  writing one version directory
xcluster_handoff_duration_seconds               histogram  one successful hand-off to the engine
xcluster_engine_pause_duration_seconds          histogram  how long the engine paused generation
xcluster_retries_total{operation}               counter    retries (not first attempts) per operation
xcluster_checksum_failures_total                counter    chunks whose bytes did not match
xcluster_handoff_failures_total                 counter    hand-offs that raised
xcluster_errors_total{type}                     counter    errors by exception class name
xcluster_versions_applied_total                 counter    versions applied
xcluster_handoffs_total                         counter    successful hand-offs
xcluster_engine_updates_total{method}           counter    successful hand-offs by how the engine got the
                                                           weights: in-place, reload, in-place-then-reload
xcluster_engine_verified_total{result}          counter    engine weight checks (its workers' hashes against
                                                           the slot): match / mismatch
xcluster_daemon_info{…}                         info       source, engine, out dir, xcluster version
xcluster_engine_state{xcluster_engine_state}    stateset   unknown / loading / serving / failed
                                                           (1 on the current state)
==============================================  =========  ============================================
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info

from ..errors import ConfigError, EngineWeightsMismatchError

if TYPE_CHECKING:
    from .handoff import HandoffResult

#: Histogram buckets from 1 ms to 10 min, roughly 1-2.5-5 per decade.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0, 600.0)
ENGINE_STATES = ("unknown", "loading", "serving", "failed")


class DaemonMetrics:
    """The daemon's metrics. Metric objects are public attributes; the methods below update the
    ones that change together."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self._committed_at: float | None = None
        self._applied: int | None = None
        self._lock = threading.Lock()
        reg = self.registry

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=SECONDS_BUCKETS, registry=reg)

        self.applied_version = Gauge("xcluster_applied_version", "Version the model directory and engine have.",
                                     registry=reg)
        self.versions_behind = Gauge("xcluster_versions_behind", "HEAD version minus the applied version.",
                                     registry=reg)
        self.staleness_seconds = Gauge("xcluster_staleness_seconds",
                                       "Seconds since the applied version was committed (NaN before the first).",
                                       registry=reg)
        self.staleness_seconds.set_function(self._staleness)
        self.applied_version.set(math.nan)  # unknown until the first version is applied
        self.versions_behind.set(math.nan)
        self.fetched_bytes = Counter("xcluster_fetched_bytes", "Bytes fetched from the store.", registry=reg)
        self.fetch_seconds = histogram("xcluster_fetch_duration_seconds", "Seconds fetching one version.")
        self.apply_seconds = histogram("xcluster_apply_duration_seconds", "Seconds applying one version.")
        self.write_dir_seconds = histogram("xcluster_write_dir_duration_seconds",
                                           "Seconds making one version's slot durable and current.")
        self.slot_bytes_written = Counter("xcluster_slot_bytes_written",
                                          "Bytes written into the slots, by how (patch: changed elements; "
                                          "full: whole files; copy: a slot repaired from the other).",
                                          ["how"], registry=reg)
        self.catch_up_seconds = histogram("xcluster_catch_up_duration_seconds",
                                          "Seconds bringing the standby slot to the current version.")
        self.handoff_seconds = histogram("xcluster_handoff_duration_seconds", "Seconds of one successful hand-off.")
        self.engine_pause_seconds = histogram("xcluster_engine_pause_duration_seconds",
                                              "Seconds the engine paused generation during a hand-off.")
        self.retries = Counter("xcluster_retries", "Retries (beyond first attempts) by operation.",
                               ["operation"], registry=reg)
        self.checksum_failures = Counter("xcluster_checksum_failures", "Chunks whose bytes did not match.",
                                         registry=reg)
        self.handoff_failures = Counter("xcluster_handoff_failures", "Hand-offs that failed.", registry=reg)
        self.errors = Counter("xcluster_errors", "Errors by exception class.", ["type"], registry=reg)
        self.versions_applied = Counter("xcluster_versions_applied", "Versions applied.", registry=reg)
        self.handoffs = Counter("xcluster_handoffs", "Successful hand-offs.", registry=reg)
        self.engine_updates = Counter("xcluster_engine_updates", "Successful hand-offs by how the engine got the "
                                      "weights (in-place, reload, in-place-then-reload).", ["method"], registry=reg)
        self.engine_verified = Counter("xcluster_engine_verified", "Checks of the engine's loaded weights against "
                                       "the installed slot, by result (match, mismatch).", ["result"], registry=reg)
        self.checkpoints_written = Counter("xcluster_checkpoints_written",
                                           "Checkpoints this node wrote into the store it follows.", registry=reg)
        self.info = Info("xcluster_daemon", "What this daemon follows and feeds.", registry=reg)
        self.engine_state = Enum("xcluster_engine_state", "State of the engine hand-off.", states=ENGINE_STATES,
                                 registry=reg)

    # --- updates ---------------------------------------------------------------------------------
    def version_applied(self, version: int, *, committed_at: float | None, head_version: int | None = None,
                        resumed: bool = False) -> None:
        """A version is applied; ``committed_at`` is its commit time (Unix seconds, None if not
        known). ``resumed``: taken over from disk at start-up, not applied now (not counted)."""
        with self._lock:
            self._committed_at = None if committed_at is None else float(committed_at)
            self._applied = version
        self.applied_version.set(version)
        if not resumed:
            self.versions_applied.inc()
        self.head_seen(version if head_version is None else head_version)

    def head_seen(self, head_version: int) -> None:
        """The latest HEAD version read from the store; versions_behind follows from it (NaN while
        no version is applied)."""
        with self._lock:
            applied = self._applied
        self.versions_behind.set(math.nan if applied is None else max(0, head_version - applied))

    def fetched(self, nbytes: int, seconds: float) -> None:
        self.fetched_bytes.inc(nbytes)
        self.fetch_seconds.observe(seconds)

    def handoff_done(self, result: HandoffResult) -> None:
        """Record a successful hand-off (its retries count under operation="handoff")."""
        self.handoffs.inc()
        self.handoff_seconds.observe(result.seconds)
        method = result.method if result.method in ("in-place", "reload") else "in-place-then-reload"
        self.engine_updates.labels(method=method).inc()
        if method == "in-place-then-reload":
            self.engine_verified.labels(result="mismatch").inc()
        if result.verified:
            self.engine_verified.labels(result="match").inc()
        if result.pause_seconds is not None:
            self.engine_pause_seconds.observe(result.pause_seconds)
        if result.attempts > 1:
            self.retries.labels(operation="handoff").inc(result.attempts - 1)
        self.engine_state.state("serving")

    def handoff_failed(self, exc: BaseException) -> None:
        self.handoff_failures.inc()
        if isinstance(exc, EngineWeightsMismatchError):
            self.engine_verified.labels(result="mismatch").inc()
        self.error(exc)
        self.engine_state.state("failed")

    def error(self, exc: BaseException) -> None:
        """Count an error under its exception class name (a bounded label set)."""
        self.errors.labels(type=type(exc).__name__).inc()

    def retry(self, operation: str, n: int = 1) -> None:
        self.retries.labels(operation=operation).inc(n)

    def checksum_failure(self) -> None:
        self.checksum_failures.inc()

    def set_engine_state(self, state: str) -> None:
        if state not in ENGINE_STATES:
            raise ConfigError(f"engine state must be one of {', '.join(ENGINE_STATES)}, got {state!r}")
        self.engine_state.state(state)

    def set_info(self, **labels: str) -> None:
        """Describe the daemon, e.g. ``set_info(source=url, engine="vllm", out=dir)``."""
        self.info.info({k: str(v) for k, v in labels.items()})

    def _staleness(self) -> float:
        with self._lock:
            committed = self._committed_at
        return math.nan if committed is None else max(0.0, self._clock() - committed)

    # --- export ----------------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve ``/metrics`` over HTTP on ``addr:port`` (port 0 picks a free one) in a daemon thread."""
        from prometheus_client import start_http_server

        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"metrics port must be an int in 0..65535, got {port!r}")
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        return MetricsServer(server, thread)


class MetricsServer:
    """A running exporter; ``shutdown()`` stops it and frees the port (also as a context manager)."""

    def __init__(self, server, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.addr, self.port = server.server_address[:2]

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
