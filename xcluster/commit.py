"""The write path, torch-free: chunks → a create-once manifest under a per-attempt name → CAS of HEAD.

docs/FORMAT.md §7 is the protocol. The rules that make it safe whatever interrupts it (a crash,
``kill -9``, SIGTERM/Ctrl-C raising inside a request, a timeout whose request lands later, a
second publisher started by an operator):

- Every attempt writes its own objects: chunks ``c<attempt>-NNNNNN.xc`` and the manifest
  ``manifest-<attempt>.json``. No attempt ever overwrites or deletes another's.
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .chain import read_head
from .errors import ConcurrentPublisherError, PreconditionFailedError
from .format import HEAD_KEY, Head, manifest_key, xxh3_128
from .store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    """A committed version as HEAD now names it."""

    head: Head
    head_bytes: int
    etag: str


class Committer:
    """Tracks HEAD for one writer and commits versions on top of it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        head, self.etag = read_head(store)
        self.head: Head | None = head
        self._unsure: tuple[int, str] | None = None  # (version, manifest hash) whose HEAD write may have landed

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

    def commit(self, head: Head, manifest_data: bytes, *, tags: Mapping[str, str] | None = None,
               clock: Callable[[], float] | None = None) -> CommitOutcome:
        """Write the manifest ``head`` names (create-once), then swap HEAD to ``head``.

        Raises :class:`ConcurrentPublisherError` when HEAD moved under this writer. Any other
        failure leaves the manifest (and its chunks) in place: see the module docstring."""
        assert head.version == self.version + 1, "commit the version after HEAD"
        mhash = xxh3_128(manifest_data)
        assert mhash == head.manifest_xxh3_128
        key = manifest_key(head.version, head.manifest)
        try:
            self.store.put(key, manifest_data, if_none_match=True, tags=tags)
        except PreconditionFailedError:
            # a retried request of ours that landed the first time (names are unique per attempt)
            if xxh3_128(self.store.get_range(key, 0, len(manifest_data) + 1)) != mhash:
                raise ConcurrentPublisherError(
                    f"{self.store.url}/{key} exists with other content: attempt ids collided or another "
                    "publisher reuses this one's; run one publisher per prefix") from None
        data = head.to_bytes()
        try:
            if self.etag is None:
                etag = self.store.put(HEAD_KEY, data, if_none_match=True)
            else:
                etag = self.store.put(HEAD_KEY, data, if_match=self.etag)
        except PreconditionFailedError as exc:
            try:
                now, _ = read_head(self.store)
                moved = f" (it names version {now.version} now)" if now else ""
            except Exception:
                moved = ""
            raise ConcurrentPublisherError(
                f"{self.store.url}/{HEAD_KEY} moved under this publisher{moved}: another publisher committed to "
                f"this prefix after version {self.version}; run one publisher per prefix. Nothing was deleted: "
                f"this attempt's objects under versions/{head.version:012d}/ are left for `xcluster gc`") from exc
        except Exception:
            etag = self._landed(head)  # a timeout does not say the write failed
            if etag is None:
                raise
        except BaseException:
            # SystemExit / KeyboardInterrupt inside the request: the write may have landed. Never
            # delete; the next attempt reads HEAD again before building on anything.
            self._unsure = (head.version, mhash)
            raise
        self.head, self.etag = head, etag
        return CommitOutcome(head=head, head_bytes=len(data), etag=etag)

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
        self.head, self.etag = now, etag
        return None
