"""A failed store call leaves no reference cycle behind.

tenacity keeps the failure in its retry state, a local of a frame on that failure's own
traceback: a cycle, and through the frames' ``f_back`` it held every caller's frame (a
publisher's, with the model's weights in its locals) until the cycle collector happened to run.
On S3 that was one model's worth of memory at the next version (bench/memory.py).
"""

from __future__ import annotations

import gc
import weakref

import pytest

from xcluster.errors import ObjectNotFoundError, RetriesExhaustedError, TransientStoreError
from xcluster.util.retry import RetryPolicy, call_with_retries, retrying

NO_WAIT = RetryPolicy(attempts=3, initial_backoff_s=0.0, max_backoff_s=0.0, jitter_s=0.0)


class _Weights:
    """Stands for a caller's tensors: something only that caller's frame holds."""


def _caller_of(fn) -> tuple[weakref.ref, BaseException]:
    weights = _Weights()
    try:
        call_with_retries("s3://b/k: get", fn, retrying(NO_WAIT, sleep=lambda s: None))
    except Exception as exc:
        return weakref.ref(weights), exc
    raise AssertionError("the call did not fail")


def _missing():
    raise ObjectNotFoundError("s3://b/k: no such object")


def _transient():
    raise TransientStoreError("s3://b/k: 503")


@pytest.mark.parametrize("fn, raised", [(_missing, ObjectNotFoundError), (_transient, RetriesExhaustedError)],
                         ids=["not retried", "retries exhausted"])
def test_a_failed_call_keeps_no_caller_alive(fn, raised):
    gc.collect()
    gc.disable()  # what reference counting alone frees
    try:
        ref, exc = _caller_of(fn)
        assert isinstance(exc, raised)
        del exc
        assert ref() is None, "the caller's frame outlived the call: a reference cycle holds it"
    finally:
        gc.enable()


def test_a_failed_engine_hand_off_keeps_no_caller_alive(tmp_path):
    from xcluster.errors import HandoffError
    from xcluster.follow.handoff import EXIT_TEMPFAIL, ExecHandoff, HandoffConfig

    engine = ExecHandoff(["sh", "-c", f"exit {EXIT_TEMPFAIL}"], sleep=lambda s: None,
                         config=HandoffConfig(attempts=2, backoff_s=0.0, backoff_max_s=0.0))

    def caller() -> tuple[weakref.ref, BaseException]:
        weights = _Weights()
        try:
            engine.hand_over(tmp_path, 1)
        except HandoffError as exc:
            return weakref.ref(weights), exc
        raise AssertionError("the hand-off did not fail")

    gc.collect()
    gc.disable()
    try:
        ref, exc = caller()
        assert "still failing after 2 attempts" in str(exc)
        del exc
        assert ref() is None, "the caller's frame outlived the hand-off: a reference cycle holds it"
    finally:
        gc.enable()


def test_a_failed_integrity_retry_keeps_no_caller_alive():
    """The bytes of a chunk that never verified, and the caller's frame, go with the error."""
    from xcluster.errors import ChecksumMismatchError
    from xcluster.util.retry import retry_integrity

    fetched: list[weakref.ref] = []

    def fetch():
        data = _Weights()  # stands for the bytes fetched, a local of the failed attempt
        fetched.append(weakref.ref(data))
        raise ChecksumMismatchError("s3://b/k hashes to 0, the manifest says 1")

    def caller() -> tuple[weakref.ref, BaseException]:
        weights = _Weights()
        try:
            retry_integrity(fetch, attempts=3)
        except ChecksumMismatchError as exc:
            return weakref.ref(weights), exc
        raise AssertionError("the fetch did not fail")

    gc.collect()
    gc.disable()
    try:
        ref, exc = caller()
        assert len(fetched) == 3
        del exc
        assert ref() is None, "the caller's frame outlived the fetch: a reference cycle holds it"
        assert all(r() is None for r in fetched), "a failed attempt's bytes outlived it"
    finally:
        gc.enable()
