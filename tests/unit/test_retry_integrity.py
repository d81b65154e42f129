"""``retry_integrity``: the one tenacity loop every reader uses to fetch bytes again when they fail
their size or checksum (chain.py manifests, fetch.py chunks, the relay's copies)."""

from __future__ import annotations

import pytest

from xcluster.errors import (ChainBrokenError, ChecksumMismatchError, ConfigError, DecompressionBombError,
                             DigestMismatchError, TruncatedObjectError)
from xcluster.util.retry import retry_integrity


def _flaky(errors: list[BaseException], result: object = "ok"):
    calls = []

    def fn():
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return result
    return fn, calls


def test_returns_the_first_good_attempt_without_sleeping():
    fn, calls = _flaky([ChecksumMismatchError("a"), TruncatedObjectError("b")])
    failures, retries, slept = [], [], []
    got = retry_integrity(fn, attempts=3, on_failure=lambda e, n: failures.append((type(e), n)),
                          on_retry=lambda e, n: retries.append(n), sleep=slept.append)
    assert got == "ok" and len(calls) == 3
    assert failures == [(ChecksumMismatchError, 1), (TruncatedObjectError, 2)]
    assert retries == [1, 2]
    assert slept == []  # no wait between integrity attempts unless asked for


def test_the_last_failure_is_raised_as_it_is_after_every_attempt():
    last = ChecksumMismatchError("third")
    fn, calls = _flaky([ChecksumMismatchError("first"), ChecksumMismatchError("second"), last])
    failures, retries = [], []
    with pytest.raises(ChecksumMismatchError) as info:
        retry_integrity(fn, attempts=3, on_failure=lambda e, n: failures.append(n),
                        on_retry=lambda e, n: retries.append(n))
    assert info.value is last and type(info.value) is ChecksumMismatchError
    assert len(calls) == 3
    assert failures == [1, 2, 3]  # every failure, the last included
    assert retries == [1, 2]  # only before another attempt


@pytest.mark.parametrize("exc", [ChainBrokenError("missing"), DigestMismatchError("same bytes, same digest"),
                                 DecompressionBombError("bomb"), OSError("disk")])
def test_other_failures_are_raised_at_once(exc):
    fn, calls = _flaky([exc])
    failures = []
    with pytest.raises(type(exc)) as info:
        retry_integrity(fn, attempts=5, on_failure=lambda e, n: failures.append(n))
    assert info.value is exc and len(calls) == 1 and failures == []


def test_one_attempt_never_retries_and_retry_on_narrows_what_is_retried():
    fn, calls = _flaky([ChecksumMismatchError("x")])
    with pytest.raises(ChecksumMismatchError):
        retry_integrity(fn, attempts=1)
    assert len(calls) == 1
    fn, calls = _flaky([TruncatedObjectError("short")])
    with pytest.raises(TruncatedObjectError):
        retry_integrity(fn, attempts=3, retry_on=ChecksumMismatchError)
    assert len(calls) == 1


def test_backoff_goes_through_the_injected_sleep():
    fn, _ = _flaky([ChecksumMismatchError("a"), ChecksumMismatchError("b")])
    slept = []
    assert retry_integrity(fn, attempts=3, backoff_s=0.25, sleep=slept.append) == "ok"
    assert slept == [0.25, 0.25]


@pytest.mark.parametrize("kw", [dict(attempts=0), dict(attempts=2, backoff_s=-1.0)])
def test_bad_bounds_are_config_errors(kw):
    with pytest.raises(ConfigError):
        retry_integrity(lambda: None, **kw)
