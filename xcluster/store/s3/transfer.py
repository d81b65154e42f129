"""Moving bytes: single and multipart uploads, single and parallel ranged downloads, read checks.

Data path. An object up to ``multipart_threshold`` is one PUT / one GET. A larger one goes up as
a multipart upload whose parts (``part_size`` each) are sent in parallel, ``max_concurrency`` at
a time, each part retried on its own; any failure aborts the upload, so no parts are left behind.
A large object comes down as parallel ranged GETs, each read straight into one preallocated
buffer whose size (from the first response's headers) is checked against ``max_object_size``
first; every ranged GET carries ``If-Match`` so an object replaced mid-download is noticed.
Bodies are read and sent without copying the object (:mod:`.bodies`).

Integrity. Each write records an xxh3-64 per block in the object's metadata
(:func:`write_metadata`); reads check it (:func:`verify_block`) and re-fetch what does not match
(flipped bytes on the wire). ``get_range`` checks only the blocks it covers whole
(:func:`verify_covered`); callers that need the rest check the bytes themselves.
"""

from __future__ import annotations

import logging
from typing import Any

import xxhash

from ...errors import CorruptReadError, ObjectNotFoundError, ObjectTooLargeError, StoreError
from ..base import Blob
from .bodies import ViewReader, content_range, read_into, request_body
from .config import S3_MAX_PARTS, S3Config
from .context import META_BLOCK, META_HASHES, META_WRITE_ID, S3Context, status_of

log = logging.getLogger(__name__)

_MAX_HASH_CHARS = 1700  # S3 allows 2 KiB of user metadata in all


# --- block hashes ---------------------------------------------------------------------------------
def block_hashes(data: memoryview, block: int) -> list[str]:
    if len(data) == 0:
        return [xxhash.xxh3_64_hexdigest(b"")]
    return [xxhash.xxh3_64_hexdigest(data[i:i + block]) for i in range(0, len(data), block)]


def write_metadata(view: memoryview, *, write_id: str, config: S3Config) -> dict[str, str]:
    """The user metadata of a put of ``view``: its write id and, if ``verify_reads``, its block
    size and one hash per block."""
    meta = {META_WRITE_ID: write_id}
    if config.verify_reads:
        block = max(len(view), 1)
        if len(view) > config.multipart_threshold:
            block = config.part_size
            while len(view) // block * 17 > _MAX_HASH_CHARS:
                block *= 2  # hash coarser blocks to stay inside S3's 2 KiB of metadata
        meta[META_BLOCK] = str(block)
        meta[META_HASHES] = ",".join(block_hashes(view, block))
    return meta


def verify_block(ctx: S3Context, key: str, meta: dict, chunk: memoryview, *, start: int,
                 block_index: int) -> None:
    """Check ``chunk`` (object bytes from ``start``) against block ``block_index``'s hash."""
    if not ctx.config.verify_reads or META_HASHES not in meta:
        return
    hashes = meta[META_HASHES].split(",")
    if block_index >= len(hashes):
        raise StoreError(f"{ctx.where(key)}: metadata lists {len(hashes)} block hashes but "
                         f"block {block_index} was read; the object was not written by xcluster")
    if xxhash.xxh3_64_hexdigest(chunk) != hashes[block_index]:
        ctx.count(corrupt_reads=1)
        raise CorruptReadError(f"{ctx.where(key)}: bytes {start}+{len(chunk)} do not match the "
                               "hash recorded at write time; fetching them again")


