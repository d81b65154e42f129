"""The publisher hook: turns each new state_dict into a committed version in the store.

It prepares the state (names, dtypes, contiguous CPU tensors), attaches the non-weight files,
encodes against the last committed version (codec/), uploads chunks while encoding continues,
and hands the manifest to :mod:`xcluster.commit` (create-once manifest under a per-attempt name,
then compare-and-swap of HEAD). A version exists for readers only once HEAD names it; a publisher
never deletes anything HEAD could come to name, so no interruption can break a committed chain.
"""

from __future__ import annotations

import logging
import numbers
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..util import heap
from .base import BASE_ON, BaseCopy, host_copy, tensor_digests
from ..codec.encode import CodecConfig, EncodedVersion
from .cadence import Cadence
from .commit import Committer, InFlight, LateCommitError, seal
from ..codec.digest import model_digest_from
from ..codec.dtypes import dtype_name
from ..errors import ConfigError, FormatError, XclusterError
from .files import FileSet, collect_files
from ..format import (DELTA, KEYFRAME, KIND_TAG, MAX_CHAIN, Head, Manifest, ManifestLink, check_run_id,
                     check_tensor_name, chunk_key, manifest_key, manifest_name_for)
from ..fleet.retention import RetentionConfig, gc
from ..trust.signing import load_signer
from ..store import Store, resolve_store
from ..ship.upload import encode_and_upload as upload_chunks
from ..ship.checkpoint import write_checkpoint

if TYPE_CHECKING:  # pragma: no cover
    from .background import PublishTicket

log = logging.getLogger(__name__)
MAX_STEP = (1 << 53) - 1


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
    background: bool = False
    """``publish()`` returns once the weights are snapshotted (a :class:`~xcluster.write.background.PublishTicket`);
    encode, upload and commit run in a worker thread, newest snapshot first (see xcluster/write/background.py)."""
    snapshot: str = "device"
    """Background mode: where the snapshot goes. ``"device"`` copies on the tensors' own device (fastest
    for the trainer, costs device memory); ``"pinned"`` copies CUDA tensors to page-locked host memory
    asynchronously (no device memory). On a CPU-only host both are a plain copy."""
    close_timeout_s: float = 60.0
    """Background mode, at interpreter exit: how long the version in flight may take to commit before it
    is abandoned (it stays invisible). The snapshot still waiting is dropped with a warning."""
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
        if self.snapshot not in ("device", "pinned"):
            raise ConfigError(f"snapshot must be 'device' or 'pinned', got {self.snapshot!r}")
        if self.base_on not in BASE_ON:
            raise ConfigError(f"base_on must be 'device' or 'host', got {self.base_on!r}")
        if not self.close_timeout_s >= 0:
            raise ConfigError(f"close_timeout_s must be >= 0 (seconds), got {self.close_timeout_s}")
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


def prepare_state(state_dict: Mapping[str, torch.Tensor], *, keep_device: bool = False) -> dict[str, torch.Tensor]:
    """Validate names and dtypes; return contiguous CPU tensors (no copy when already so), or with
    ``keep_device`` contiguous tensors on their own devices (for the scan on the device)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        check_tensor_name(name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        dtype_name(t.dtype)
        t = t.detach()
        if t.dtype == torch.bool:  # a bool byte other than 0/1 (a view of uint8) would not survive a copy
            t = t.view(torch.uint8).ne(0) if t.numel() else t
        if t.device.type != "cpu" and not keep_device:
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
        """Called with each committed PublishResult (in background mode, from the worker thread)."""
        self.last_result: PublishResult | None = None
        """The newest version this publisher committed."""
        self.background = None
        """The :class:`~xcluster.write.background.BackgroundPublisher` in background mode (``.stats()``), else None."""
        if self.config.background:
            from .background import BackgroundPublisher

            self.background = BackgroundPublisher(
                self._publish_sync, where=self.store.url, snapshot=self.config.snapshot,
                close_timeout_s=self.config.close_timeout_s, on_commit=lambda r: self.on_commit and self.on_commit(r))

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

    def publish(self, state_dict: Mapping[str, torch.Tensor], *, step: int | None = None,
                keyframe: bool | None = None, dtype: torch.dtype | None = None,
                files: str | os.PathLike | Mapping[str, bytes] | None = None) -> PublishResult | PublishTicket:
        """Encode, upload and commit ``state_dict`` as the next version; returns once committed.

        ``keyframe=True`` forces a keyframe (e.g. after a subscriber reported a bad apply).
        ``dtype`` converts floating-point tensors first (e.g. fp32 master weights → bfloat16).
        ``files`` (a model directory, whose non-weight files are taken, or name → bytes) replaces
        the non-weight files from this version on; they are uploaded only when they change.
        On failure nothing becomes visible and the next call retries the same version number.
        In background mode, returns a :class:`~xcluster.write.background.PublishTicket` once the
        weights are snapshotted (see xcluster/write/background.py).
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)
                                 or not 0 <= int(step) <= MAX_STEP):
            raise ConfigError(f"step must be an integer in [0, 2**53-1] or None, got {step!r}")
        step = None if step is None else int(step)
        if files is not None:
            with self._lock:
                self._files.set(collect_files(files))
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


def chain_fields(version: int, *, is_key: bool, head: Head | None, base_model_digest: str | None,
                 base_link: tuple[str, str] | None, keyframe_version: int) -> dict:
    """The manifest fields that place ``version`` in the chain (FORMAT.md §3): its kind, its base
    link for a delta (the version HEAD names: ``base_link`` is its manifest name and hash), its
    keyframe, and ``prev_manifest`` (HEAD's manifest, keyframes included)."""
    assert is_key or (base_link is not None and head is not None)
    return dict(
        version=version, kind=KEYFRAME if is_key else DELTA,
        base_version=None if is_key else head.version,
        base_model_digest=None if is_key else base_model_digest,
        base_manifest_xxh3_128=None if is_key else base_link[1],
        base_manifest=None if is_key else base_link[0],
        keyframe_version=version if is_key else keyframe_version,
        prev_manifest=None if head is None else ManifestLink(head.version, head.manifest, head.manifest_xxh3_128))


def resolve_run_id(want: str | None, head: Head | None, url: str) -> str:
    """The run a publisher writes: HEAD's (a different ``want`` is refused), else ``want`` or a new one."""
    if head is not None and head.run_id is not None:
        if want is not None and want != head.run_id:
            raise ConfigError(f"{url} holds run {head.run_id!r} (HEAD version {head.version}); this "
                              f"publisher was given run_id {want!r}: use a new prefix for a new run")
        return head.run_id
    return want or secrets.token_hex(8)


def encode_and_upload(store: Store, config: PublisherConfig, version: int, new: Mapping[str, torch.Tensor],
                      digests: Mapping[str, str], base: Mapping[str, torch.Tensor] | None, *, written: list[str],
                      tags: dict[str, str], chunk_prefix: str) -> tuple[EncodedVersion, int]:
    """Encode ``new`` (against ``base``, or as a keyframe) into chunks ``<chunk_prefix>-NNNNNN.xc``
    of ``version`` and upload them while encoding continues (see :func:`xcluster.ship.upload.encode_and_upload`)."""
    # Chunk names are unique to this attempt, so a publisher that loses the race for a
    # version number (or retries one) never overwrites or deletes another attempt's chunks.
    return upload_chunks(store, config.codec, new, digests, base, key_of=lambda n: chunk_key(version, n),
                         written=written, tags=tags, chunk_prefix=chunk_prefix, upload_workers=config.upload_workers,
                         max_inflight_chunks=config.max_inflight_chunks)
