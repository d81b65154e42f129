"""The publisher hook: turns each new state_dict into a committed version in the store.

It prepares the state (names, dtypes, contiguous CPU tensors), attaches the non-weight files,
encodes against the last committed version (codec/), uploads chunks while encoding continues,
and hands the manifest to :mod:`xcluster.commit` (create-once manifest under a per-attempt name,
then compare-and-swap of HEAD). A version exists for readers only once HEAD names it; a publisher
never deletes anything HEAD could come to name, so no interruption can break a committed chain.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..util import heap
from .base import BASE_ON, BaseCopy, host_copy, tensor_digests
from ..codec.encode import CodecConfig
from .cadence import Cadence
from .commit import Committer, InFlight, LateCommitError, seal
from ..codec.digest import model_digest_from
from ..errors import ConfigError, FormatError
from .files import FileSet, collect_files
from ..format import (DELTA, KEYFRAME, KIND_TAG, MAX_CHAIN, Head, Manifest, check_run_id, manifest_key,
                     manifest_name_for)
from ..fleet.retention import RetentionConfig, gc
from ..trust.signing import load_signer
from ..store import Store, resolve_store
from ..ship.checkpoint import write_checkpoint
from .version import chain_fields, check_step, encode_and_upload, prepare_state, resolve_run_id

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    checkpoint_every: int | None = 32
    """A checkpoint (the full state of a committed version, a side object that a *joining* node
    starts from: FORMAT.md §3a) after every this many versions. Versions themselves stay deltas:
    a node that follows never downloads a checkpoint. None: no checkpoints (a joiner walks the
    chain from its keyframe, at most ``format.MAX_CHAIN`` versions)."""
    checkpoint_chain_fraction: float | None = 1.0
    """Also write a checkpoint once the deltas since the last one add up to more than this
    fraction of its bytes, so a node joining late downloads at most about ``1 + fraction``
    checkpoints' worth. None: by ``checkpoint_every`` alone."""
    keyframe_every: int | None = None
    """Also make every this many versions a keyframe (a full *version*, which every follower
    downloads). None (the default, and the better choice: checkpoints serve joiners at no cost to
    followers): a keyframe only where there is no base (the first version, a publisher restarted
    without its base, a lost commit race). 1 = full versions only (no deltas)."""
    codec: CodecConfig = field(default_factory=CodecConfig)
    """How tensors are encoded and chunked."""
    upload_workers: int = 8
    """Chunks uploaded in parallel (each chunk may itself be a parallel multipart upload)."""
    max_inflight_chunks: int = 4
    """Encoded chunks held in memory waiting for upload; bounds memory at about
    ``max_inflight_chunks × codec.chunk_bytes``."""
    inflight_refresh_s: float = 60.0
    """While a version's objects are uploaded, ``inflight/<attempt>`` is written again every this
    many seconds: retention keeps an attempt's objects while its marker is younger than its grace
    period (an hour by default), however long the upload takes. Must be well below that grace."""
    gc_after_checkpoint: RetentionConfig | None = None
    """Run retention (``xcluster gc --apply`` with these settings) after each checkpoint written:
    what HEAD and live subscribers need stays, the rest goes once past its grace. None: never
    (run ``xcluster gc`` yourself, or use the bucket's lifecycle rules; see docs/RETENTION.md)."""
    signing_key: str | None = None
    """Path of an Ed25519 private key (PEM, from ``xcluster keygen``): every manifest and HEAD is
    signed with it. None: ``$XCLUSTER_SIGNING_KEY`` / ``$XCLUSTER_SIGNING_KEY_FILE`` when set, else
    unsigned (see xcluster/trust/signing.py, docs/SECURITY.md)."""
    base_on: str = "device"
    """Where the base for the next delta is kept when versions are scanned on the device (tensors on
    a GPU, or ``codec.scan="torch"``): ``"device"`` keeps a copy there (one model's worth of device
    memory; only the changes cross to the host); ``"host"`` keeps only the host copy, brought to the
    device range by range for each scan (no device memory; the whole base crosses every version).
    The publisher always keeps a host copy too: the digests are taken there."""
    run_id: str | None = None
    """The training run's id ([a-z0-9], at most 32), written into every manifest and HEAD (and so
    covered by the signature). None: continue the run HEAD names, or start a new random one. A
    different id than HEAD's is refused: one run per prefix."""

    def __post_init__(self) -> None:
        if not self.inflight_refresh_s > 0:
            raise ConfigError(f"inflight_refresh_s must be > 0, got {self.inflight_refresh_s}")
        for name in ("checkpoint_every", "keyframe_every"):
            v = getattr(self, name)
            if v is not None and not 1 <= v <= MAX_CHAIN:
                raise ConfigError(
                    f"{name} must be in [1, {MAX_CHAIN}] or None, got {v}: a subscriber that joins walks back to "
                    f"the newest checkpoint or keyframe and refuses chains longer than format.MAX_CHAIN "
                    f"({MAX_CHAIN}), so a longer interval would lock out every new node")
        if self.upload_workers < 1 or self.max_inflight_chunks < 1:
            raise ConfigError("upload_workers and max_inflight_chunks must be >= 1")
        if self.checkpoint_chain_fraction is not None and not self.checkpoint_chain_fraction > 0:
            raise ConfigError(f"checkpoint_chain_fraction must be > 0 or None, got {self.checkpoint_chain_fraction}")
        if self.base_on not in BASE_ON:
            raise ConfigError(f"base_on must be 'device' or 'host', got {self.base_on!r}")
        if self.run_id is not None:
            try:
                check_run_id(self.run_id)
            except FormatError as exc:
                raise ConfigError(str(exc)) from None


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
    checkpoint_bytes: int = 0
    """Bytes of the checkpoint written after this version (0: none was due, or writing it failed)."""

    @property
    def ratio(self) -> float:
        """Bytes written over the size of the weights themselves."""
        return self.bytes_written / self.model_bytes if self.model_bytes else 0.0

    @property
    def bits_per_changed(self) -> float:
        return 8 * self.bytes_written / self.changed_elements if self.changed_elements else 0.0


