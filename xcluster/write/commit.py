"""The write path, torch-free: chunks → a create-once manifest under a per-attempt name → CAS of HEAD.

docs/FORMAT.md §7 is the protocol. The rules that make it safe whatever interrupts it (a crash,
``kill -9``, SIGTERM/Ctrl-C raising inside a request, a timeout whose request lands later, a
second publisher started by an operator):

- Every attempt writes its own objects: chunks ``c<attempt>-NNNNNN.xc`` and the manifest
  ``manifest-<attempt>.json.zst``. No attempt ever overwrites or deletes another's.
- HEAD moves only by compare-and-swap on the etag this writer last saw. A lost swap means
  another writer committed: :class:`ConcurrentPublisherError`, nothing deleted.
- **Once the manifest write has been attempted, nothing of the attempt is ever deleted** by the
  writer: a HEAD write that timed out may still land, so HEAD could come to name it. Only the
  chunks of an attempt that failed before its manifest write are deleted. What is left over
  (uncommitted manifests and their chunks) is garbage for retention (``xcluster gc``), which
  removes it only long after any request could still land.
- A HEAD write that fails without a verdict is checked by reading HEAD back: naming this
  attempt's manifest, the version is committed; readable and not naming it, the attempt failed;
  unreadable, the outcome is unknown and the next attempt re-reads HEAD first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..ship.head import read_head
from ..codec.encoding import parse_manifest
from ..errors import ChunksMissingError, ConcurrentPublisherError, PreconditionFailedError, XclusterError
from ..format import HEAD_KEY, Head, Manifest, inflight_key, manifest_key, version_dir, xxh3_128
from ..format.packing import pack
from ..store import Store

if TYPE_CHECKING:  # pragma: no cover
    from ..trust.signing import Signer

log = logging.getLogger(__name__)


class LateCommitError(XclusterError):
    """HEAD moved to one of this writer's own earlier attempts, whose HEAD write had failed
    without a verdict and landed later. That version is committed; the writer re-reads HEAD and
    publishes the next version as a keyframe (its base is unknown)."""


def seal(manifest: Manifest, manifest_name: str, *, committed_unix_ms: int, run_id: str | None,
         signer: Signer | None, where: str) -> tuple[bytes, Head]:
    """The canonical bytes of ``manifest`` (signed when a signer is given), checked to be what a
    reader takes, and the HEAD that names them (signed too): what :meth:`Committer.commit` writes
    (stored as one zstd frame, FORMAT.md §3)."""
    if signer is not None:
        manifest = signer.sign(manifest)
    data = manifest.to_bytes()
    parse_manifest(data, where=where)  # never commit what no reader takes
    head = Head(version=manifest.version, kind=manifest.kind, keyframe_version=manifest.keyframe_version,
                manifest_xxh3_128=xxh3_128(data), committed_unix_ms=committed_unix_ms, manifest=manifest_name,
                run_id=run_id)
    return data, head if signer is None else signer.sign(head)


class InFlight:
    """``inflight/<attempt>`` while a publisher uploads an attempt's objects: written on entry,
    written again every ``refresh_s`` seconds (its age is the store's LastModified, which
    retention compares with its grace period), deleted on exit. Retention keeps the objects of an
    attempt whose marker is young, however long ago they were uploaded (docs/RETENTION.md)."""

    def __init__(self, store: Store, attempt: str, version: int, *, refresh_s: float) -> None:
        self.store, self.key, self.refresh_s = store, inflight_key(attempt), refresh_s
        self.body = f'{{"attempt":"{attempt}","version":{version}}}'.encode()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> InFlight:
        self.store.put(self.key, self.body)
        self._thread = threading.Thread(target=self._refresh, name="xc-inflight", daemon=True)
        self._thread.start()
        return self

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.store.put(self.key, self.body)
            except Exception:  # the next refresh tries again; the upload goes on
                log.warning("could not refresh %s", self.key, exc_info=True)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.store.delete(self.key)
        except Exception:  # retention removes a stale marker after its grace
            log.warning("could not delete %s", self.key, exc_info=True)


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    """A committed version as HEAD now names it."""

    head: Head
    head_bytes: int
    etag: str
    manifest_bytes: int
    """The manifest object's stored size."""


