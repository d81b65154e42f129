"""The publisher hook: turns each new state_dict into a committed version in the store.

Commit protocol (docs/FORMAT.md §Commit): chunks first, then the manifest (create-once), then
HEAD (compare-and-swap on its previous etag). A version exists for readers only once HEAD names
it, so a publisher that dies part-way leaves nothing visible; the next publisher on the prefix
deletes what it left behind.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .codec.encode import CodecConfig, apply_update, encode_version
from .digest import model_digest_from, tensor_digest
from .dtypes import dtype_name
from .errors import ConfigError, ConcurrentPublisherError, ObjectNotFoundError, PreconditionFailedError
from .format import (DELTA, HEAD_KEY, KEYFRAME, ChunkEntry, Head, Manifest, check_tensor_name, chunk_key,
                     manifest_key, parse_head, xxh3_128)
from .store import Store, open_store

log = logging.getLogger(__name__)
_VERSION_DIR = re.compile(r"versions/(\d{12})/")


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
    clean_uncommitted: bool = True
    """On start, delete versions newer than HEAD: leftovers of a publisher that died mid-commit.
    Turn off only if another process might be committing to this prefix right now."""

    def __post_init__(self) -> None:
        if self.keyframe_every < 1:
            raise ConfigError(f"keyframe_every must be >= 1, got {self.keyframe_every}")
        if self.upload_workers < 1 or self.max_inflight_chunks < 1:
            raise ConfigError("upload_workers and max_inflight_chunks must be >= 1")


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
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_sparse or t.layout != torch.strided:
            raise TypeError(f"state_dict[{name!r}] has layout {t.layout}; only dense tensors are supported")
        out[name] = t.contiguous()
    return out


class Publisher:
    """Publishes versions of a model's weights to ``url`` (a path or fsspec/s3 URL)."""

    def __init__(self, url: str | None = None, *, store: Store | None = None,
                 config: PublisherConfig | None = None, clock: Callable[[], float] = time.time,
                 attempt_id: Callable[[], str] = lambda: secrets.token_hex(4)) -> None:
        if store is None:
            if url is None:
                raise ConfigError("Publisher needs a url or a store")
            store = open_store(url)
        self.store = store
        self.config = config or PublisherConfig()
        self._clock = clock
        self._attempt_id = attempt_id
        self._lock = threading.Lock()
        self._base: dict[str, torch.Tensor] | None = None
        self._base_model_digest: str | None = None
        self._base_manifest_hash: str | None = None
        self._keyframe_version = 0
        self._since_keyframe = 0
        self._head_version, self._head_etag = self._read_head()
        if self.config.clean_uncommitted:
            self._clean_uncommitted()

    @property
    def version(self) -> int:
        """The newest committed version on the store, as this publisher knows it (0 = none)."""
        return self._head_version

    def _read_head(self) -> tuple[int, str | None]:
        try:
            blob = self.store.get(HEAD_KEY)
        except ObjectNotFoundError:
            return 0, None
        assert blob is not None
        return parse_head(blob.data, where=f"{self.store.url}/{HEAD_KEY}").version, blob.etag

    def _clean_uncommitted(self) -> None:
        stale = [k for k in self.store.list("versions/")
                 if (m := _VERSION_DIR.match(k)) and int(m.group(1)) > self._head_version]
        for key in stale:
            self.store.delete(key)
        if stale:
            log.warning("deleted %d objects of uncommitted versions above HEAD=%d in %s",
                        len(stale), self._head_version, self.store.url)

    def publish(self, state_dict: Mapping[str, torch.Tensor], *, step: int | None = None,
                keyframe: bool | None = None) -> PublishResult:
        """Encode, upload and commit ``state_dict`` as the next version; returns once committed.

        ``keyframe=True`` forces a keyframe (e.g. after a subscriber reported a bad apply).
        On failure nothing becomes visible and the next call retries the same version number.
        """
        with self._lock:
            return self._publish(state_dict, step, keyframe)

    def _publish(self, state_dict, step, force_keyframe) -> PublishResult:
        t0 = time.perf_counter()
        cfg = self.config
        new = prepare_state(state_dict)
        names = sorted(new)
        with ThreadPoolExecutor(max_workers=cfg.codec.workers) as pool:
            digests = dict(zip(names, pool.map(lambda n: tensor_digest(new[n]), names)))
        mdigest = model_digest_from((n, dtype_name(new[n].dtype), tuple(new[n].shape), digests[n]) for n in names)
        version = self._head_version + 1
        is_key = (self._base is None or force_keyframe is True
                  or (force_keyframe is None and self._since_keyframe + 1 >= cfg.keyframe_every))
        written: list[str] = []
        try:
            encoded, uploaded = self._encode_and_upload(version, new, digests, None if is_key else self._base, written)
            manifest = Manifest(
                version=version, kind=KEYFRAME if is_key else DELTA,
                base_version=None if is_key else self._head_version,
                base_model_digest=None if is_key else self._base_model_digest,
                base_manifest_xxh3_128=None if is_key else self._base_manifest_hash,
                keyframe_version=version if is_key else self._keyframe_version,
                step=step, created_unix_ms=int(self._clock() * 1000), model_digest=mdigest,
                tensors=tuple(encoded.tensors), chunks=tuple(encoded.chunks), blocks=tuple(encoded.blocks),
                changed_elements=encoded.changed_elements)
            mbytes = manifest.to_bytes()
            mhash = xxh3_128(mbytes)
            try:
                self.store.put(manifest_key(version), mbytes, if_none_match=True)
            except PreconditionFailedError as exc:
                raise ConcurrentPublisherError(
                    f"{self.store.url}/{manifest_key(version)} already exists: another publisher is writing "
                    "to this prefix; run one publisher per prefix") from exc
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
        except BaseException:
            for key in written:
                try:
                    self.store.delete(key)
                except Exception:  # best effort: the next publisher's start-up cleans the rest
                    log.warning("could not delete %s after a failed publish", key, exc_info=True)
            raise
        # committed: advance our view and bring the private base up to date
        self._head_version, self._head_etag = version, etag
        if is_key:
            self._base = {n: t.clone() for n, t in new.items()}
            self._keyframe_version, self._since_keyframe = version, 0
        else:
            assert self._base is not None
            apply_update(self._base, new, encoded.update)
            self._since_keyframe += 1
        self._base_model_digest, self._base_manifest_hash = mdigest, mhash
        return PublishResult(
            version=version, kind=manifest.kind, base_version=manifest.base_version, step=step,
            total_elements=manifest.total_elements, changed_elements=encoded.changed_elements,
            model_bytes=manifest.model_bytes, bytes_written=uploaded + len(mbytes) + len(head),
            publish_seconds=time.perf_counter() - t0, committed_unix=committed, model_digest=mdigest)

    def _encode_and_upload(self, version, new, digests, base, written: list[str]):
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
                    self.store.put(key, data)
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
