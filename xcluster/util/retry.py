"""The one retry policy xcluster applies to object-store calls.

*What is transient* is an explicit list: throttling (``SlowDown``, 429, 503), server errors
500/502/504, connection resets and refusals, timeouts, and short reads (a body that ends before
its ``Content-Length`` or requested range). Everything else — a failed precondition (412/409), a
missing object (404), access denied (403), a bad request — is raised at once.

*How* to retry: exponential backoff with jitter, bounded by both attempts and elapsed time
(``stop_after_attempt(n) | stop_after_delay(s)``). ``sleep`` is injected so tests of the backoff
do not wait. When the budget is spent, :class:`~xcluster.errors.RetriesExhaustedError` is raised
with the last failure as its ``__cause__``.

*Integrity* failures (bytes that arrive but fail their size or checksum) are never transient to
the store's policy: the reader that checks the bytes re-fetches them itself, a fixed number of
times and at once, with :func:`retry_integrity` — the same tenacity loop, its own predicate
(:data:`REFETCH_ERRORS`), and the last failure raised as it is (a named integrity error).

botocore is never imported here: an exception can only be a botocore one if botocore is already
loaded, so it is looked up in ``sys.modules``.
"""

from __future__ import annotations

import functools
import logging
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import tenacity

from ..errors import (ChecksumMismatchError, ConfigError, RetriesExhaustedError, TransientStoreError,
                      TruncatedObjectError, XclusterError)

log = logging.getLogger(__name__)
T = TypeVar("T")