class Committer:
    """Tracks HEAD for one writer and commits versions on top of it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        head, self.etag = read_head(store)
        self.head: Head | None = head
        self._unsure: tuple[int, str] | None = None  # (version, manifest hash) whose HEAD write may have landed
        self._given_up: set[tuple[int, str]] = set()  # HEAD writes that failed without a verdict: may land later

    @property
    def version(self) -> int:
        """The newest committed version this writer knows of (0 on an empty prefix)."""
        return self.head.version if self.head else 0

    @property
    def unsure(self) -> bool:
        """The last HEAD write's outcome is unknown (HEAD could not be read back)."""
        return self._unsure is not None

    def refresh(self) -> bool:
        """Re-read HEAD after an unknown outcome. True if our last attempt turned out committed."""
        if self._unsure is None:
            return False
        unsure, self._unsure = self._unsure, None
        self.head, self.etag = read_head(self.store)
        return self.head is not None and (self.head.version, self.head.manifest_xxh3_128) == unsure

    def delete_uncommitted_chunks(self, keys: Iterable[str]) -> None:
        """Best-effort delete of chunks whose attempt never attempted its manifest write."""
        for key in keys:
            try:
                self.store.delete(key)
            except Exception:  # retention removes what is left
                log.warning("could not delete %s after a failed publish", key, exc_info=True)

    def check_chunks(self, version: int, keys: Iterable[str]) -> None:
        """Before the manifest is written: every chunk ``keys`` names is still in the store (one
        listing of the version's directory). Raises :class:`ChunksMissingError` otherwise, so that
        a version whose chunks retention removed is never committed."""
        want = set(keys)
        if not want:
            return
        missing = sorted(want - set(self.store.list(version_dir(version) + "/")))
        if missing:
            raise ChunksMissingError(
                f"{self.store.url}: {len(missing)} of the {len(want)} chunks of version {version} uploaded by this "
                f"attempt are gone ({missing[0]}, …): retention removed them (an upload that outlived its grace "
                "period, or skewed clocks); nothing was committed, publish again")

    def commit(self, head: Head, manifest_data: bytes, *, tags: Mapping[str, str] | None = None,
               clock: Callable[[], float] | None = None) -> CommitOutcome:
        """Write the manifest ``head`` names (create-once; ``manifest_data`` is its canonical JSON,
        stored as ``head.manifest`` says), then swap HEAD to ``head``.

        Raises :class:`ConcurrentPublisherError` when HEAD moved under this writer. Any other
        failure leaves the manifest (and its chunks) in place: see the module docstring."""
        assert head.version == self.version + 1, "commit the version after HEAD"
        mhash = xxh3_128(manifest_data)
        assert mhash == head.manifest_xxh3_128
        key = manifest_key(head.version, head.manifest)
        stored = pack(manifest_data)
        try:
            self.store.put(key, stored, if_none_match=True, tags=tags)
        except PreconditionFailedError:
            # a retried request of ours that landed the first time (names are unique per attempt)
            if self.store.get_range(key, 0, len(stored) + 1) != stored:  # packing is deterministic
                raise ConcurrentPublisherError(
                    f"{self.store.url}/{key} exists with other content: attempt ids collided or another "
                    "publisher reuses this one's; run one publisher per prefix") from None
        data = head.to_bytes()
        self._check_unmoved(head)
        try:
            if self.etag is None:
                etag = self.store.put(HEAD_KEY, data, if_none_match=True)
            else:
                etag = self.store.put(HEAD_KEY, data, if_match=self.etag)
        except PreconditionFailedError as exc:
            self._moved(head, exc)
        except Exception:
            etag = self._landed(head)  # a timeout does not say the write failed
            if etag is None:
                self._given_up.add((head.version, mhash))  # it may still land: never delete, recognise it
                raise
        except BaseException:
            # SystemExit / KeyboardInterrupt inside the request: the write may have landed. Never
            # delete; the next attempt reads HEAD again before building on anything.
            self._unsure = (head.version, mhash)
            self._given_up.add((head.version, mhash))
            raise
        self.head, self.etag = head, etag
        self._given_up.clear()
        self._check_won(head)
        return CommitOutcome(head=head, head_bytes=len(data), etag=etag, manifest_bytes=len(stored))

    def _moved(self, head: Head, exc: BaseException | None) -> None:
        """HEAD is not the one this writer last saw: raise what that means."""
        try:
            now, now_etag = read_head(self.store)
            moved = f" (it names version {now.version} now)" if now else ""
        except Exception:
            now, now_etag, moved = None, None, ""
        if now is not None and (now.version, now.manifest_xxh3_128) in self._given_up:
            self.head, self.etag = now, now_etag
            self._given_up.clear()
            raise LateCommitError(
                f"{self.store.url}/{HEAD_KEY}: an earlier HEAD write of this publisher, given up on, landed "
                f"later: version {now.version} is committed with that attempt's manifest") from exc
        raise ConcurrentPublisherError(
            f"{self.store.url}/{HEAD_KEY} moved under this publisher{moved}: another publisher committed to "
            f"this prefix after version {self.version}; run one publisher per prefix. Nothing was deleted: "
            f"this attempt's objects under versions/{head.version:012d}/ are left for `xcluster gc`") from exc

    def _check_unmoved(self, head: Head) -> None:
        """Before the swap: HEAD is still the one this writer last saw. The compare-and-swap says
        the same on a store that enforces its precondition; this plain read is for one that does
        not (docs/S3.md: SeaweedFS does not promise it under concurrency), so that a second
        publisher is refused instead of overwriting a committed version. A read that fails
        proves nothing: the swap goes ahead, guarded by its precondition alone."""
        try:
            now, _ = read_head(self.store)
        except Exception:
            log.warning("HEAD could not be read before committing version %d", head.version, exc_info=True)
            return
        seen = None if self.head is None else (self.head.version, self.head.manifest_xxh3_128)
        if (None if now is None else (now.version, now.manifest_xxh3_128)) != seen:
            self._moved(head, None)

    def _check_won(self, head: Head) -> None:
        """After the swap: HEAD names this writer's manifest. A store that let two conditional
        writes through (see :meth:`_check_unmoved`) shows the other one here: the version this
        writer wrote is not the committed one, and it says so instead of reporting success."""
        try:
            now, now_etag = read_head(self.store)
        except Exception:  # the swap succeeded; a failed read-back proves nothing either way
            log.warning("HEAD could not be read back after committing version %d", head.version, exc_info=True)
            return
        if now is not None and now.version == head.version and now.manifest_xxh3_128 != head.manifest_xxh3_128:
            self.head, self.etag = now, now_etag
            raise ConcurrentPublisherError(
                f"{self.store.url}/{HEAD_KEY}: another publisher's version {now.version} replaced this one's "
                "although both writes were conditional: this store does not enforce conditional writes under "
                "concurrency (docs/S3.md); run one publisher per prefix. Readers never apply the lost version: "
                "nothing links to it")

    def _landed(self, head: Head) -> str | None:
        """After a HEAD write failed without a verdict: the new etag if it landed, else None
        (with ``unsure`` set when HEAD cannot be read either)."""
        try:
            now, etag = read_head(self.store)
        except Exception:
            log.warning("HEAD write for version %d failed and HEAD cannot be read: outcome unknown", head.version)
            self._unsure = (head.version, head.manifest_xxh3_128)
            return None
        if now is not None and now.version == head.version and now.manifest_xxh3_128 == head.manifest_xxh3_128:
            log.warning("HEAD write for version %d reported failure but landed", head.version)
            assert etag is not None
            return etag
        # Not (yet) ours. Keep the view this writer had: if someone else moved HEAD, the next
        # compare-and-swap fails and says so, rather than building on a version it never held.
        return None
