"""S3 backend: ``s3://bucket/prefix`` on AWS S3 or any S3-compatible server.

:class:`S3Store` is the :class:`~xcluster.store.base.Store` face: construction, ``put``, ``get``,
``get_range``, ``stat``, ``list``, ``delete``. The work is done by helpers that share one
:class:`~.context.S3Context` (client, bucket, prefix, config, counters, retried requests):

* :mod:`.transfer` moves bytes: one PUT / GET up to ``multipart_threshold``, above it a
  multipart upload and parallel ranged GETs (``If-Match`` the first answer's etag), every byte
  read straight into one buffer; per-block xxh3-64 hashes recorded on write and checked on read.
* :mod:`.conditional` handles ``If-None-Match: *`` / ``If-Match`` writes: a 412 (or a 409
  ConditionalRequestConflict) is a :class:`~xcluster.errors.PreconditionFailedError`; the
  server is probed once for enforcement (see ``S3Config.require_conditional_writes``); a 412 on
  a retry after a lost response is told from a rival's write by a HEAD of our write id.

Retries follow :mod:`xcluster.util.retry`; botocore's own are off (one attempt per call).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlencode

from ...errors import ObjectNotFoundError, PreconditionFailedError, StoreError
from ..base import Blob, Stat, check_prefix
from .conditional import ConditionalWrites, conditions
from .config import S3Config
from .context import S3Context, S3Stats
from .transfer import Downloader, Uploader, write_metadata
from ...util.retry import retry_integrity

__all__ = ["S3Config", "S3Store", "S3Stats"]

log = logging.getLogger(__name__)


def _import_boto3() -> tuple[Any, Any]:
    """``(boto3, botocore.config)``, or an ImportError that says what to install."""
    try:
        import boto3
        import botocore.config
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(f"s3:// URLs need boto3: pip install 'xcluster[s3]' ({exc})") from exc
    return boto3, botocore.config


def _make_client(cfg: S3Config) -> Any:
    """A boto3 S3 client from ``cfg`` and the standard AWS chain, botocore's retries off."""
    boto3, botocore_config = _import_boto3()
    session = boto3.session.Session(profile_name=cfg.profile, region_name=cfg.region)
    return session.client("s3", endpoint_url=cfg.endpoint_url, config=botocore_config.Config(
        connect_timeout=cfg.connect_timeout_s,
        read_timeout=cfg.read_timeout_s,
        retries={"total_max_attempts": 1, "mode": "standard"},  # the policy is ours
        max_pool_connections=2 * cfg.max_concurrency + 2,
        s3={"addressing_style": cfg.addressing_style},
        tcp_keepalive=True,
    ))