class Publisher:
    """Publishes versions of a model's weights to ``url`` (a path or fsspec/s3 URL).

    ``publish()`` returns once the version is committed. To return once the weights are
    snapshotted instead, wrap it: :class:`~xcluster.write.background.BackgroundPublisher`.

    One publisher per prefix. A second one is detected by the conditional writes and refused
    with :class:`ConcurrentPublisherError`; neither can damage what the other committed.
    """

    def __init__(self, url: str | None = None, *, store: Store | None = None,
                 config: PublisherConfig | None = None, clock: Callable[[], float] = time.time,
                 attempt_id: Callable[[], str] = lambda: secrets.token_hex(4),
                 on_commit: Callable[[PublishResult], None] | None = None,
                 files: str | os.PathLike | Mapping[str, bytes] | None = None) -> None:
        self.store = resolve_store(url, store, "Publisher")
        self.config = config or PublisherConfig()
        self._clock = clock
        self._attempt_id = attempt_id
        self._lock = threading.Lock()
        self._base: BaseCopy | None = None
        self._base_model_digest: str | None = None
        self._base_link: tuple[str, str] | None = None  # (manifest name, manifest hash) of the base
        self._base_version = 0
        self._cadence = Cadence()
        self._signer = load_signer(self.config.signing_key)
        self._committer = Committer(self.store)
        self.run_id = self._run_id(self._committer.head)
        """The training run every version of this publisher belongs to."""
        self._files = FileSet(self.store)
        if files is not None:
            self._files.set(collect_files(files))
        self.on_commit = on_commit
        """Called with each committed PublishResult, before ``publish()`` returns it (an error it
        raises is raised by ``publish()``; the version is committed whatever)."""
        self.last_result: PublishResult | None = None
        """The newest version this publisher committed."""

    def _run_id(self, head: Head | None) -> str:
        return resolve_run_id(self.config.run_id, head, self.store.url)

    @property
    def signing_key_id(self) -> str | None:
        """The id of the key this publisher signs with (None: unsigned)."""
        return self._signer.key_id if self._signer else None

    @property
    def version(self) -> int:
        """The newest committed version on the store, as this publisher knows it (0 = none)."""
        return self._committer.version

    def set_files(self, files: str | os.PathLike | Mapping[str, bytes]) -> None:
        """Replace the non-weight files (a model directory, whose non-weight files are taken, or
        name → bytes) from the next version on; they are uploaded only when they change. Waits
        for a publish in progress to finish."""
        collected = collect_files(files)
        with self._lock:
            self._files.set(collected)

    def publish(self, state_dict: Mapping[str, torch.Tensor], *, step: int | None = None,
                keyframe: bool | None = None, dtype: torch.dtype | None = None,
                files: str | os.PathLike | Mapping[str, bytes] | None = None) -> PublishResult:
        """Encode, upload and commit ``state_dict`` as the next version; returns once committed.

        ``keyframe=True`` forces a keyframe (e.g. after a subscriber reported a bad apply).
        ``dtype`` converts floating-point tensors first (e.g. fp32 master weights → bfloat16).
        ``files`` (a model directory, whose non-weight files are taken, or name → bytes) replaces
        the non-weight files from this version on; they are uploaded only when they change.
        On failure nothing becomes visible and the next call retries the same version number.
        """
        step = check_step(step)
        if files is not None:
            self.set_files(files)
        if dtype is not None:
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        with self._lock:
            result = self.last_result = self._publish(state_dict, step, keyframe)
        if self.on_commit is not None:
            self.on_commit(result)
        return result

    def flush(self, timeout: float | None = None) -> None:
        """Nothing to wait for: ``publish()`` returns once committed. (The same call on a
        :class:`~xcluster.write.background.BackgroundPublisher` waits for its worker.)"""

    def close(self, timeout: float | None = None) -> None:
        """Nothing to stop: a publisher holds no thread. (The same call on a
        :class:`~xcluster.write.background.BackgroundPublisher` flushes and stops its worker.)"""

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _publish(self, state_dict, step, force_keyframe) -> PublishResult:
        try:
            try:
                return self._publish_once(state_dict, step, force_keyframe)
            except LateCommitError as exc:
                log.warning("%s; publishing this state as version %d, a keyframe", exc, self.version + 1)
                self._base = None
                return self._publish_once(state_dict, step, force_keyframe)
        finally:
            heap.release()  # what the version freed (a delta's change positions among it): the next starts lean

    def _publish_once(self, state_dict, step, force_keyframe) -> PublishResult:
        t0 = time.perf_counter()
        cfg = self.config
        on_device = any(cfg.codec.scans_with_torch(t) for t in state_dict.values() if isinstance(t, torch.Tensor))
        new = prepare_state(state_dict, keep_device=on_device)
        c = self._committer
        if c.unsure:  # the last HEAD write may or may not have landed: look again, start a new chain
            c.refresh()
            self._base = None
        version = c.version + 1
        if self._base_version != c.version:  # never a delta on anything but the version HEAD names
            self._base = None
        is_key = (self._base is None or force_keyframe is True
                  or (force_keyframe is None and self._cadence.keyframe_due(self.config)))
        attempt = self._attempt_id()
        mname = manifest_name_for(attempt)
        tags = {KIND_TAG: KEYFRAME if is_key else DELTA}  # for bucket lifecycle rules (terraform/)
        chunks: list[str] = []
        manifest_attempted = False
        base = None if is_key else self._base
        if is_key and not on_device:
            # a keyframe needs no base: drop it now, so that encoding runs beside the caller's weights
            # alone and the new base (cloned once committed) never lives beside the old one. Should
            # this version fail, the next one is a keyframe, as this one was.
            self._base = None
        if on_device and base is not None:  # only the changes cross: the host copy is built from them
            host_new: dict[str, torch.Tensor] = {}

            def digests(update):
                host_new.update(base.host_after(new, update))
                return base.digests_after(host_new, update, cfg.codec.workers)
            source, against = new, base.scan
        else:
            host_new = {n: host_copy(t) for n, t in new.items()} if on_device else new
            digests = tensor_digests(host_new, cfg.codec.workers)
            source, against = host_new, None if base is None else base.host
        if on_device:  # the caller's pending work on its streams comes before the scan
            for dev in {t.device for t in new.values() if t.is_cuda}:
                torch.cuda.current_stream(dev).synchronize()
        try:
            with InFlight(self.store, attempt, version, refresh_s=cfg.inflight_refresh_s):
                file_bytes = self._files.upload()
                encoded, uploaded = self._encode_and_upload(version, source, digests, against, chunks, tags, attempt)
                mdigest = model_digest_from((e.name, e.dtype, e.shape, e.digest) for e in encoded.tensors)
                manifest = Manifest(
                    **chain_fields(version, is_key=is_key, head=c.head, base_model_digest=self._base_model_digest,
                                   base_link=self._base_link, keyframe_version=self._cadence.keyframe_version),
                    step=step, created_unix_ms=int(self._clock() * 1000), model_digest=mdigest,
                    tensors=tuple(encoded.tensors), chunks=tuple(encoded.chunks), blocks=tuple(encoded.blocks),
                    changed_elements=encoded.changed_elements, files=self._files.entries, run_id=self.run_id)
                committed = self._clock()
                mbytes, head = seal(manifest, mname, committed_unix_ms=int(committed * 1000), run_id=self.run_id,
                                    signer=self._signer, where=f"{self.store.url}/{manifest_key(version, mname)}")
                mhash = head.manifest_xxh3_128
                c.check_chunks(version, chunks)  # none removed by retention while they were uploaded
                manifest_attempted = True
                outcome = c.commit(head, mbytes, tags=tags)
        except BaseException:
            # Before the manifest write nothing can name these chunks; after it, HEAD might come
            # to name the manifest (a write that timed out can still land): keep everything.
            if not manifest_attempted:
                c.delete_uncommitted_chunks(chunks)
            if c.unsure:
                self._base = None
            raise
        # committed: advance our view and bring the private base up to date
        delta_bytes = uploaded + outcome.manifest_bytes + outcome.head_bytes
        if is_key or on_device:
            heap.release()  # the encode's and upload's freed temporaries, before a model-sized copy
            owned = host_new if on_device else {n: t.clone() for n, t in new.items()}  # the old base is gone
            self._base = BaseCopy.of(new, owned, {e.name: e.digest for e in encoded.tensors},
                                     on_device=on_device and cfg.base_on == "device", reuse=self._base)
        else:
            assert self._base is not None
            self._base.advance_host(new, encoded.update, {e.name: e.digest for e in encoded.tensors})
        self._cadence.committed(version, keyframe=is_key, nbytes=delta_bytes)
        self._base_model_digest, self._base_link = mdigest, (mname, mhash)
        self._base_version = version
        checkpoint_bytes = 0
        if not is_key and self._cadence.checkpoint_due(cfg):
            checkpoint_bytes = self._write_checkpoint(manifest, mname, mhash)
        return PublishResult(
            version=version, kind=manifest.kind, base_version=manifest.base_version, step=step,
            total_elements=manifest.total_elements, changed_elements=encoded.changed_elements,
            model_bytes=manifest.model_bytes, bytes_written=delta_bytes + file_bytes,
            publish_seconds=time.perf_counter() - t0, committed_unix=committed, model_digest=mdigest,
            checkpoint_bytes=checkpoint_bytes)

    def _write_checkpoint(self, manifest: Manifest, mname: str, mhash: str) -> int:
        """The checkpoint of the version just committed, from the publisher's host copy of it. A
        failure is logged and retried after the next version: the version is committed whatever."""
        cfg = self.config
        assert self._base is not None
        heap.release()
        try:
            w = write_checkpoint(self.store, self._base.host, manifest, mname, mhash, codec=cfg.codec,
                                 upload_workers=cfg.upload_workers, max_inflight_chunks=cfg.max_inflight_chunks,
                                 attempt=self._attempt_id(), clock=self._clock)
        except Exception:  # noqa: BLE001 - a checkpoint is for joiners: never fail a committed publish
            log.warning("writing the checkpoint of version %d failed; trying again after the next version",
                        manifest.version, exc_info=True)
            return 0
        finally:
            heap.release()
        log.info("checkpoint of version %d: %d bytes in %.2fs", w.version, w.bytes_written, w.seconds)
        self._cadence.checkpointed(w.bytes_written)
        if cfg.gc_after_checkpoint is not None:
            try:
                report = gc(self.store, config=cfg.gc_after_checkpoint, now=self._clock, apply=True)
                log.info("retention after checkpoint %d: deleted %d objects (%d bytes)", w.version,
                         len(report.deleted), report.bytes)
            except Exception:  # retention is housekeeping: never fail a committed publish
                log.warning("retention after checkpoint %d failed", w.version, exc_info=True)
        return w.bytes_written

    def _encode_and_upload(self, version, new, digests, base, written: list[str], tags: dict[str, str],
                           attempt: str):
        return encode_and_upload(self.store, self.config, version, new, digests, base, written=written, tags=tags,
                                 chunk_prefix=f"c{attempt}")
