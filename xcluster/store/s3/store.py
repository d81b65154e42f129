"""S3 backend: ``s3://bucket/prefix`` on AWS S3 or any S3-compatible server.

Data path. An object up to ``multipart_threshold`` is one PUT / one GET. A larger one goes up as
a multipart upload whose parts (``part_size`` each) are sent in parallel, ``max_concurrency`` at
a time, each part retried on its own; any failure aborts the upload, so no parts are left behind.
A large object comes down as parallel ranged GETs, each read straight into one preallocated
buffer whose size (from the first response's headers) is checked against ``max_object_size``
first; every ranged GET carries ``If-Match`` so an object replaced mid-download is noticed.

Commit safety. ``put(if_none_match=True)`` sends ``If-None-Match: *`` and ``put(if_match=etag)``
sends ``If-Match``; a 412 (or a 409 ConditionalRequestConflict) is a
:class:`~xcluster.errors.PreconditionFailedError`. Before the first conditional write the store
checks once that the server enforces them (see ``S3Config.require_conditional_writes``). When a
conditional write is retried after a lost response, a 412 may be our own first attempt: each
write carries a random id in its metadata, and a HEAD tells the two cases apart.

Integrity. Each write records an xxh3-64 per block in the object's metadata; reads check it
and re-fetch what does not match (flipped bytes on the wire). ``get_range`` is not checked (it
may cover part of a block); callers that need it check the bytes themselves.

Retries follow :mod:`xcluster.retry`; botocore's own are off (one attempt per call).
"""

from __future__ import annotations

import io
import logging
import threading
import time
import uuid
import warnings
from urllib.parse import urlencode
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from ...errors import (ConditionalWritesUnsupportedError, CorruptReadError, ObjectNotFoundError,
                      ObjectTooLargeError, PreconditionFailedError, RetriesExhaustedError,
                      ShortReadError, StoreError, XclusterError)
from ...util.failures import raise_first_failure
from ...util.retry import call_with_retries, retrying
from ..base import Blob, Stat, check_key, check_prefix
from .config import S3_MAX_PARTS, S3Config

