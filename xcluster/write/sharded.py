"""Sharded publishing over torch.distributed: every rank uploads its own part, rank 0 commits.

With ``torch.distributed`` initialised, each rank passes the tensors it owns — whole, or as
dim-0 :class:`Slice` s of a global tensor, the way FSDP and Megatron hold them — under their
global names::

    pub = ShardedPublisher("s3://bucket/run", config=PublisherConfig(keyframe_every=32))
    pub.publish({"embed.weight": Slice(local_rows, offset=row0, global_shape=(vocab, dim)),
                 "norm.weight": norm}, step=step)        # on every rank, collectively

No weights cross ranks. Each rank keeps the base of its own part, encodes its delta against it
and uploads its chunks (``c<attempt>-r<rank>-NNNNNN.xc``). Only small metadata travels, as JSON
bytes in uint8 tensors (never pickle): each rank's layout, then its tensor, chunk and block
entries. Rank 0 checks that the parts tile the model, decides keyframe or delta for everyone,
assembles one ordinary manifest (segments at global element offsets; a tensor split across ranks
carries a parts digest, docs/FORMAT.md §6 and §10) and commits it with :mod:`xcluster.commit`.

One publish is four exchanges on the group (gather layouts, broadcast the plan, gather the
parts, broadcast the outcome). A failure on any rank reaches every rank at the next exchange:
rank 0 does not commit, every rank raises :class:`ShardedPublishError`, and chunks of an attempt
whose manifest write never began are deleted by the rank that wrote them. A rank that dies or
hangs is noticed by the others when the connection closes or after ``ShardedConfig.timeout_s``
(:class:`RankLostError`); nothing becomes visible then either.

Here: the publish itself (each rank's encode and upload, rank 0's plan, commit and checkpoint).
The exchanges are :mod:`~xcluster.write.shard_exchange`, the layout and its check
:mod:`~xcluster.write.shard_layout`, the parts and their merge :mod:`~xcluster.write.shard_parts`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..codec.encode import apply_update
from .cadence import Cadence
from .commit import Committer, seal
from ..codec.digest import model_digest_from, tensor_digest
from ..errors import ConfigError, RankLostError, ShardedPublishError, ShardLayoutError, XclusterError
from .files import FileSet, collect_files
from ..format import DELTA, KEYFRAME, KIND_TAG, Manifest, canonical_json, manifest_key, manifest_name_for
from ..format.checkpoint import checkpoint_manifest
from ..format import CHECKPOINT, checkpoint_dir, checkpoint_key
from ..format.packing import pack
from .publisher import PublisherConfig
from .shard_exchange import Exchange
from .shard_layout import Slice, check_layout, prepare_shard
from .shard_parts import describe_part, merge_parts
from .version import chain_fields, check_step, encode_and_upload, resolve_run_id
from ..ship.upload import encode_and_upload as upload_chunks
from ..fleet.retention import gc
from ..trust.signing import load_signer
from ..store import Store, resolve_store

__all__ = ["ShardedConfig", "ShardedPublishResult", "ShardedPublisher", "Slice"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ShardedConfig:
    timeout_s: float = 600.0
    """How long a rank waits at an exchange for the slowest other rank, whose encoding and upload
    of its part count in that wait: set it above the longest publish. A rank killed is usually
    noticed at once (its connection closes); one that hangs, after this long. Applies to the
    process group the publisher creates (``group=None``); a group passed in keeps its own."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")


@dataclass(frozen=True, slots=True)
class ShardedPublishResult:
    """A committed version, as one rank saw it. Totals are over all ranks; ``rank_*`` this rank's."""

    version: int
    kind: str
    step: int | None
    model_digest: str
    committed_unix: float
    total_elements: int
    changed_elements: int
    model_bytes: int
    bytes_written: int
    """Every rank's chunks, the manifest, HEAD and new non-weight files."""
    rank: int
    world_size: int
    rank_elements: int
    """Elements of the tensors and slices this rank passed."""
    rank_changed_elements: int
    rank_bytes: int
    """Chunk bytes this rank uploaded."""
    publish_seconds: float
    checkpoint_bytes: int = 0
    """Bytes of the checkpoint written after this version (rank 0: every rank's; 0: none)."""
    """This rank's wall time in ``publish()``."""