def verify_covered(ctx: S3Context, key: str, meta: dict, chunk: memoryview, *, start: int,
                   total: int) -> None:
    """Check every hashed block that lies wholly inside ``chunk`` (object bytes from
    ``start``); a read of a whole small object is thus always checked."""
    if not ctx.config.verify_reads or META_BLOCK not in meta:
        return
    try:
        block = max(int(meta[META_BLOCK]), 1)
    except ValueError:
        return
    i = -(-start // block)
    while (a := i * block) < start + len(chunk):
        b = min(total, a + block)
        if b > start + len(chunk):
            return
        verify_block(ctx, key, meta, chunk[a - start:b - start], start=a, block_index=i)
        i += 1


# --- uploads --------------------------------------------------------------------------------------
class Uploader:
    """Writes an object as one PUT or as a multipart upload, and aborts what a failure leaves."""

    def __init__(self, ctx: S3Context) -> None:
        self._ctx = ctx

    def put_single(self, key: str, full: str, view: memoryview, data: Any, *, meta: dict,
                   cond: dict, retried: list[bool], extra: dict) -> str:
        """One PUT of ``data`` (its bytes are ``view``); ``retried[0]`` is set once an attempt
        failed transiently. Returns the etag."""
        ctx = self._ctx
        attempts = [0]

        def attempt() -> str:
            attempts[0] += 1
            retried[0] = attempts[0] > 1
            return ctx.client.put_object(Bucket=ctx.bucket, Key=full, Body=request_body(data, view),
                                         Metadata=meta, **cond, **extra)["ETag"]

        return ctx.run(f"{ctx.where(key)}: put", attempt)

    def put_multipart(self, key: str, full: str, view: memoryview, *, meta: dict, cond: dict,
                      retried: list[bool], extra: dict) -> str:
        """A multipart upload of ``view``, parts in parallel, ``cond`` on the completion;
        aborted on any failure. Returns the etag."""
        ctx = self._ctx
        part = ctx.config.part_size
        count = -(-len(view) // part)
        where = ctx.where(key)
        if count > S3_MAX_PARTS:
            raise StoreError(f"{where}: {len(view)} bytes need {count} parts of "
                             f"{part}; S3 allows {S3_MAX_PARTS}: raise S3Config.part_size")
        creates = [0]

        def create() -> str:
            creates[0] += 1
            return ctx.client.create_multipart_upload(Bucket=ctx.bucket, Key=full,
                                                      Metadata=meta, **extra)["UploadId"]

        upload_id = ctx.run(f"{where}: create multipart upload", create)
        ctx.count(multipart_uploads=1)
        try:
            def upload(i: int) -> str:
                piece = view[i * part:(i + 1) * part]  # read from the caller's buffer, not copied
                etag = ctx.run(f"{where}: upload part {i + 1}/{count}",
                               lambda: ctx.client.upload_part(
                                   Bucket=ctx.bucket, Key=full, UploadId=upload_id,
                                   PartNumber=i + 1, Body=ViewReader(piece))["ETag"])
                ctx.count(parts_uploaded=1)
                return etag

            etags = ctx.parallel(upload, count)
            parts = [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]
            attempts = [0]

            def complete() -> str:
                attempts[0] += 1
                retried[0] = attempts[0] > 1
                return ctx.client.complete_multipart_upload(
                    Bucket=ctx.bucket, Key=full, UploadId=upload_id,
                    MultipartUpload={"Parts": parts}, **cond)["ETag"]

            return ctx.run(f"{where}: complete multipart upload", complete)
        except BaseException:
            self.abort(where, full, upload_id)
            raise
        finally:
            if creates[0] > 1:
                self._abort_strays(where, full, upload_id)

    def _abort_strays(self, where: str, full: str, ours: str) -> None:
        """A retried CreateMultipartUpload may have created uploads whose ids we never saw;
        abort the other in-progress uploads of this exact key (a rival's too: it then fails
        and retries, which is safe — nobody overwrites anybody)."""
        ctx = self._ctx
        try:
            listing = ctx.run(f"{where}: list multipart uploads", lambda: (
                ctx.client.list_multipart_uploads(Bucket=ctx.bucket, Prefix=full)))
        except StoreError:
            log.exception("%s: could not list multipart uploads to clean up", where)
            return
        for upload in listing.get("Uploads", []):
            if upload["Key"] == full and upload["UploadId"] != ours:
                log.warning("%s: aborting stray multipart upload %s left by a retried create",
                            where, upload["UploadId"])
                self.abort(where, full, upload["UploadId"])

    def abort(self, where: str, full: str, upload_id: str) -> None:
        """Abort multipart upload ``upload_id`` of object key ``full``; never raises."""
        ctx = self._ctx
        try:
            ctx.run(f"{where}: abort multipart upload {upload_id}",
                    lambda: ctx.client.abort_multipart_upload(
                        Bucket=ctx.bucket, Key=full, UploadId=upload_id))
            ctx.count(aborted_uploads=1)
        except ObjectNotFoundError:
            pass  # completed after all (a lost response), or already gone
        except Exception:  # never mask the failure that made us abort
            log.exception("%s: could not abort multipart upload %s; its parts stay until a "
                          "bucket lifecycle rule (AbortIncompleteMultipartUpload) removes them",
                          where, upload_id)


# --- downloads ------------------------------------------------------------------------------------
class Downloader:
    """Reads an object or a range of one: one GET, or parallel ranged GETs into one buffer."""

    def __init__(self, ctx: S3Context) -> None:
        self._ctx = ctx

    def get_small(self, key: str, full: str, if_none_match: str | None) -> Any:
        """One GET: ``None`` on 304, the :class:`Blob` if small, else its headers (body unread)."""
        ctx = self._ctx
        kwargs = {"IfNoneMatch": if_none_match} if if_none_match else {}
        try:
            response = ctx.client.get_object(Bucket=ctx.bucket, Key=full, **kwargs)
        except Exception as exc:
            if status_of(exc)[0] == 304:
                return None
            raise
        size = int(response["ContentLength"])
        if size > ctx.config.multipart_threshold:
            response["Body"].close()  # the parallel path fetches it; these headers are the HEAD
            return response
        buf = bytearray(size)
        read_into(response["Body"], memoryview(buf), f"{ctx.where(key)}: get")
        verify_block(ctx, key, response.get("Metadata", {}), memoryview(buf), start=0, block_index=0)
        return Blob(buf, response["ETag"])  # bytes-like; bytes(buf) would hold it twice

    def get_parts(self, key: str, full: str, head: dict) -> bytearray:
        """Fetch a large object as parallel ranged GETs into one preallocated buffer."""
        ctx = self._ctx
        size, etag, meta = int(head["ContentLength"]), head["ETag"], head.get("Metadata", {})
        where = ctx.where(key)
        if size > ctx.config.max_object_size:
            raise ObjectTooLargeError(f"{where} is {size} bytes, above S3Config.max_object_size "
                                      f"({ctx.config.max_object_size}); raise it if that is meant")
        block = ctx.config.part_size
        if ctx.config.verify_reads and META_BLOCK in meta:
            try:
                block = max(int(meta[META_BLOCK]), 1)
            except ValueError:
                raise StoreError(f"{where}: bad {META_BLOCK} metadata {meta[META_BLOCK]!r}") from None
        buf = bytearray(size)
        view = memoryview(buf)

        def fetch(i: int) -> None:
            start, end = i * block, min(size, (i + 1) * block)
            ctx.run(f"{where}: get bytes {start}-{end - 1}", lambda: self._fetch_range(
                key, full, view[start:end], start=start, etag=etag, meta=meta, block_index=i))
            ctx.count(parts_downloaded=1)

        ctx.parallel(fetch, -(-size // block))
        return buf

    def _fetch_range(self, key: str, full: str, out: memoryview, *, start: int, etag: str,
                     meta: dict | None, block_index: int = 0) -> None:
        """One ranged GET of object bytes ``[start, start + len(out))`` straight into ``out``,
        conditional on ``etag``; checked against block ``block_index``'s hash if ``meta``."""
        ctx = self._ctx
        end = start + len(out)
        what = f"{ctx.where(key)}: get bytes {start}-{end - 1}"
        response = ctx.client.get_object(Bucket=ctx.bucket, Key=full,
                                         Range=f"bytes={start}-{end - 1}", IfMatch=etag)
        first, last, _ = content_range(response, what)
        if first != start or last != end - 1:
            response["Body"].close()
            raise StoreError(f"{what}: the server sent bytes {first}-{last} instead")
        read_into(response["Body"], out, what)
        if meta is not None:
            verify_block(ctx, key, meta, out, start=start, block_index=block_index)

    def get_range(self, key: str, full: str, start: int, length: int) -> bytearray | bytes:
        """Object bytes ``[start, start + length)`` (fewer past the end), ``length`` ≥ 1: one
        ranged GET of up to ``multipart_threshold`` bytes, the rest as parallel ranged GETs
        (``If-Match`` the first answer's etag), all read straight into one buffer sized from
        the first answer's headers."""
        ctx = self._ctx
        where = ctx.where(key)
        first_len = min(length, ctx.config.multipart_threshold)

        def attempt() -> tuple[bytearray | bytes, int, int, str, dict]:
            """The whole range's buffer with its first bytes read: (buffer, bytes read, total, etag, meta)."""
            try:
                response = ctx.client.get_object(Bucket=ctx.bucket, Key=full,
                                                 Range=f"bytes={start}-{start + first_len - 1}")
            except Exception as exc:
                if status_of(exc)[0] == 416:
                    return b"", 0, 0, "", {}  # start at or past the end
                raise
            first, last, total = content_range(response, f"{where}: get_range")
            if first != start or not 0 <= last - first < first_len:
                response["Body"].close()
                raise StoreError(f"{where}: asked for bytes {start}+{first_len}, got {first}-{last}")
            size = min(total, start + length) - start
            if size > ctx.config.max_object_size:
                response["Body"].close()
                raise ObjectTooLargeError(f"{where}: a range of {size} bytes is above "
                                          f"S3Config.max_object_size ({ctx.config.max_object_size})")
            buf = bytearray(size)
            got = last - first + 1
            head = memoryview(buf)[:got]
            meta = response.get("Metadata", {})
            read_into(response["Body"], head, f"{where}: get_range")
            verify_covered(ctx, key, meta, head, start=first, total=total)
            return buf, got, total, response["ETag"], meta

        buf, got, total, etag, meta = ctx.run(f"{where}: get bytes {start}+{first_len}", attempt)
        end = start + len(buf)
        if got >= len(buf):
            return buf
        view = memoryview(buf)
        rest = start + got
        part = ctx.config.part_size
        if ctx.config.verify_reads and meta.get(META_BLOCK, "").isdigit():
            part = max(int(meta[META_BLOCK]), 1)  # align parts with hashed blocks

        def fetch(i: int) -> None:
            a, b = rest + i * part, min(end, rest + (i + 1) * part)
            out = view[a - start:b - start]

            def one() -> None:
                self._fetch_range(key, full, out, start=a, etag=etag, meta=None)
                verify_covered(ctx, key, meta, out, start=a, total=total)

            ctx.run(f"{where}: get bytes {a}-{b - 1}", one)
            ctx.count(parts_downloaded=1)

        ctx.parallel(fetch, -(-(end - rest) // part))
        return buf