__all__ = ["S3Config", "S3Store", "S3Stats"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_META_WRITE_ID = "xc-wid"  # random per put(): tells our own landed write from a rival's
_META_BLOCK = "xc-block"  # bytes per hashed block
_META_HASHES = "xc-xxh3"  # comma-separated xxh3-64 hex, one per block
_MAX_HASH_CHARS = 1700  # S3 allows 2 KiB of user metadata in all
_PROBE_PREFIX = "_xcluster-probe/"
_NO_SUCH_ETAG = '"00000000000000000000000000000000"'


def _import_boto3() -> Any:
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(f"s3:// URLs need boto3: pip install 'xcluster[s3]' ({exc})") from exc
    return boto3


def _status(exc: BaseException) -> tuple[int | None, str]:
    """HTTP status and S3 error code of a botocore ClientError, else ``(None, "")``."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, ""
    return (response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
            str(response.get("Error", {}).get("Code", "")))


def _translate(exc: BaseException, what: str) -> BaseException:
    """Map a non-transient botocore failure to the xcluster error a caller can act on."""
    status, code = _status(exc)
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


def _content_range(response: dict, what: str) -> tuple[int, int, int]:
    """``(first, last, total)`` from a 206 response's Content-Range."""
    value = response.get("ContentRange") or ""
    try:
        unit, rest = value.split(" ", 1)
        span, total = rest.split("/", 1)
        first, last = span.split("-", 1)
        assert unit == "bytes"
        return int(first), int(last), int(total)
    except (ValueError, AssertionError):
        raise StoreError(f"{what}: the server answered a ranged GET without a valid Content-Range "
                         f"({value!r}); it does not support Range requests") from None


_READ_PIECE = 1 << 20  # urllib3's readinto reads into a temporary of the size asked for: keep it small


def _read_into(body: Any, out: memoryview, what: str) -> None:
    """Fill ``out`` from a streaming body, a MiB at a time; fewer bytes than ``len(out)`` is a short read."""
    filled = 0
    try:
        while filled < len(out):
            n = body.readinto(out[filled:filled + _READ_PIECE])
            if not n:
                break
            filled += n
    finally:
        body.close()
    if filled != len(out):
        raise ShortReadError(f"{what}: body ended after {filled} of {len(out)} bytes")


class _ViewReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview: botocore reads a request body from it a
    piece at a time (hashing, signing, sending), so the caller's buffer is never copied whole."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._view)

    def __bool__(self) -> bool:  # an empty body is still a body
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def _body(data: Any, view: memoryview) -> Any:
    """A request body for ``data`` that copies nothing: bytes-like objects botocore takes as they
    are, anything else (a memoryview, a slice of one) as a :class:`_ViewReader` over it."""
    return data if isinstance(data, (bytes, bytearray)) else _ViewReader(view)


def _block_hashes(data: memoryview, block: int) -> list[str]:
    if len(data) == 0:
        return [xxhash.xxh3_64_hexdigest(b"")]
    return [xxhash.xxh3_64_hexdigest(data[i:i + block]) for i in range(0, len(data), block)]


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


class S3Store:
    """A :class:`~xcluster.store.base.Store` on ``s3://bucket/prefix``.

    ``client`` (a boto3 S3 client) and ``sleep`` are for tests; by default the client is built
    from ``config`` and the standard AWS chain, with botocore's retries off.
    """

    def __init__(self, bucket: str, prefix: str = "", *, config: S3Config | None = None,
                 client: Any = None, sleep: Callable[[float], None] = time.sleep) -> None:
        if not bucket or "/" in bucket:
            raise StoreError(f"bad bucket name {bucket!r}")
        self.config = config or S3Config()
        self.bucket = bucket
        prefix = check_prefix(prefix, f"s3://{bucket}/{prefix}")
        self._prefix = f"{prefix}/" if prefix else ""
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._sleep = sleep
        self._client = client if client is not None else self._make_client()
        self.stats = S3Stats()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._honoured: dict[str, bool] = {}  # conditional-write feature -> server enforces it
        self._warned_emulation = False

    @classmethod
    def from_url(cls, url: str, config: S3Config | None = None, **kwargs: Any) -> "S3Store":
        """``s3://bucket[/prefix]`` (``s3a://`` is accepted too)."""
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() not in ("s3", "s3a"):
            raise StoreError(f"{url!r} is not an s3:// URL")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise StoreError(f"{url!r} names no bucket: use s3://bucket/prefix")
        check_prefix(prefix, url)  # names the URL as the user wrote it
        return cls(bucket, prefix, config=config, **kwargs)

    def _make_client(self) -> Any:
        boto3 = _import_boto3()
        import botocore.config

        cfg = self.config
        session = boto3.session.Session(profile_name=cfg.profile, region_name=cfg.region)
        return session.client("s3", endpoint_url=cfg.endpoint_url, config=botocore.config.Config(
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
            retries={"total_max_attempts": 1, "mode": "standard"},  # the policy is ours
            max_pool_connections=2 * cfg.max_concurrency + 2,
            s3={"addressing_style": cfg.addressing_style},
            tcp_keepalive=True,
        ))

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # --- plumbing -----------------------------------------------------------------------------
    def _full(self, key: str) -> str:
        return self._prefix + check_key(key)

    def _where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _count(self, **inc: int) -> None:
        with self._lock:
            for name, n in inc.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def _run(self, what: str, fn: Callable[[], T]) -> T:
        """One request under the retry policy; failures become xcluster errors."""
        def attempt() -> T:
            self._count(requests=1)
            return fn()

        retryer = retrying(self.config.retry, sleep=self._sleep,
                           on_retry=lambda exc, n: self._count(retries=1))
        try:
            return call_with_retries(what, attempt, retryer)
        except (XclusterError, RetriesExhaustedError):
            raise
        except Exception as exc:
            if _status(exc)[0] is None and type(exc).__module__.split(".")[0] not in ("botocore",
                                                                                   "urllib3"):
                raise  # a programming error, not a store failure
            raise _translate(exc, what) from exc

    def _parallel(self, fn: Callable[[int], T], count: int) -> list[T]:
        """``[fn(0), …, fn(count-1)]``, ``max_concurrency`` at a time; the first failure cancels
        what has not started, waits for what has, and is raised."""
        results: list[Any] = [None] * count

        def tracked(i: int) -> None:
            with self._lock:
                self._in_flight += 1
                self.stats.max_parts_in_flight = max(self.stats.max_parts_in_flight,
                                                     self._in_flight)
            try:
                results[i] = fn(i)
            finally:
                with self._lock:
                    self._in_flight -= 1

        workers = min(self.config.max_concurrency, count)
        with ThreadPoolExecutor(workers, thread_name_prefix="xc-s3") as pool:
            futures = [pool.submit(tracked, i) for i in range(count)]
            wait(futures, return_when=FIRST_EXCEPTION)
            raise_first_failure(futures, cancel_pending=True)
        return results

    # --- conditional-write support ------------------------------------------------------------
    def _needs_emulation(self, feature: str) -> bool:
        """Whether ``feature`` (e.g. ``"multipart If-Match"``) must be emulated with
        HEAD-then-PUT; probes the server once per feature if configured to."""
        if not self.config.probe_conditional_writes:
            return False
        with self._lock:
            honoured = self._honoured.get(feature)
        if honoured is None:
            honoured = self._probe(feature)
            with self._lock:
                self._honoured[feature] = honoured
        if honoured:
            return False
        message = (f"{self.url}: this server ignores {feature} on writes, so two publishers "
                   "could overwrite one version")
        if self.config.require_conditional_writes:
            raise ConditionalWritesUnsupportedError(
                message + ". Use a server that enforces conditional writes (AWS S3, SeaweedFS "
                "≥ 4, MinIO, R2), or set S3Config(require_conditional_writes=False) to accept a "
                "HEAD-then-PUT check that narrows the race but cannot close it (then run exactly "
                "one publisher per prefix)")
        if not self._warned_emulation:
            self._warned_emulation = True
            text = message + "; falling back to HEAD-then-PUT, which does NOT close the race"
            log.warning(text)
            warnings.warn(text, RuntimeWarning, stacklevel=3)
        return True

    def _probe(self, feature: str) -> bool:
        """Does the server refuse a write that ``feature``'s header forbids? (scratch key)"""
        key = f"{self._prefix}{_PROBE_PREFIX}{uuid.uuid4().hex}"
        what = f"s3://{self.bucket}/{key}: probe of {feature}"
        cond = {"IfNoneMatch": "*"} if feature.endswith("If-None-Match") else {"IfMatch": _NO_SUCH_ETAG}
        client = self._client

        def refused(fn: Callable[[], Any]) -> bool:
            try:
                self._run(what, fn)
                return False
            except (PreconditionFailedError, ObjectNotFoundError):
                return True

        try:
            self._run(what, lambda: client.put_object(Bucket=self.bucket, Key=key, Body=b"1"))
            if not feature.startswith("multipart"):
                result = refused(lambda: client.put_object(Bucket=self.bucket, Key=key, Body=b"2",
                                                           **cond))
            else:
                upload = self._run(what, lambda: client.create_multipart_upload(
                    Bucket=self.bucket, Key=key))["UploadId"]
                try:
                    etag = self._run(what, lambda: client.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=1,
                        Body=b"2"))["ETag"]
                    result = refused(lambda: client.complete_multipart_upload(
                        Bucket=self.bucket, Key=key, UploadId=upload, **cond,
                        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]}))
                finally:
                    self._abort(what, key, upload)
        finally:
            self._run(what, lambda: client.delete_object(Bucket=self.bucket, Key=key))
        if not result:
            log.warning("%s: the server does not enforce it", what)
        return result

    def _emulate_precondition(self, key: str, if_match: str | None, if_none_match: bool) -> None:
        try:
            current: str | None = self.stat(key).etag
        except ObjectNotFoundError:
            current = None
        if if_none_match and current is not None:
            raise PreconditionFailedError(f"{self._where(key)} already exists (HEAD-then-PUT "
                                          "check): another writer created it first")
        if if_match is not None and current != if_match:
            raise PreconditionFailedError(f"{self._where(key)} changed (etag {current}, expected "
                                          f"{if_match}; HEAD-then-PUT check)")

    # --- writes -------------------------------------------------------------------------------
    def put(self, key: str, data: bytes | memoryview, *, if_match: str | None = None,
            if_none_match: bool = False, tags: Mapping[str, str] | None = None) -> str:
        full = self._full(key)
        extra = {"Tagging": urlencode(dict(tags))} if tags else {}
        if if_match is not None and if_none_match:
            raise ValueError("if_match and if_none_match are exclusive")
        view = memoryview(data).cast("B")
        cond: dict[str, str] = {}
        if if_none_match:
            cond["IfNoneMatch"] = "*"
        elif if_match is not None:
            cond["IfMatch"] = if_match
        multipart = len(view) > self.config.multipart_threshold
        if cond and self._needs_emulation(("multipart " if multipart else "") + next(iter(cond))
                                          .replace("IfNoneMatch", "If-None-Match")
                                          .replace("IfMatch", "If-Match")):
            self._emulate_precondition(key, if_match, if_none_match)
        write_id = uuid.uuid4().hex
        meta = self._metadata(view, write_id)
        retried = [False]  # set once any attempt of this put failed transiently
        try:
            if multipart:
                return self._put_multipart(key, full, view, meta, cond, retried, extra)
            return self._put_single(key, full, view, data, meta, cond, retried, extra)
        except (PreconditionFailedError, ObjectNotFoundError) as exc:
            if retried[0]:  # a lost response: did our own earlier attempt land?
                landed = self._landed(key, write_id)
                if landed is not None:
                    return landed
            if isinstance(exc, ObjectNotFoundError) and cond:
                raise PreconditionFailedError(f"{self._where(key)} does not exist, so it cannot "
                                              f"match etag {if_match}") from exc
            raise

    def _metadata(self, view: memoryview, write_id: str) -> dict[str, str]:
        meta = {_META_WRITE_ID: write_id}
        if self.config.verify_reads:
            block = max(len(view), 1)
            if len(view) > self.config.multipart_threshold:
                block = self.config.part_size
                while len(view) // block * 17 > _MAX_HASH_CHARS:
                    block *= 2  # hash coarser blocks to stay inside S3's 2 KiB of metadata
            meta[_META_BLOCK] = str(block)
            meta[_META_HASHES] = ",".join(_block_hashes(view, block))
        return meta

    def _landed(self, key: str, write_id: str) -> str | None:
        try:
            head = self._run(f"{self._where(key)}: head", lambda: self._client.head_object(
                Bucket=self.bucket, Key=self._full(key)))
        except ObjectNotFoundError:
            return None
        if head.get("Metadata", {}).get(_META_WRITE_ID) == write_id:
            log.info("%s: an earlier attempt of this write landed (its response was lost)",
                     self._where(key))
            return head["ETag"]
        return None

    def _put_single(self, key: str, full: str, view: memoryview, data: Any, meta: dict,
                    cond: dict, retried: list[bool], extra: dict) -> str:
        attempts = [0]

        def attempt() -> str:
            attempts[0] += 1
            retried[0] = attempts[0] > 1
            return self._client.put_object(Bucket=self.bucket, Key=full, Body=_body(data, view), Metadata=meta,
                                           **cond, **extra)["ETag"]

        return self._run(f"{self._where(key)}: put", attempt)

    def _put_multipart(self, key: str, full: str, view: memoryview, meta: dict, cond: dict,
                       retried: list[bool], extra: dict) -> str:
        part = self.config.part_size
        count = -(-len(view) // part)
        if count > S3_MAX_PARTS:
            raise StoreError(f"{self._where(key)}: {len(view)} bytes need {count} parts of "
                             f"{part}; S3 allows {S3_MAX_PARTS}: raise S3Config.part_size")
        where = self._where(key)
        creates = [0]

        def create() -> str:
            creates[0] += 1
            return self._client.create_multipart_upload(Bucket=self.bucket, Key=full,
                                                        Metadata=meta, **extra)["UploadId"]

        upload_id = self._run(f"{where}: create multipart upload", create)
        self._count(multipart_uploads=1)
        try:
            def upload(i: int) -> str:
                piece = view[i * part:(i + 1) * part]  # read from the caller's buffer, not copied
                etag = self._run(f"{where}: upload part {i + 1}/{count}",
                                 lambda: self._client.upload_part(
                                     Bucket=self.bucket, Key=full, UploadId=upload_id,
                                     PartNumber=i + 1, Body=_ViewReader(piece))["ETag"])
                self._count(parts_uploaded=1)
                return etag

            etags = self._parallel(upload, count)
            parts = [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]
            attempts = [0]

            def complete() -> str:
                attempts[0] += 1
                retried[0] = attempts[0] > 1
                return self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id,
                    MultipartUpload={"Parts": parts}, **cond)["ETag"]

            return self._run(f"{where}: complete multipart upload", complete)
        except BaseException:
            self._abort(where, full, upload_id)
            raise
        finally:
            if creates[0] > 1:
                self._abort_strays(where, full, upload_id)

    def _abort_strays(self, where: str, full: str, ours: str) -> None:
        """A retried CreateMultipartUpload may have created uploads whose ids we never saw;
        abort the other in-progress uploads of this exact key (a rival's too: it then fails
        and retries, which is safe — nobody overwrites anybody)."""
        try:
            listing = self._run(f"{where}: list multipart uploads", lambda: (
                self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=full)))
        except StoreError:
            log.exception("%s: could not list multipart uploads to clean up", where)
            return
        for upload in listing.get("Uploads", []):
            if upload["Key"] == full and upload["UploadId"] != ours:
                log.warning("%s: aborting stray multipart upload %s left by a retried create",
                            where, upload["UploadId"])
                self._abort(where, full, upload["UploadId"])

    def _abort(self, where: str, full: str, upload_id: str) -> None:
        try:
            self._run(f"{where}: abort multipart upload {upload_id}",
                      lambda: self._client.abort_multipart_upload(
                          Bucket=self.bucket, Key=full, UploadId=upload_id))
            self._count(aborted_uploads=1)
        except ObjectNotFoundError:
            pass  # completed after all (a lost response), or already gone
        except Exception:  # never mask the failure that made us abort
            log.exception("%s: could not abort multipart upload %s; its parts stay until a "
                          "bucket lifecycle rule (AbortIncompleteMultipartUpload) removes them",
                          where, upload_id)

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            self._run(f"{self._where(key)}: delete",
                      lambda: self._client.delete_object(Bucket=self.bucket, Key=full))
        except ObjectNotFoundError:
            pass

    # --- reads --------------------------------------------------------------------------------
    def stat(self, key: str) -> Stat:
        full = self._full(key)
        head = self._run(f"{self._where(key)}: head",
                         lambda: self._client.head_object(Bucket=self.bucket, Key=full))
        modified = head.get("LastModified")
        return Stat(int(head["ContentLength"]), head["ETag"], modified.timestamp() if modified is not None else None)

    def list(self, prefix: str = "") -> list[str]:
        keys: list[str] = []
        token: str | None = None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": self._prefix + prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._run(f"{self.url}/{prefix}*: list",
                             lambda: self._client.list_objects_v2(**kwargs))
            keys.extend(o["Key"][len(self._prefix):] for o in page.get("Contents", []))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(keys)

    def get(self, key: str, *, if_none_match: str | None = None) -> Blob | None:
        full = self._full(key)
        where = self._where(key)
        for _ in range(3):  # restart if the object is replaced while its parts are fetched
            head = self._run(f"{where}: get", lambda: self._get_small(key, full, if_none_match))
            if head is None or isinstance(head, Blob):
                return head
            try:
                return Blob(self._get_parts(key, full, head), head["ETag"])
            except PreconditionFailedError:
                log.info("%s changed while it was downloaded; starting over", where)
        raise StoreError(f"{where} kept changing while it was downloaded; is a writer rewriting it "
                         "in a loop?")

    def _get_small(self, key: str, full: str, if_none_match: str | None) -> Any:
        """One GET: ``None`` on 304, the :class:`Blob` if small, else its headers (body unread)."""
        kwargs = {"IfNoneMatch": if_none_match} if if_none_match else {}
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=full, **kwargs)
        except Exception as exc:
            if _status(exc)[0] == 304:
                return None
            raise
        size = int(response["ContentLength"])
        if size > self.config.multipart_threshold:
            response["Body"].close()  # the parallel path fetches it; these headers are the HEAD
            return response
        buf = bytearray(size)
        _read_into(response["Body"], memoryview(buf), f"{self._where(key)}: get")
        self._verify(key, response.get("Metadata", {}), memoryview(buf), 0, 0)
        return Blob(buf, response["ETag"])  # bytes-like; bytes(buf) would hold it twice

    def _verify(self, key: str, meta: dict, chunk: memoryview, start: int,
                block_index: int) -> None:
        """Check ``chunk`` (object bytes from ``start``) against block ``block_index``'s hash."""
        if not self.config.verify_reads or _META_HASHES not in meta:
            return
        hashes = meta[_META_HASHES].split(",")
        if block_index >= len(hashes):
            raise StoreError(f"{self._where(key)}: metadata lists {len(hashes)} block hashes but "
                             f"block {block_index} was read; the object was not written by xcluster")
        if xxhash.xxh3_64_hexdigest(chunk) != hashes[block_index]:
            self._count(corrupt_reads=1)
            raise CorruptReadError(f"{self._where(key)}: bytes {start}+{len(chunk)} do not match the "
                                   "hash recorded at write time; fetching them again")

    def _verify_covered(self, key: str, meta: dict, chunk: memoryview, start: int,
                        total: int) -> None:
        """Check every hashed block that lies wholly inside ``chunk`` (object bytes from
        ``start``); a read of a whole small object is thus always checked."""
        if not self.config.verify_reads or _META_BLOCK not in meta:
            return
        try:
            block = max(int(meta[_META_BLOCK]), 1)
        except ValueError:
            return
        i = -(-start // block)
        while (a := i * block) < start + len(chunk):
            b = min(total, a + block)
            if b > start + len(chunk):
                return
            self._verify(key, meta, chunk[a - start:b - start], a, i)
            i += 1

    def _get_parts(self, key: str, full: str, head: dict) -> bytearray:
        """Fetch a large object as parallel ranged GETs into one preallocated buffer."""
        size, etag, meta = int(head["ContentLength"]), head["ETag"], head.get("Metadata", {})
        where = self._where(key)
        if size > self.config.max_object_size:
            raise ObjectTooLargeError(f"{where} is {size} bytes, above S3Config.max_object_size "
                                      f"({self.config.max_object_size}); raise it if that is meant")
        block = self.config.part_size
        if self.config.verify_reads and _META_BLOCK in meta:
            try:
                block = max(int(meta[_META_BLOCK]), 1)
            except ValueError:
                raise StoreError(f"{where}: bad {_META_BLOCK} metadata {meta[_META_BLOCK]!r}") from None
        buf = bytearray(size)
        view = memoryview(buf)

        def fetch(i: int) -> None:
            start, end = i * block, min(size, (i + 1) * block)
            self._run(f"{where}: get bytes {start}-{end - 1}",
                      lambda: self._fetch_range(key, full, view[start:end], start, etag, meta, i))
            self._count(parts_downloaded=1)

        self._parallel(fetch, -(-size // block))
        return buf

    def _fetch_range(self, key: str, full: str, out: memoryview, start: int, etag: str,
                     meta: dict | None, block_index: int = 0) -> None:
        """One ranged GET of object bytes ``[start, start + len(out))`` straight into ``out``,
        conditional on ``etag``; checked against block ``block_index``'s hash if ``meta``."""
        end = start + len(out)
        what = f"{self._where(key)}: get bytes {start}-{end - 1}"
        response = self._client.get_object(Bucket=self.bucket, Key=full,
                                           Range=f"bytes={start}-{end - 1}", IfMatch=etag)
        first, last, _ = _content_range(response, what)
        if first != start or last != end - 1:
            response["Body"].close()
            raise StoreError(f"{what}: the server sent bytes {first}-{last} instead")
        _read_into(response["Body"], out, what)
        if meta is not None:
            self._verify(key, meta, out, start, block_index)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One ranged GET of up to ``multipart_threshold`` bytes; if the object holds more of
        the range than that, the rest comes as parallel ranged GETs (``If-Match`` the first
        answer's etag). Every byte is read straight into one buffer, sized from the first
        answer's headers and returned as a ``bytearray``: the range is never held twice."""
        if start < 0 or length < 0:
            raise ValueError(f"bad range start={start} length={length}")
        full = self._full(key)
        where = self._where(key)
        if length == 0:
            self.stat(key)  # still raise ObjectNotFoundError for a missing key
            return b""
        first_len = min(length, self.config.multipart_threshold)

        def attempt() -> tuple[bytearray | bytes, int, int, str, dict]:
            """The whole range's buffer with its first bytes read: (buffer, bytes read, total, etag, meta)."""
            try:
                response = self._client.get_object(Bucket=self.bucket, Key=full,
                                                   Range=f"bytes={start}-{start + first_len - 1}")
            except Exception as exc:
                if _status(exc)[0] == 416:
                    return b"", 0, 0, "", {}  # start at or past the end
                raise
            first, last, total = _content_range(response, f"{where}: get_range")
            if first != start or not 0 <= last - first < first_len:
                response["Body"].close()
                raise StoreError(f"{where}: asked for bytes {start}+{first_len}, got {first}-{last}")
            size = min(total, start + length) - start
            if size > self.config.max_object_size:
                response["Body"].close()
                raise ObjectTooLargeError(f"{where}: a range of {size} bytes is above "
                                          f"S3Config.max_object_size ({self.config.max_object_size})")
            buf = bytearray(size)
            got = last - first + 1
            head = memoryview(buf)[:got]
            meta = response.get("Metadata", {})
            _read_into(response["Body"], head, f"{where}: get_range")
            self._verify_covered(key, meta, head, first, total)
            return buf, got, total, response["ETag"], meta

        buf, got, total, etag, meta = self._run(f"{where}: get bytes {start}+{first_len}", attempt)
        end = start + len(buf)
        if got >= len(buf):
            return buf  # type: ignore[return-value]  # bytes-like; bytes(buf) would double the peak
        view = memoryview(buf)
        rest = start + got
        part = self.config.part_size
        if self.config.verify_reads and meta.get(_META_BLOCK, "").isdigit():
            part = max(int(meta[_META_BLOCK]), 1)  # align parts with hashed blocks

        def fetch(i: int) -> None:
            a, b = rest + i * part, min(end, rest + (i + 1) * part)
            out = view[a - start:b - start]

            def one() -> None:
                self._fetch_range(key, full, out, a, etag, None)
                self._verify_covered(key, meta, out, a, total)

            self._run(f"{where}: get bytes {a}-{b - 1}", one)
            self._count(parts_downloaded=1)

        self._parallel(fetch, -(-(end - rest) // part))
        return buf  # type: ignore[return-value]  # bytes-like; bytes(buf) would double the peak