class ShardedPublisher:
    """Publishes versions of a model held in shards across the ranks of a process group.

    Create it on every rank of ``group`` (collective: it creates a metadata group of its own
    when ``group`` is None, and rank 0 reads HEAD); call :meth:`publish` on every rank with the
    same ``step`` and ``keyframe``. Rank 0 (of ``group``) commits; its ``config`` (signing key,
    run id, retention) and ``files`` are the ones that count. There is no background variant:
    ``publish()`` is collective.
    """

    def __init__(self, url: str | None = None, *, store: Store | None = None,
                 config: PublisherConfig | None = None, sharded: ShardedConfig | None = None,
                 group: Any = None, clock: Callable[[], float] = time.time,
                 attempt_id: Callable[[], str] = lambda: secrets.token_hex(4),
                 files: str | os.PathLike | Mapping[str, bytes] | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("ShardedPublisher needs torch.distributed initialised (init_process_group) first")
        self.config = config or PublisherConfig()
        self.sharded = sharded or ShardedConfig()
        self.store = resolve_store(url, store, "ShardedPublisher")
        if group is None:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.sharded.timeout_s))
        self._exchange = Exchange(group, where=self.store.url)
        self.rank = self._exchange.rank
        self.world_size = self._exchange.world_size
        self._clock = clock
        self._attempt_id = attempt_id
        # this rank's part of the last committed version: the base its next delta is against
        self._base: dict[str, torch.Tensor] | None = None
        self._base_version: int | None = None
        # rank 0 only: the commit state
        self._committer: Committer | None = None
        self._signer = None
        self._files: FileSet | None = None
        self._layout: bytes | None = None  # canonical layout of the last committed version
        self._plan_layout: bytes = b"{}"  # canonical layout of the version being published
        self._commit_exc: BaseException | None = None
        self._base_model_digest: str | None = None
        self._base_link: tuple[str, str] | None = None
        self._cadence = Cadence()
        self._committed: tuple[Manifest, str, str] | None = None  # rank 0: the last commit (for its checkpoint)
        self.run_id: str | None = None
        """The training run (as rank 0 resolved it from HEAD and the config)."""
        error, cause = None, None
        if self.rank == 0:
            try:
                self._signer = load_signer(self.config.signing_key)
                self._committer = Committer(self.store)
                self.run_id = resolve_run_id(self.config.run_id, self._committer.head, self.store.url)
                self._files = FileSet(self.store)
                if files is not None:
                    self._files.set(collect_files(files))
            except XclusterError as exc:
                error, cause = f"rank 0: {exc}", exc
        status = self._exchange.broadcast({"error": error, "run_id": self.run_id})
        if status["error"] is not None:
            raise ShardedPublishError(f"{self.store.url}: the sharded publisher could not start: "
                                      f"{status['error']}") from cause
        self.run_id = status["run_id"]
        self.last_result: ShardedPublishResult | None = None

    @property
    def version(self) -> int | None:
        """The newest version this rank took part in committing (None before the first)."""
        return self._base_version

    # --- publishing -----------------------------------------------------------------------------
    def publish(self, shard: Mapping[str, torch.Tensor | Slice], *, step: int | None = None,
                keyframe: bool | None = None) -> ShardedPublishResult:
        """Publish the model whose parts the ranks pass as the next version (collective).

        ``shard`` maps global tensor names to the tensors this rank owns whole, or to
        :class:`Slice` s (zero-row slices are ignored; a tensor with no elements is passed
        whole). The ranks' parts must tile the model exactly (:class:`ShardLayoutError`).
        ``keyframe=True`` forces a keyframe (rank 0's value counts). Returns once rank 0
        committed; on any failure every rank raises :class:`ShardedPublishError` and nothing
        becomes visible."""
        self._exchange.check()
        t0 = time.perf_counter()

        # 1. every rank: its layout (names, dtypes, global shapes, element ranges) to rank 0; a
        # rank's bad input is reported there too, so that every rank raises instead of waiting
        local: dict[str, torch.Tensor] = {}
        layout: list[list] = []
        error, cause = None, None
        try:
            step = check_step(step)
            local, layout = prepare_shard(shard)
        except (XclusterError, TypeError, ValueError) as exc:
            error, cause = f"rank {self.rank}: {exc}", exc
        msgs = self._exchange.gather({"error": error, "base_version": self._base_version, "layout": layout},
                            "gathering the layouts")

        # 2. rank 0: check the layout, decide version, kind and attempt for everyone
        plan = self._plan(msgs, keyframe) if self.rank == 0 else None
        plan = self._exchange.broadcast(plan, "broadcasting the plan")
        if plan["error"] is not None:
            kind = ShardLayoutError if plan.get("layout") else ShardedPublishError
            raise kind(f"{self.store.url}: version not published: {plan['error']}") from cause
        version, is_key, attempt = plan["version"], plan["keyframe"], plan["attempt"]

        # 3. every rank: encode its part against its own base, upload its chunks
        written: list[str] = []
        part: dict[str, Any] = {"error": None}
        encoded = None
        uploaded = 0
        try:
            names = sorted(local)
            with ThreadPoolExecutor(max_workers=self.config.codec.workers) as pool:
                digests = dict(zip(names, pool.map(lambda n: tensor_digest(local[n]), names)))
            tags = {KIND_TAG: KEYFRAME if is_key else DELTA}
            encoded, uploaded = encode_and_upload(
                self.store, self.config, version, local, digests, None if is_key else self._base,
                written=written, tags=tags, chunk_prefix=f"c{attempt}-r{self.rank}")
            part = describe_part(encoded, uploaded, layout)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0 and raised below, on every rank
            part, cause = {"error": f"rank {self.rank}: {type(exc).__name__}: {exc}"}, exc
        parts = self._exchange.gather(part, "gathering the parts")

        # 4. rank 0: assemble and commit one manifest; everyone learns the outcome
        outcome = self._commit(plan, parts, step) if self.rank == 0 else None
        try:
            outcome = self._exchange.broadcast(outcome, "broadcasting the outcome")
        except RankLostError:
            if self.rank == 0 and outcome is not None and outcome["error"] is None:
                self._advance(local, encoded, version, is_key)
                log.warning("version %d committed, but a rank was lost before it heard so", version)
            raise
        if outcome["error"] is not None:
            if not outcome["manifest_attempted"]:
                _delete_chunks(self.store, written)
            raise ShardedPublishError(f"{self.store.url}: version {version} not published: {outcome['error']}") \
                from (cause or self._commit_exc)
        self._advance(local, encoded, version, is_key)
        checkpoint_bytes = self._checkpoint(local, digests, layout, version, attempt) if outcome.get("checkpoint") else 0
        result = ShardedPublishResult(
            version=version, kind=KEYFRAME if is_key else DELTA, step=step, model_digest=outcome["model_digest"],
            committed_unix=outcome["committed_unix_ms"] / 1000, total_elements=outcome["total_elements"],
            changed_elements=outcome["changed_elements"], model_bytes=outcome["model_bytes"],
            bytes_written=outcome["bytes_written"], rank=self.rank, world_size=self.world_size,
            rank_elements=sum(t.numel() for t in local.values()), rank_changed_elements=encoded.changed_elements,
            rank_bytes=uploaded, publish_seconds=time.perf_counter() - t0, checkpoint_bytes=checkpoint_bytes)
        self.last_result = result
        return result

    def _checkpoint(self, local: dict[str, torch.Tensor], digests: dict[str, str], layout: list[list], version: int,
                    attempt: str) -> int:
        """Collective, after a committed delta when the checkpoint policy says so: every rank
        encodes its part in full into ``checkpoints/<version>/``, rank 0 writes the checkpoint
        manifest (FORMAT.md §3a). A failure anywhere is logged, never raised: the version is
        committed, and the checkpoint is tried again after the next one. Returns the bytes
        written (rank 0: all ranks'; elsewhere this rank's)."""
        written: list[str] = []
        d = checkpoint_dir(version)
        part: dict[str, Any] = {"error": None}
        try:
            encoded, uploaded = upload_chunks(
                self.store, self.config.codec, local, digests, None, key_of=lambda n: f"{d}/{n}", written=written,
                tags={KIND_TAG: CHECKPOINT}, chunk_prefix=f"k{attempt}-r{self.rank}",
                upload_workers=self.config.upload_workers, max_inflight_chunks=self.config.max_inflight_chunks)
            part = describe_part(encoded, uploaded, layout)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0
            part = {"error": f"rank {self.rank}: {type(exc).__name__}: {exc}"}
        try:
            parts = self._exchange.gather(part, "gathering the checkpoint's parts")
            verdict = None
            if self.rank == 0:
                verdict = self._write_checkpoint_manifest(parts, version, attempt)
            verdict = self._exchange.broadcast(verdict, "broadcasting the checkpoint's outcome")
        except RankLostError:
            verdict = {"error": "a rank was lost"}
        if verdict["error"] is not None:
            log.warning("%s: rank %d: no checkpoint of version %d: %s", self.store.url, self.rank, version,
                        verdict["error"])
            _delete_chunks(self.store, written)
            return 0
        return verdict["bytes"] if self.rank == 0 else part.get("bytes", 0)

    def _write_checkpoint_manifest(self, parts: list[dict], version: int, attempt: str) -> dict:
        errors = [p["error"] for p in parts if p["error"] is not None]
        if errors:
            return {"error": "; ".join(errors)}
        try:
            assert self._committed is not None and self._committed[0].version == version
            committed, mname, mhash = self._committed
            full = self._assemble(parts, version, True, attempt, committed.step)
            cp = checkpoint_manifest(committed, mname, mhash, full, created_unix_ms=int(self._clock() * 1000))
            blob = pack(cp.to_bytes())
            self.store.put(checkpoint_key(version, manifest_name_for(attempt)), blob, if_none_match=True,
                           tags={KIND_TAG: CHECKPOINT})
        except Exception as exc:  # noqa: BLE001 - every rank deletes its chunks
            return {"error": f"rank 0: {type(exc).__name__}: {exc}"}
        total = sum(p["bytes"] for p in parts) + len(blob)
        self._cadence.checkpointed(total)
        if self.config.gc_after_checkpoint is not None:
            try:
                report = gc(self.store, config=self.config.gc_after_checkpoint, now=self._clock, apply=True)
                log.info("retention after checkpoint %d: deleted %d objects", version, len(report.deleted))
            except Exception:  # retention is housekeeping: never fail a committed publish
                log.warning("retention after checkpoint %d failed", version, exc_info=True)
        return {"error": None, "bytes": total}

    def _advance(self, local: dict[str, torch.Tensor], encoded, version: int, is_key: bool) -> None:
        """Committed: bring this rank's base up to the version."""
        if is_key or self._base is None:
            self._base = {n: t.clone() for n, t in local.items()}
        else:
            apply_update(self._base, local, encoded.update)
        self._base_version = version

    def _plan(self, msgs: list[dict], force_keyframe: bool | None) -> dict:
        c = self._committer
        assert c is not None
        errors = [m["error"] for m in msgs if m["error"] is not None]
        if errors:
            return {"error": "; ".join(errors), "layout": False}
        try:
            tensors = check_layout([m["layout"] for m in msgs])
        except ShardLayoutError as exc:
            return {"error": str(exc), "layout": True}
        try:
            if c.unsure:  # the last HEAD write may or may not have landed: look again, start a new chain
                c.refresh()
        except Exception as exc:  # noqa: BLE001 - every rank raises it
            return {"error": f"rank 0: HEAD cannot be read: {exc}", "layout": False}
        key = canonical_json(tensors)
        is_key = (force_keyframe is True or key != self._layout or self._base_link is None
                  or any(m["base_version"] != c.version for m in msgs)
                  or (force_keyframe is None and self._cadence.keyframe_due(self.config)))
        self._plan_layout = key
        return {"error": None, "version": c.version + 1, "keyframe": is_key, "attempt": self._attempt_id()}

    def _commit(self, plan: dict, parts: list[dict], step: int | None) -> dict:
        """Rank 0: one manifest from every rank's part, committed; the outcome for every rank."""
        c = self._committer
        assert c is not None and self._files is not None
        self._commit_exc = None
        errors = [p["error"] for p in parts if p["error"] is not None]
        if errors:
            return {"error": "; ".join(errors), "manifest_attempted": False}
        version, is_key, attempt = plan["version"], plan["keyframe"], plan["attempt"]
        manifest_attempted = False
        try:
            file_bytes = self._files.upload()
            manifest = self._assemble(parts, version, is_key, attempt, step)
            mname = manifest_name_for(attempt)
            committed = self._clock()
            mbytes, head = seal(manifest, mname, committed_unix_ms=int(committed * 1000), run_id=self.run_id,
                                signer=self._signer, where=f"{self.store.url}/{manifest_key(version, mname)}")
            mhash = head.manifest_xxh3_128
            manifest_attempted = True
            outcome = c.commit(head, mbytes, tags={KIND_TAG: manifest.kind})
        except Exception as exc:  # noqa: BLE001 - every rank raises it
            self._commit_exc = exc
            return {"error": f"rank 0: {type(exc).__name__}: {exc}", "manifest_attempted": manifest_attempted}
        delta_bytes = sum(p["bytes"] for p in parts) + outcome.manifest_bytes + outcome.head_bytes
        self._cadence.committed(version, keyframe=is_key, nbytes=delta_bytes)
        self._base_model_digest, self._base_link = manifest.model_digest, (mname, mhash)
        self._layout = self._plan_layout
        self._committed = (manifest, mname, mhash)
        due = not is_key and self._cadence.checkpoint_due(self.config)
        return {"error": None, "manifest_attempted": True, "model_digest": manifest.model_digest, "checkpoint": due,
                "committed_unix_ms": head.committed_unix_ms, "total_elements": manifest.total_elements,
                "changed_elements": manifest.changed_elements, "model_bytes": manifest.model_bytes,
                "bytes_written": delta_bytes + file_bytes}

    def _assemble(self, parts: list[dict], version: int, is_key: bool, attempt: str, step: int | None) -> Manifest:
        """One ordinary manifest from every rank's part (:func:`~xcluster.write.shard_parts.merge_parts`)."""
        c = self._committer
        assert c is not None and self._files is not None
        tensors, chunks, blocks = merge_parts(parts, json.loads(self._plan_layout))
        mdigest = model_digest_from((t.name, t.dtype, t.shape, t.digest) for t in tensors)
        return Manifest(
            **chain_fields(version, is_key=is_key, head=c.head, base_model_digest=self._base_model_digest,
                           base_link=self._base_link, keyframe_version=self._cadence.keyframe_version),
            step=step, created_unix_ms=int(self._clock() * 1000), model_digest=mdigest,
            tensors=tensors, chunks=chunks, blocks=blocks,
            changed_elements=sum(p["changed"] for p in parts), files=self._files.entries, run_id=self.run_id)


def _delete_chunks(store: Store, keys: list[str]) -> None:
    """Best-effort delete of this rank's chunks of an attempt whose manifest write never began."""
    for key in keys:
        try:
            store.delete(key)
        except Exception:  # retention removes what is left
            log.warning("could not delete %s after a failed publish", key, exc_info=True)
