"""The publisher hook: turns each new state_dict into a committed version in the store.

Commit protocol (docs/FORMAT.md §Commit): chunks first, then the manifest (create-once), then
HEAD (compare-and-swap on its previous etag). A version exists for readers only once HEAD names
it, so a publisher that dies part-way leaves nothing visible; the next publisher on the prefix
deletes what it left behind.
"""

from __future__ import annotations

import logging
import numbers
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .codec.encode import CodecConfig, apply_update, encode_version
from .digest import model_digest_from, tensor_digest
from .dtypes import dtype_name
from .errors import (ConfigError, ConcurrentPublisherError, ObjectNotFoundError, PreconditionFailedError,
                     XclusterError)
from .format import (DELTA, HEAD_KEY, KEYFRAME, MAX_MANIFEST_BYTES, ChunkEntry, Head, Manifest, check_tensor_name,
                     chunk_key, manifest_key, parse_head, parse_manifest, version_dir, xxh3_128)
from .store import Store, resolve_store

if TYPE_CHECKING:  # pragma: no cover
    from .background import PublishTicket

log = logging.getLogger(__name__)
MAX_STEP = (1 << 53) - 1
KIND_TAG = "xcluster-kind"
"""Object tag on every chunk and manifest: ``keyframe`` or ``delta`` (bucket lifecycle rules match it)."""


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    keyframe_every: int = 32
    """A keyframe (full weights) every this many versions; deltas in between. The first version
    a publisher writes is always a keyframe. 1 = keyframes only."""
    codec: CodecConfig = field(default_factory=CodecConfig)
    """How tensors are encoded and chunked."""
    upload_workers: int = 8
    """Chunks uploaded in parallel (each chunk may itself be a parallel multipart upload)."""
    max_inflight_chunks: int = 4
    """Encoded chunks held in memory waiting for upload; bounds memory at about
    ``max_inflight_chunks × codec.chunk_bytes``."""
    orphan_grace_s: float = 30.0
    """A manifest above HEAD older than this is taken for the leftover of a publisher that died
    between writing it and moving HEAD (a live one does both within a request or two), and is
    replaced. Younger ones mean another publisher is committing: ConcurrentPublisherError."""
    background: bool = False
    """``publish()`` returns once the weights are snapshotted (a :class:`~xcluster.background.PublishTicket`);
    encode, upload and commit run in a worker thread, newest snapshot first (see xcluster/background.py)."""
    snapshot: str = "device"
    """Background mode: where the snapshot goes. ``"device"`` copies on the tensors' own device (fastest
    for the trainer, costs device memory); ``"pinned"`` copies CUDA tensors to page-locked host memory
    asynchronously (no device memory). On a CPU-only host both are a plain copy."""
    close_timeout_s: float = 60.0
    """Background mode, at interpreter exit: how long the version in flight may take to commit before it
    is abandoned (it stays invisible). The snapshot still waiting is dropped with a warning."""

    def __post_init__(self) -> None:
        if self.keyframe_every < 1:
            raise ConfigError(f"keyframe_every must be >= 1, got {self.keyframe_every}")
        if self.upload_workers < 1 or self.max_inflight_chunks < 1:
            raise ConfigError("upload_workers and max_inflight_chunks must be >= 1")
        if self.orphan_grace_s < 0:
            raise ConfigError(f"orphan_grace_s must be >= 0, got {self.orphan_grace_s}")
        if self.snapshot not in ("device", "pinned"):
            raise ConfigError(f"snapshot must be 'device' or 'pinned', got {self.snapshot!r}")
        if not self.close_timeout_s >= 0:
            raise ConfigError(f"close_timeout_s must be >= 0 (seconds), got {self.close_timeout_s}")


@dataclass(frozen=True, slots=True)
class PublishResult:
    version: int
    kind: str
    base_version: int | None
    step: int | None
    total_elements: int
    changed_elements: int
    model_bytes: int
    bytes_written: int
    publish_seconds: float
    committed_unix: float
    model_digest: str

    @property
    def ratio(self) -> float:
        """Bytes written over the size of the weights themselves."""
        return self.bytes_written / self.model_bytes if self.model_bytes else 0.0

    @property
    def bits_per_changed(self) -> float:
        return 8 * self.bytes_written / self.changed_elements if self.changed_elements else 0.0


