"""What every part of the S3 backend shares: one :class:`S3Context` per store.

It holds the client, bucket, prefix, config and counters, and runs each request under the retry
policy (:meth:`S3Context.run`) and many at a time (:meth:`S3Context.parallel`). ``transfer`` and
``conditional`` get one from the store instead of the store itself, so neither imports
``store``. Also here: how botocore failures map to xcluster errors, and the names of the object
metadata xcluster writes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ...errors import (ObjectNotFoundError, PreconditionFailedError, RetriesExhaustedError,
                       StoreError, XclusterError)
from ...util.failures import raise_first_failure
from ...util.retry import call_with_retries, retrying
from ..base import check_key
from .config import S3Config

T = TypeVar("T")

META_WRITE_ID = "xc-wid"  # random per put(): tells our own landed write from a rival's
META_BLOCK = "xc-block"  # bytes per hashed block
META_HASHES = "xc-xxh3"  # comma-separated xxh3-64 hex, one per block


def status_of(exc: BaseException) -> tuple[int | None, str]:
    """HTTP status and S3 error code of a botocore ClientError, else ``(None, "")``."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, ""
    return (response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
            str(response.get("Error", {}).get("Code", "")))


def translate(exc: BaseException, what: str) -> BaseException:
    """Map a non-transient botocore failure to the xcluster error a caller can act on."""
    status, code = status_of(exc)
    if status == 404 or code in ("NoSuchKey", "NotFound", "NoSuchUpload"):
        if code == "NoSuchBucket":
            return StoreError(f"{what}: the bucket does not exist; create it first")
        return ObjectNotFoundError(f"{what}: no such object ({code or status})")
    if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
        return PreconditionFailedError(f"{what}: precondition failed ({code or status}): another "
                                       "writer changed or created the object first")
    if status == 403:
        return StoreError(f"{what}: access denied (403 {code}); check the credentials and the "
                          "bucket policy")
    if status is not None:
        return StoreError(f"{what}: HTTP {status} {code}: {exc}")
    return StoreError(f"{what}: {exc!r}")


@dataclass
class S3Stats:
    """Counters a test or a benchmark can read (updated under a lock)."""

    requests: int = 0
    retries: int = 0
    multipart_uploads: int = 0
    parts_uploaded: int = 0
    parts_downloaded: int = 0
    aborted_uploads: int = 0
    max_parts_in_flight: int = 0
    corrupt_reads: int = 0


@dataclass(kw_only=True, eq=False)
class S3Context:
    """One store's client, place and counters, and how it runs requests.

    ``prefix`` is empty or ends in ``/``; ``url`` is ``s3://bucket[/prefix]`` without it.
    ``lock`` guards ``stats`` and anything else a helper keeps per store.
    """

    client: Any
    bucket: str
    prefix: str
    url: str
    config: S3Config
    sleep: Callable[[float], None]
    stats: S3Stats = field(default_factory=S3Stats)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _in_flight: int = 0

    def full(self, key: str) -> str:
        """The object key of store key ``key`` (checked)."""
        return self.prefix + check_key(key)

    def where(self, key: str) -> str:
        """``key`` as a URL, for messages."""
        return f"{self.url}/{key}"

    def count(self, **inc: int) -> None:
        with self.lock:
            for name, n in inc.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def run(self, what: str, fn: Callable[[], T]) -> T:
        """One request under the retry policy; failures become xcluster errors."""
        def attempt() -> T:
            self.count(requests=1)
            return fn()

        retryer = retrying(self.config.retry, sleep=self.sleep,
                           on_retry=lambda exc, n: self.count(retries=1))
        try:
            return call_with_retries(what, attempt, retryer)
        except (XclusterError, RetriesExhaustedError):
            raise
        except Exception as exc:
            if status_of(exc)[0] is None and type(exc).__module__.split(".")[0] not in ("botocore",
                                                                                     "urllib3"):
                raise  # a programming error, not a store failure
            raise translate(exc, what) from exc

    def head(self, key: str) -> dict:
        """HEAD of store key ``key`` (:class:`~xcluster.errors.ObjectNotFoundError` if none)."""
        full = self.full(key)
        return self.run(f"{self.where(key)}: head",
                        lambda: self.client.head_object(Bucket=self.bucket, Key=full))

    def parallel(self, fn: Callable[[int], T], count: int) -> list[T]:
        """``[fn(0), …, fn(count-1)]``, ``max_concurrency`` at a time; the first failure cancels
        what has not started, waits for what has, and is raised."""
        results: list[Any] = [None] * count

        def tracked(i: int) -> None:
            with self.lock:
                self._in_flight += 1
                self.stats.max_parts_in_flight = max(self.stats.max_parts_in_flight,
                                                     self._in_flight)
            try:
                results[i] = fn(i)
            finally:
                with self.lock:
                    self._in_flight -= 1

        workers = min(self.config.max_concurrency, count)
        with ThreadPoolExecutor(workers, thread_name_prefix="xc-s3") as pool:
            futures = [pool.submit(tracked, i) for i in range(count)]
            wait(futures, return_when=FIRST_EXCEPTION)
            raise_first_failure(futures, cancel_pending=True)
        return results
