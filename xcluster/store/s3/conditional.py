"""Conditional writes: ``If-None-Match: *`` (create once) and ``If-Match: etag`` (compare and swap).

``put(if_none_match=True)`` sends ``If-None-Match: *`` and ``put(if_match=etag)`` sends
``If-Match`` (on ``CompleteMultipartUpload`` for a multipart object); a 412 (or a 409
ConditionalRequestConflict) is a :class:`~xcluster.errors.PreconditionFailedError`. Before the
first conditional write of each kind the store checks once that the server enforces it
(:meth:`ConditionalWrites.probe`); where it does not, it refuses (``S3Config.
require_conditional_writes``) or emulates the precondition with HEAD-then-PUT, which narrows the
race but cannot close it. When a conditional write is retried after a lost response, a 412 may
be our own first attempt: each write carries a random id in its metadata, and a HEAD
(:meth:`ConditionalWrites.landed`) tells the two cases apart.
"""

from __future__ import annotations

import logging
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from ...errors import ConditionalWritesUnsupportedError, ObjectNotFoundError, PreconditionFailedError
from .context import META_WRITE_ID, S3Context

log = logging.getLogger(__name__)

_PROBE_PREFIX = "_xcluster-probe/"
_NO_SUCH_ETAG = '"00000000000000000000000000000000"'


def conditions(*, if_match: str | None, if_none_match: bool) -> dict[str, str]:
    """The boto3 arguments of a put's precondition (empty for an unconditional put)."""
    if if_match is not None and if_none_match:
        raise ValueError("if_match and if_none_match are exclusive")
    if if_none_match:
        return {"IfNoneMatch": "*"}
    if if_match is not None:
        return {"IfMatch": if_match}
    return {}


class ConditionalWrites:
    """Which conditional writes one store's server enforces, and what to do where it does not.

    ``abort(where, full_key, upload_id)`` aborts a multipart upload (the probe of multipart
    completion starts one).
    """

    def __init__(self, ctx: S3Context, *, abort: Callable[[str, str, str], None]) -> None:
        self._ctx = ctx
        self._abort = abort
        self.honoured: dict[str, bool] = {}  # conditional-write feature -> server enforces it
        self._warned_emulation = False

    def check(self, key: str, cond: dict[str, str], *, if_match: str | None,
              if_none_match: bool, multipart: bool) -> None:
        """Before a conditional put of ``key``: refuse it if the server ignores ``cond``'s
        header (and ``require_conditional_writes``), or check the precondition by HEAD."""
        if not cond:
            return
        feature = (("multipart " if multipart else "") + next(iter(cond))
                   .replace("IfNoneMatch", "If-None-Match").replace("IfMatch", "If-Match"))
        if self._needs_emulation(feature):
            self._emulate(key, if_match, if_none_match)

    def _needs_emulation(self, feature: str) -> bool:
        """Whether ``feature`` (e.g. ``"multipart If-Match"``) must be emulated with
        HEAD-then-PUT; probes the server once per feature if configured to."""
        ctx = self._ctx
        if not ctx.config.probe_conditional_writes:
            return False
        with ctx.lock:
            honoured = self.honoured.get(feature)
        if honoured is None:
            honoured = self.probe(feature)
            with ctx.lock:
                self.honoured[feature] = honoured
        if honoured:
            return False
        message = (f"{ctx.url}: this server ignores {feature} on writes, so two publishers "
                   "could overwrite one version")
        if ctx.config.require_conditional_writes:
            raise ConditionalWritesUnsupportedError(
                message + ". Use a server that enforces conditional writes (AWS S3, SeaweedFS "
                "≥ 4, MinIO, R2), or set S3Config(require_conditional_writes=False) to accept a "
                "HEAD-then-PUT check that narrows the race but cannot close it (then run exactly "
                "one publisher per prefix)")
        if not self._warned_emulation:
            self._warned_emulation = True
            text = message + "; falling back to HEAD-then-PUT, which does NOT close the race"
            log.warning(text)
            # 4: this frame, check(), S3Store.put(), and put()'s caller, whom the warning names
            warnings.warn(text, RuntimeWarning, stacklevel=4)
        return True

    def probe(self, feature: str) -> bool:
        """Does the server refuse a write that ``feature``'s header forbids? (scratch key)"""
        ctx = self._ctx
        key = f"{ctx.prefix}{_PROBE_PREFIX}{uuid.uuid4().hex}"
        what = f"s3://{ctx.bucket}/{key}: probe of {feature}"
        cond = {"IfNoneMatch": "*"} if feature.endswith("If-None-Match") else {"IfMatch": _NO_SUCH_ETAG}
        client, bucket = ctx.client, ctx.bucket

        def refused(fn: Callable[[], Any]) -> bool:
            try:
                ctx.run(what, fn)
                return False
            except (PreconditionFailedError, ObjectNotFoundError):
                return True

        try:
            ctx.run(what, lambda: client.put_object(Bucket=bucket, Key=key, Body=b"1"))
            if not feature.startswith("multipart"):
                result = refused(lambda: client.put_object(Bucket=bucket, Key=key, Body=b"2",
                                                           **cond))
            else:
                upload = ctx.run(what, lambda: client.create_multipart_upload(
                    Bucket=bucket, Key=key))["UploadId"]
                try:
                    etag = ctx.run(what, lambda: client.upload_part(
                        Bucket=bucket, Key=key, UploadId=upload, PartNumber=1,
                        Body=b"2"))["ETag"]
                    result = refused(lambda: client.complete_multipart_upload(
                        Bucket=bucket, Key=key, UploadId=upload, **cond,
                        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]}))
                finally:
                    self._abort(what, key, upload)
        finally:
            ctx.run(what, lambda: client.delete_object(Bucket=bucket, Key=key))
        if not result:
            log.warning("%s: the server does not enforce it", what)
        return result

    def _emulate(self, key: str, if_match: str | None, if_none_match: bool) -> None:
        """The precondition checked by a HEAD (a server that ignores the headers)."""
        ctx = self._ctx
        try:
            current: str | None = ctx.head(key)["ETag"]
        except ObjectNotFoundError:
            current = None
        if if_none_match and current is not None:
            raise PreconditionFailedError(f"{ctx.where(key)} already exists (HEAD-then-PUT "
                                          "check): another writer created it first")
        if if_match is not None and current != if_match:
            raise PreconditionFailedError(f"{ctx.where(key)} changed (etag {current}, expected "
                                          f"{if_match}; HEAD-then-PUT check)")

    def landed(self, key: str, write_id: str) -> str | None:
        """The etag of ``key`` if it is the write ``write_id`` (an earlier attempt whose response
        was lost), else ``None``."""
        ctx = self._ctx
        try:
            head = ctx.head(key)
        except ObjectNotFoundError:
            return None
        if head.get("Metadata", {}).get(META_WRITE_ID) == write_id:
            log.info("%s: an earlier attempt of this write landed (its response was lost)",
                     ctx.where(key))
            return head["ETag"]
        return None