def prepare_state(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Validate names and dtypes; return contiguous CPU tensors (no copy when already so)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        check_tensor_name(name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        dtype_name(t.dtype)
        t = t.detach()
        if t.dtype == torch.bool:  # a bool byte other than 0/1 (a view of uint8) would not survive a copy
            t = t.view(torch.uint8).ne(0) if t.numel() else t
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_sparse or t.layout != torch.strided:
            raise TypeError(f"state_dict[{name!r}] has layout {t.layout}; only dense tensors are supported")
        out[name] = t.contiguous()
    return out


class Publisher:
    """Publishes versions of a model's weights to ``url`` (a path or fsspec/s3 URL).

    One publisher per prefix. A second one is detected by the conditional writes and refused
    with :class:`ConcurrentPublisherError`; neither can damage what the other committed.
    """

    def __init__(self, url: str | None = None, *, store: Store | None = None,
                 config: PublisherConfig | None = None, clock: Callable[[], float] = time.time,
                 attempt_id: Callable[[], str] = lambda: secrets.token_hex(4),
                 on_commit: Callable[[PublishResult], None] | None = None) -> None:
        self.store = resolve_store(url, store, "Publisher")
        self.config = config or PublisherConfig()
        self._clock = clock
        self._attempt_id = attempt_id
        self._lock = threading.Lock()
        self._base: dict[str, torch.Tensor] | None = None
        self._base_model_digest: str | None = None
        self._base_manifest_hash: str | None = None
        self._keyframe_version = 0
        self._since_keyframe = 0
        self._unsure: tuple[int, str] | None = None  # (version, manifest hash) whose HEAD write may have landed
        self._head_version, self._head_etag = self._read_head()
        self.on_commit = on_commit
        """Called with each committed PublishResult (in background mode, from the worker thread)."""
        self.last_result: PublishResult | None = None
        """The newest version this publisher committed."""
        self.background = None
        """The :class:`~xcluster.background.BackgroundPublisher` in background mode (``.stats()``), else None."""
        if self.config.background:
            from .background import BackgroundPublisher

            self.background = BackgroundPublisher(
                self._publish_sync, where=self.store.url, snapshot=self.config.snapshot,
                close_timeout_s=self.config.close_timeout_s, on_commit=lambda r: self.on_commit and self.on_commit(r))

    @property
    def version(self) -> int:
        """The newest committed version on the store, as this publisher knows it (0 = none)."""
        return self._head_version

    def _read_head(self) -> tuple[int, str | None]:
        head, etag = self._read_head_full()
        return (head.version if head else 0), etag

    def _read_head_full(self) -> tuple[Head | None, str | None]:
        try:
            blob = self.store.get(HEAD_KEY)
        except ObjectNotFoundError:
            return None, None
        assert blob is not None
        return parse_head(blob.data, where=f"{self.store.url}/{HEAD_KEY}"), blob.etag

    def publish(self, state_dict: Mapping[str, torch.Tensor], *, step: int | None = None,
                keyframe: bool | None = None, dtype: torch.dtype | None = None) -> PublishResult | PublishTicket:
        """Encode, upload and commit ``state_dict`` as the next version; returns once committed.

        ``keyframe=True`` forces a keyframe (e.g. after a subscriber reported a bad apply).
        ``dtype`` converts floating-point tensors first (e.g. fp32 master weights → bfloat16).
        On failure nothing becomes visible and the next call retries the same version number.
        In background mode, returns a :class:`~xcluster.background.PublishTicket` once the
        weights are snapshotted (see xcluster/background.py).
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)
                                 or not 0 <= int(step) <= MAX_STEP):
            raise ConfigError(f"step must be an integer in [0, 2**53-1] or None, got {step!r}")
        step = None if step is None else int(step)
        if self.background is not None:
            return self.background.submit(state_dict, step=step, keyframe=keyframe, dtype=dtype)
        if dtype is not None:
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        result = self._publish_sync(state_dict, step, keyframe)
        if self.on_commit is not None:
            self.on_commit(result)
        return result

    def _publish_sync(self, state_dict, step, keyframe) -> PublishResult:
        with self._lock:
            self.last_result = self._publish(state_dict, step, keyframe)
            return self.last_result

    def flush(self, timeout: float | None = None) -> None:
        """Background mode: wait until everything published so far is committed, or raise the
        failure (BackgroundPublishError) / PublishTimeoutError. Nothing to do otherwise."""
        if self.background is not None:
            self.background.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Background mode: flush, then stop the worker thread. Later publish() calls are refused."""
        if self.background is not None:
            self.background.close(timeout)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # already failing: stop, but do not mask the original error
            self.close(self.config.close_timeout_s)
        except XclusterError:
            log.exception("closing the publisher for %s after an error", self.store.url)

    def _publish(self, state_dict, step, force_keyframe) -> PublishResult:
        t0 = time.perf_counter()
        cfg = self.config
        new = prepare_state(state_dict)
        if self._unsure is not None:  # the last HEAD write may or may not have landed: look again
            self._head_version, self._head_etag = self._read_head()
        names = sorted(new)
        with ThreadPoolExecutor(max_workers=cfg.codec.workers) as pool:
            digests = dict(zip(names, pool.map(lambda n: tensor_digest(new[n]), names)))
        mdigest = model_digest_from((n, dtype_name(new[n].dtype), tuple(new[n].shape), digests[n]) for n in names)
        version = self._head_version + 1
        is_key = (self._base is None or force_keyframe is True
                  or (force_keyframe is None and self._since_keyframe + 1 >= cfg.keyframe_every))
        written: list[str] = []
        keep_objects = False
        tags = {KIND_TAG: KEYFRAME if is_key else DELTA}  # for bucket lifecycle rules (terraform/)
        try:
            encoded, uploaded = self._encode_and_upload(version, new, digests, None if is_key else self._base,
                                                        written, tags)
            manifest = Manifest(
                version=version, kind=KEYFRAME if is_key else DELTA,
                base_version=None if is_key else self._head_version,
                base_model_digest=None if is_key else self._base_model_digest,
                base_manifest_xxh3_128=None if is_key else self._base_manifest_hash,
                keyframe_version=version if is_key else self._keyframe_version,
                step=step, created_unix_ms=int(self._clock() * 1000), model_digest=mdigest,
                tensors=tuple(encoded.tensors), chunks=tuple(encoded.chunks), blocks=tuple(encoded.blocks),
                changed_elements=encoded.changed_elements, base_manifest=None if is_key else "manifest.json")
            mbytes = manifest.to_bytes()
            parse_manifest(mbytes, where=f"{self.store.url}/{manifest_key(version)}")  # never commit what no reader takes
            mhash = xxh3_128(mbytes)
            self._create_manifest(version, mbytes, tags)
            written.append(manifest_key(version))
            committed = self._clock()
            head = Head(version=version, kind=manifest.kind, keyframe_version=manifest.keyframe_version,
                        manifest_xxh3_128=mhash, committed_unix_ms=int(committed * 1000)).to_bytes()
            try:
                if self._head_etag is None:
                    etag = self.store.put(HEAD_KEY, head, if_none_match=True)
                else:
                    etag = self.store.put(HEAD_KEY, head, if_match=self._head_etag)
            except PreconditionFailedError as exc:
                raise ConcurrentPublisherError(
                    f"{self.store.url}/{HEAD_KEY} moved under this publisher (expected version "
                    f"{self._head_version}): another publisher committed to this prefix") from exc
            except Exception:
                etag = self._head_landed(version, mhash)  # a timeout does not say the write failed
                if etag is None:
                    keep_objects = self._unsure is not None
                    raise
        except BaseException:
            if not keep_objects:
                self._delete(written)
            raise
        # committed: advance our view and bring the private base up to date
        self._unsure = None
        self._head_version, self._head_etag = version, etag
        if is_key:
            self._base = {n: t.clone() for n, t in new.items()}
            self._keyframe_version, self._since_keyframe = version, 0
        else:
            assert self._base is not None
            apply_update(self._base, new, encoded.update)
            self._since_keyframe += 1
        self._base_model_digest, self._base_manifest_hash = mdigest, mhash
        self._sweep(version, {manifest_key(version)} | {chunk_key(version, c.name) for c in manifest.chunks})
        return PublishResult(
            version=version, kind=manifest.kind, base_version=manifest.base_version, step=step,
            total_elements=manifest.total_elements, changed_elements=encoded.changed_elements,
            model_bytes=manifest.model_bytes, bytes_written=uploaded + len(mbytes) + len(head),
            publish_seconds=time.perf_counter() - t0, committed_unix=committed, model_digest=mdigest)

    # --- commit helpers -----------------------------------------------------------------------
    def _create_manifest(self, version: int, mbytes: bytes, tags: dict[str, str]) -> None:
        """Create-once write of the manifest; an orphan left by a dead publisher is replaced."""
        key = manifest_key(version)
        for attempt in range(2):
            try:
                self.store.put(key, mbytes, if_none_match=True, tags=tags)
                return
            except PreconditionFailedError as exc:
                if attempt or not self._is_orphan(version):
                    raise ConcurrentPublisherError(
                        f"{self.store.url}/{key} already exists and is not an orphan: another publisher is "
                        "committing to this prefix; run one publisher per prefix") from exc
                log.warning("replacing %s/%s, left uncommitted by a publisher that died", self.store.url, key)
                self.store.delete(key)

    def _is_orphan(self, version: int) -> bool:
        """Is the existing manifest of ``version`` dead: still above HEAD, and ours from an
        uncertain attempt, unreadable, or older than ``orphan_grace_s``?"""
        if self._read_head()[0] >= version:
            return False
        try:
            data = self.store.get_range(manifest_key(version), 0, MAX_MANIFEST_BYTES + 1)
        except ObjectNotFoundError:
            return True
        if self._unsure == (version, xxh3_128(data)):
            return True
        try:
            created = parse_manifest(data).created_unix_ms / 1000
        except XclusterError:
            return True  # no live publisher writes a manifest that does not parse
        return self._clock() - created > self.config.orphan_grace_s

    def _head_landed(self, version: int, mhash: str) -> str | None:
        """After a HEAD write failed without a verdict: the new etag if it landed, else None.
        Leaves ``_unsure`` set when HEAD cannot be read either."""
        try:
            head, etag = self._read_head_full()
        except Exception:
            log.warning("HEAD write for version %d failed and HEAD cannot be read: outcome unknown", version)
            self._unsure, self._base = (version, mhash), None  # next publish: re-read HEAD, keyframe
            return None
        if head is not None and head.version == version and head.manifest_xxh3_128 == mhash:
            log.warning("HEAD write for version %d reported failure but landed", version)
            return etag
        self._unsure = None
        return None

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.store.delete(key)
            except Exception:  # best effort: the orphan rules clean the rest
                log.warning("could not delete %s after a failed publish", key, exc_info=True)

    def _sweep(self, version: int, keep: set[str]) -> None:
        """Delete objects under the committed version's directory that its manifest does not name:
        chunks of earlier failed attempts at this version number."""
        try:
            stale = [k for k in self.store.list(version_dir(version) + "/") if k not in keep]
        except Exception:
            log.warning("could not list %s to sweep old attempts", version_dir(version), exc_info=True)
            return
        if stale:
            log.info("deleting %d objects of failed attempts at version %d", len(stale), version)
            self._delete(stale)

    def _encode_and_upload(self, version, new, digests, base, written: list[str], tags: dict[str, str]):
        cfg = self.config
        # Chunk names are unique to this attempt, so a publisher that loses the race for a
        # version number (or retries one) never overwrites or deletes another attempt's chunks.
        prefix = f"c{self._attempt_id()}"
        slots = threading.BoundedSemaphore(cfg.max_inflight_chunks)
        futures: list[Future] = []
        total = 0

        with ThreadPoolExecutor(max_workers=cfg.upload_workers, thread_name_prefix="xc-upload") as pool:
            def upload(key: str, data: bytes) -> None:
                try:
                    self.store.put(key, data, tags=tags)
                finally:
                    slots.release()

            def emit(entry: ChunkEntry, data: bytes) -> None:
                nonlocal total
                key = chunk_key(version, entry.name)
                slots.acquire()
                written.append(key)
                total += len(data)
                futures.append(pool.submit(upload, key, data))
                for f in futures:  # fail fast if an upload already failed
                    if f.done() and f.exception() is not None:
                        raise f.exception()

            encoded = encode_version(new, digests, base, cfg.codec, emit, chunk_prefix=prefix)
            for f in futures:
                f.result()
        return encoded, total