class _OnContext:
    """A store attribute kept on its :class:`S3Context` (``_prefix`` is ``context.prefix``), so
    that setting it on the store (tests point two stores at one prefix) reaches every helper."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name.lstrip("_")

    def __get__(self, store: Any, owner: type | None = None) -> Any:
        return self if store is None else getattr(store._ctx, self._name)

    def __set__(self, store: Any, value: Any) -> None:
        setattr(store._ctx, self._name, value)


class S3Store:
    """A :class:`~xcluster.store.base.Store` on ``s3://bucket/prefix``.

    ``client`` (a boto3 S3 client) and ``sleep`` are for tests; by default the client is built
    from ``config`` and the standard AWS chain, with botocore's retries off.
    """

    config = _OnContext()
    bucket = _OnContext()
    url = _OnContext()
    stats = _OnContext()
    _prefix = _OnContext()  # "" or ends in "/"
    _client = _OnContext()

    def __init__(self, bucket: str, prefix: str = "", *, config: S3Config | None = None,
                 client: Any = None, sleep: Callable[[float], None] = time.sleep) -> None:
        if not bucket or "/" in bucket:
            raise StoreError(f"bad bucket name {bucket!r}")
        config = config or S3Config()
        prefix = check_prefix(prefix, f"s3://{bucket}/{prefix}")
        self._ctx = S3Context(
            client=client if client is not None else _make_client(config), bucket=bucket,
            prefix=f"{prefix}/" if prefix else "",
            url=f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}",
            config=config, sleep=sleep)
        self._upload = Uploader(self._ctx)
        self._download = Downloader(self._ctx)
        self._conditional = ConditionalWrites(self._ctx, abort=self._upload.abort)

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

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    def _full(self, key: str) -> str:
        return self._ctx.full(key)

    def _where(self, key: str) -> str:
        return self._ctx.where(key)

    @property
    def _honoured(self) -> dict[str, bool]:
        """Conditional-write feature -> whether the server enforces it (probed so far)."""
        return self._conditional.honoured

    def _probe(self, feature: str) -> bool:
        """Does the server refuse a write that ``feature``'s header forbids? (scratch key)"""
        return self._conditional.probe(feature)

    # --- writes -------------------------------------------------------------------------------
    def put(self, key: str, data: bytes | memoryview, *, if_match: str | None = None,
            if_none_match: bool = False, tags: Mapping[str, str] | None = None) -> str:
        full = self._full(key)
        extra = {"Tagging": urlencode(dict(tags))} if tags else {}
        cond = conditions(if_match=if_match, if_none_match=if_none_match)
        view = memoryview(data).cast("B")
        multipart = len(view) > self.config.multipart_threshold
        self._conditional.check(key, cond, if_match=if_match, if_none_match=if_none_match,
                                multipart=multipart)
        write_id = uuid.uuid4().hex
        meta = write_metadata(view, write_id=write_id, config=self.config)
        retried = [False]  # set once any attempt of this put failed transiently
        try:
            if multipart:
                return self._upload.put_multipart(key, full, view, meta=meta, cond=cond,
                                                  retried=retried, extra=extra)
            return self._upload.put_single(key, full, view, data, meta=meta, cond=cond,
                                           retried=retried, extra=extra)
        except (PreconditionFailedError, ObjectNotFoundError) as exc:
            if retried[0]:  # a lost response: did our own earlier attempt land?
                landed = self._conditional.landed(key, write_id)
                if landed is not None:
                    return landed
            if isinstance(exc, ObjectNotFoundError) and cond:
                raise PreconditionFailedError(f"{self._where(key)} does not exist, so it cannot "
                                              f"match etag {if_match}") from exc
            raise

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            self._ctx.run(f"{self._where(key)}: delete",
                          lambda: self._client.delete_object(Bucket=self.bucket, Key=full))
        except ObjectNotFoundError:
            pass

    # --- reads --------------------------------------------------------------------------------
    def stat(self, key: str) -> Stat:
        head = self._ctx.head(key)
        modified = head.get("LastModified")
        return Stat(int(head["ContentLength"]), head["ETag"], modified.timestamp() if modified is not None else None)

    def list(self, prefix: str = "") -> list[str]:
        keys: list[str] = []
        token: str | None = None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": self._prefix + prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._ctx.run(f"{self.url}/{prefix}*: list",
                                 lambda: self._client.list_objects_v2(**kwargs))
            keys.extend(o["Key"][len(self._prefix):] for o in page.get("Contents", []))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(keys)

    def get(self, key: str, *, if_none_match: str | None = None) -> Blob | None:
        """One GET up to ``multipart_threshold``; a larger object as parallel ranged GETs
        (``If-Match`` its etag), started over if it is replaced meanwhile (3 tries)."""
        full = self._full(key)
        where = self._where(key)

        def attempt() -> Blob | None:
            head = self._ctx.run(f"{where}: get",
                                 lambda: self._download.get_small(key, full, if_none_match))
            if head is None or isinstance(head, Blob):
                return head
            return Blob(self._download.get_parts(key, full, head), head["ETag"])

        try:  # started over (the one retry policy) if the object is replaced while its parts are fetched
            return retry_integrity(attempt, attempts=3, retry_on=PreconditionFailedError,
                                   on_retry=lambda exc, n: log.info("%s changed while it was downloaded; "
                                                                    "starting over", where))
        except PreconditionFailedError:
            raise StoreError(f"{where} kept changing while it was downloaded; is a writer rewriting it "
                             "in a loop?") from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One ranged GET of up to ``multipart_threshold`` bytes; if the object holds more of
        the range than that, the rest comes as parallel ranged GETs (``If-Match`` the first
        answer's etag). Every byte is read straight into one buffer, sized from the first
        answer's headers and returned as a ``bytearray``: the range is never held twice."""
        if start < 0 or length < 0:
            raise ValueError(f"bad range start={start} length={length}")
        full = self._full(key)
        if length == 0:
            self.stat(key)  # still raise ObjectNotFoundError for a missing key
            return b""
        return self._download.get_range(key, full, start, length)  # type: ignore[return-value]  # bytes-like; bytes(buf) would double the peak