#: HTTP statuses that mean "try again": throttling and server-side failures.
TRANSIENT_HTTP_STATUS = frozenset({429, 500, 502, 503, 504})
#: S3 error codes that mean "try again", whatever status they come with (RequestTimeout is a 400).
TRANSIENT_ERROR_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "TooManyRequestsException", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable",
})
#: botocore exception classes for resets, refusals, timeouts and truncated bodies.
_BOTOCORE_TRANSIENT = (
    "ConnectionError",  # EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError
    "HTTPClientError",  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    "IncompleteReadError",  # body shorter than Content-Length
    "FlexibleChecksumError",  # botocore's own body checksum failed: fetch the bytes again
)


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` is on the list of failures worth retrying (see the module docstring)."""
    if isinstance(exc, TransientStoreError):
        return True
    if isinstance(exc, XclusterError):
        return False  # preconditions, not-found, integrity: never retried
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:  # botocore ClientError
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in TRANSIENT_ERROR_CODES or status in TRANSIENT_HTTP_STATUS
    bce = sys.modules.get("botocore.exceptions")
    if bce is not None and isinstance(exc, tuple(getattr(bce, n) for n in _BOTOCORE_TRANSIENT)):
        return True
    parsers = sys.modules.get("botocore.parsers")  # a garbled (truncated) response document
    if parsers is not None and isinstance(exc, parsers.ResponseParserError):
        return True
    return isinstance(exc, (ConnectionError, TimeoutError))  # stdlib resets, refusals, timeouts


@dataclass
class Backoff:
    """Exponential backoff with full jitter between ``base`` and ``cap`` seconds, for loops that
    poll (the daemon, the relay): ``next_delay()`` after each failure, ``reset()`` after a success."""

    base: float
    cap: float
    failures: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def next_delay(self) -> float:
        self.failures += 1
        return self.rng.uniform(self.base, min(self.cap, self.base * 2 ** self.failures))

    def reset(self) -> None:
        self.failures = 0


@dataclass(kw_only=True, frozen=True)
class RetryPolicy:
    """Bounds and backoff of the retry loop. Worst case wall time ≈ ``deadline_s`` plus one
    request timeout (an attempt in flight is not interrupted)."""

    attempts: int = 6
    """Most attempts per request, the first included (1 = never retry)."""
    deadline_s: float = 120.0
    """No new attempt starts after this many seconds since the first one."""
    initial_backoff_s: float = 0.1
    """Wait before the second attempt; it doubles each time, plus up to ``jitter_s`` at random."""
    max_backoff_s: float = 5.0
    """Cap of a single wait."""
    jitter_s: float = 0.1
    """Random extra wait in [0, jitter_s] so that parallel parts do not retry in lock-step."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"retry attempts must be ≥ 1 (1 means no retry), got {self.attempts}")
        if self.deadline_s <= 0:
            raise ConfigError(f"retry deadline_s must be > 0 seconds, got {self.deadline_s}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ConfigError("retry backoff needs 0 ≤ initial_backoff_s ≤ max_backoff_s, got "
                              f"{self.initial_backoff_s} and {self.max_backoff_s}")
        if self.jitter_s < 0:
            raise ConfigError(f"retry jitter_s must be ≥ 0, got {self.jitter_s}")


def retrying(policy: RetryPolicy, *, sleep: Callable[[float], None] = time.sleep,
             on_retry: Callable[[BaseException, int], None] | None = None) -> tenacity.Retrying:
    """A :class:`tenacity.Retrying` for ``policy``; ``on_retry(exc, attempt)`` runs before each wait."""

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        # the failure as text: a handler that keeps records (log capture) would otherwise keep it,
        # and through its traceback every caller's frame
        log.warning("transient store failure (attempt %d of %d), retrying: %s",
                    state.attempt_number, policy.attempts, repr(exc))
        if on_retry is not None and exc is not None:
            on_retry(exc, state.attempt_number)

    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        stop=tenacity.stop_after_attempt(policy.attempts) | tenacity.stop_after_delay(policy.deadline_s),
        wait=tenacity.wait_exponential_jitter(multiplier=policy.initial_backoff_s,
                                              max=policy.max_backoff_s, jitter=policy.jitter_s),
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=False,
    )


def call_with_retries(what: str, fn: Callable[[], T], retryer: tenacity.Retrying, *,
                      exhausted: Callable[[tenacity.Future], BaseException] | None = None) -> T:
    """Run ``fn`` under ``retryer``; on a spent budget raise ``exhausted(last attempt)`` (default:
    :class:`RetriesExhaustedError` naming ``what``, the object and operation), chained to the last
    failure.

    A failure leaves no reference cycle behind: see :func:`release_failures`."""
    try:
        return retryer(fn)
    except tenacity.RetryError as err:
        release_failures(err, err.last_attempt.exception())
        raise (exhausted or functools.partial(_exhausted, what))(err.last_attempt) \
            from err.last_attempt.exception()
    except BaseException as exc:
        release_failures(exc)
        raise


def _exhausted(what: str, last: tenacity.Future) -> RetriesExhaustedError:
    # built here, not in call_with_retries: a local there holding the last failure would be a
    # cycle (the failure's traceback holds that frame)
    return RetriesExhaustedError(
        f"{what}: still failing after {last.attempt_number} attempts ({last.exception()!r}); the store is "
        "unreachable or overloaded — check the endpoint, or raise the retry attempts/deadline")


#: Integrity failures worth fetching the bytes again for: a body whose checksum or size is wrong
#: (corrupt in transit, or a torn read). A digest, signature or decompression-bomb failure is not:
#: the same bytes would fail the same way.
REFETCH_ERRORS: tuple[type[XclusterError], ...] = (ChecksumMismatchError, TruncatedObjectError)


def retry_integrity(fn: Callable[[], T], *, attempts: int,
                    on_failure: Callable[[BaseException, int], None] | None = None,
                    on_retry: Callable[[BaseException, int], None] | None = None,
                    retry_on: type[BaseException] | tuple[type[BaseException], ...] = REFETCH_ERRORS,
                    backoff_s: float = 0.0, sleep: Callable[[float], None] = time.sleep) -> T:
    """Run ``fn`` (fetch some bytes and check them) up to ``attempts`` times, the first included,
    while it raises ``retry_on``; return its first result. Anything else ``fn`` raises is raised at
    once; when every attempt failed, the last failure is raised as it is (not wrapped).

    ``on_failure(exc, attempt)`` runs after every failed attempt, the last included (counters of
    failures, a log line); ``on_retry(exc, attempt)`` only before another attempt (counters of
    re-fetches). Between attempts it waits ``backoff_s`` seconds through ``sleep`` (injected, as
    for :func:`retrying`); with the default 0 it never sleeps.

    A failure leaves no reference cycle behind (see :func:`release_failures`): ``fn``'s frames,
    with the bytes they fetched, go as soon as the error is dropped."""
    if attempts < 1:
        raise ConfigError(f"integrity attempts must be ≥ 1 (1 means no re-fetch), got {attempts}")
    if backoff_s < 0:
        raise ConfigError(f"integrity backoff_s must be ≥ 0 seconds, got {backoff_s}")

    def after(state: tenacity.RetryCallState) -> None:
        if on_failure is not None and state.outcome is not None:
            on_failure(state.outcome.exception(), state.attempt_number)

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            on_retry(state.outcome.exception(), state.attempt_number)

    def pause(seconds: float) -> None:
        if seconds > 0:  # tenacity calls sleep(0) between attempts without a wait: skip it
            sleep(seconds)

    retryer = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(retry_on),
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_fixed(backoff_s),
        sleep=pause,
        after=after,
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        return retryer(fn)
    except BaseException as exc:
        release_failures(exc)
        raise


def release_failures(*failures: BaseException | None) -> None:
    """Clear the locals of the finished frames on the failures' tracebacks.

    tenacity keeps each failure in its retry state, a local of its own frame on that failure's
    traceback: a reference cycle. Every frame reaches its callers' through ``f_back``, so the
    cycle would hold all of them, with their locals (a publisher's: the caller's weights), until
    the cycle collector happens to run: up to a model's worth of memory kept past the publish
    (bench/memory.py). Frames still running (ours and above) are left alone; so are callers'
    locals, so nothing there may hold a failure either."""
    for exc in failures:
        if exc is not None:
            traceback.clear_frames(exc.__traceback__)
