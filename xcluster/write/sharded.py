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
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..codec.encode import apply_update
from .cadence import Cadence
from .commit import Committer, seal
from ..codec.digest import combine_part_digests, model_digest_from, tensor_digest
from ..codec.dtypes import dtype_name
from ..errors import ConfigError, RankLostError, ShardedPublishError, ShardLayoutError, XclusterError
from .files import FileSet, collect_files
from ..format import (DELTA, KEYFRAME, KIND_TAG, BlockEntry, ChunkEntry, Manifest, Segment,
                     StreamEntry, TensorEntry, canonical_json, check_tensor_name, manifest_key, manifest_name_for)
from ..read.checkpoint import checkpoint_manifest
from ..format import CHECKPOINT, checkpoint_dir, checkpoint_key
from ..format.packing import pack
from .publisher import (MAX_STEP, PublisherConfig, chain_fields, encode_and_upload,
                        prepare_state, resolve_run_id)
from ..ship.upload import encode_and_upload as upload_chunks
from ..fleet.retention import gc
from ..trust.signing import load_signer
from ..store import Store, resolve_store

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Slice:
    """Rows ``[offset, offset + tensor.shape[0])`` of the global tensor of shape ``global_shape``
    (a dim-0 slice, contiguous in the global tensor's C order)."""

    tensor: torch.Tensor
    _: KW_ONLY
    offset: int
    global_shape: Sequence[int]


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
    run id, retention) and ``files`` are the ones that count. Background mode is not supported.
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
        if self.config.background:
            raise ConfigError("ShardedPublisher does not support background=True: publish() is collective")
        self.store = resolve_store(url, store, "ShardedPublisher")
        if group is None:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.sharded.timeout_s))
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0)
        self._device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":  # metadata travels on the group's own device
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._clock = clock
        self._attempt_id = attempt_id
        self._broken: str | None = None
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
        status = self._broadcast({"error": error, "run_id": self.run_id})
        if status["error"] is not None:
            raise ShardedPublishError(f"{self.store.url}: the sharded publisher could not start: "
                                      f"{status['error']}") from cause
        self.run_id = status["run_id"]
        self.last_result: ShardedPublishResult | None = None

    @property
    def version(self) -> int | None:
        """The newest version this rank took part in committing (None before the first)."""
        return self._base_version

    # --- exchanges: JSON bytes in uint8 tensors, never pickle --------------------------------
    def _lost(self, exc: BaseException, what: str) -> RankLostError:
        self._broken = (f"a rank was lost while {what} ({exc}); the process group cannot be trusted: "
                        "restart the job (a new ShardedPublisher on a new group)")
        return RankLostError(f"{self.store.url}: rank {self.rank} of {self.world_size}: {self._broken}")

    def _gather(self, obj: dict, what: str) -> list[dict] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        data = json.dumps(obj, separators=(",", ":")).encode()
        dev = self._device
        try:
            size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
            sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
            dist.all_gather(sizes, size, group=self._group)
            n = max(int(s.item()) for s in sizes)
            buf = torch.zeros(n, dtype=torch.uint8)
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            buf = buf.to(dev)
            out = [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(self.world_size)] \
                if self.rank == 0 else None
            dist.gather(buf, out, dst=self._root, group=self._group)
        except RuntimeError as exc:  # DistBackendError: a peer closed its connection or timed out
            raise self._lost(exc, what) from exc
        if out is None:
            return None
        return [json.loads(bytes(t.cpu().numpy()[:int(s.item())])) for t, s in zip(out, sizes)]

    def _broadcast(self, obj: dict | None, what: str = "starting") -> dict:
        """Rank 0's ``obj`` on every rank."""
        dev = self._device
        try:
            data = json.dumps(obj, separators=(",", ":")).encode() if self.rank == 0 else b""
            size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
            dist.broadcast(size, src=self._root, group=self._group)
            if self.rank == 0:
                buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
            else:
                buf = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
            dist.broadcast(buf, src=self._root, group=self._group)
        except RuntimeError as exc:
            raise self._lost(exc, what) from exc
        return obj if self.rank == 0 else json.loads(bytes(buf.cpu().numpy()))

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
        if self._broken is not None:
            raise RankLostError(f"{self.store.url}: rank {self.rank}: {self._broken}")
        t0 = time.perf_counter()

        # 1. every rank: its layout (names, dtypes, global shapes, element ranges) to rank 0; a
        # rank's bad input is reported there too, so that every rank raises instead of waiting
        local: dict[str, torch.Tensor] = {}
        layout: list[list] = []
        error, cause = None, None
        try:
            if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)
                                     or not 0 <= int(step) <= MAX_STEP):
                raise ConfigError(f"step must be an integer in [0, 2**53-1] or None, got {step!r}")
            step = None if step is None else int(step)
            local, layout = _prepare(shard)
        except (XclusterError, TypeError, ValueError) as exc:
            error, cause = f"rank {self.rank}: {exc}", exc
        msgs = self._gather({"error": error, "base_version": self._base_version, "layout": layout},
                            "gathering the layouts")

        # 2. rank 0: check the layout, decide version, kind and attempt for everyone
        plan = self._plan(msgs, keyframe) if self.rank == 0 else None
        plan = self._broadcast(plan, "broadcasting the plan")
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
            by_name = {row[0]: row for row in layout}
            part = {"error": None, "bytes": uploaded, "changed": encoded.changed_elements,
                    "tensors": [[t.name, by_name[t.name][3], t.digest, t.init] for t in encoded.tensors],
                    "chunks": [[c.name, c.size, c.xxh3_128] for c in encoded.chunks],
                    "blocks": [[b.chunk, b.offset, b.encoding, b.width, [[s.codec, s.stored, s.raw] for s in b.streams],
                                [[s.tensor, s.start, s.count, s.nnz] for s in b.segments]] for b in encoded.blocks]}
        except Exception as exc:  # noqa: BLE001 - reported to rank 0 and raised below, on every rank
            part, cause = {"error": f"rank {self.rank}: {type(exc).__name__}: {exc}"}, exc
        parts = self._gather(part, "gathering the parts")

        # 4. rank 0: assemble and commit one manifest; everyone learns the outcome
        outcome = self._commit(plan, parts, step) if self.rank == 0 else None
        try:
            outcome = self._broadcast(outcome, "broadcasting the outcome")
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
            offsets = {row[0]: row[3] for row in layout}
            part = {"error": None, "bytes": uploaded, "changed": encoded.changed_elements,
                    "tensors": [[t.name, offsets[t.name], t.digest, t.init] for t in encoded.tensors],
                    "chunks": [[c.name, c.size, c.xxh3_128] for c in encoded.chunks],
                    "blocks": [[b.chunk, b.offset, b.encoding, b.width, [[s.codec, s.stored, s.raw] for s in b.streams],
                                [[s.tensor, s.start, s.count, s.nnz] for s in b.segments]] for b in encoded.blocks]}
        except Exception as exc:  # noqa: BLE001 - reported to rank 0
            part = {"error": f"rank {self.rank}: {type(exc).__name__}: {exc}"}
        try:
            parts = self._gather(part, "gathering the checkpoint's parts")
            verdict = None
            if self.rank == 0:
                verdict = self._write_checkpoint_manifest(parts, version, attempt)
            verdict = self._broadcast(verdict, "broadcasting the checkpoint's outcome")
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
            tensors = _check_layout([m["layout"] for m in msgs])
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
        """One ordinary manifest: tensors sorted by name, each rank's chunks and blocks in rank
        order, segments moved from the rank's slice to the global tensor's element offsets."""
        c = self._committer
        assert c is not None and self._files is not None
        layout = json.loads(self._plan_layout)
        names = sorted(layout)
        index = {n: i for i, n in enumerate(names)}
        pieces: dict[str, list[tuple[int, int, str, str]]] = {n: [] for n in names}  # (offset, count, digest, init)
        for p in parts:
            for name, off, digest, init in p["tensors"]:
                pieces[name].append((off, _count(layout[name], off), digest, init))
        tensors: list[TensorEntry] = []
        for n in names:
            ps = sorted(pieces[n])
            ps = [p for p in ps if p[1] > 0] or ps[:1]  # a tensor without elements: any rank may pass it
            inits = {init for _, _, _, init in ps}
            if len(inits) != 1:  # the bases of the ranks disagree: never commit a mix
                raise ShardedPublishError(f"the parts of {n} disagree on init ({sorted(inits)}): the ranks' bases "
                                          "are out of step; refusing to commit a mix")
            dtype, shape = layout[n]["dtype"], tuple(layout[n]["shape"])
            if len(ps) == 1:
                tensors.append(TensorEntry(n, dtype, shape, ps[0][2], ps[0][3]))
            else:
                tensors.append(TensorEntry(n, dtype, shape, combine_part_digests((k, d) for _, k, d, _ in ps),
                                           ps[0][3], tuple(k for _, k, _, _ in ps)))
        chunks: list[ChunkEntry] = []
        blocks: list[BlockEntry] = []
        for p in parts:
            base_chunk = len(chunks)
            chunks.extend(ChunkEntry(*ch) for ch in p["chunks"])
            local = p["tensors"]  # the rank's tensors in its encoder's order (sorted by name)
            for chunk, offset, encoding, width, streams, segments in p["blocks"]:
                blocks.append(BlockEntry(
                    base_chunk + chunk, offset, encoding, width, tuple(StreamEntry(*s) for s in streams),
                    tuple(Segment(index[local[t][0]], local[t][1] + start, count, nnz)
                          for t, start, count, nnz in segments)))
        mdigest = model_digest_from((t.name, t.dtype, t.shape, t.digest) for t in tensors)
        return Manifest(
            **chain_fields(version, is_key=is_key, head=c.head, base_model_digest=self._base_model_digest,
                           base_link=self._base_link, keyframe_version=self._cadence.keyframe_version),
            step=step, created_unix_ms=int(self._clock() * 1000), model_digest=mdigest,
            tensors=tuple(tensors), chunks=tuple(chunks), blocks=tuple(blocks),
            changed_elements=sum(p["changed"] for p in parts), files=self._files.entries, run_id=self.run_id)


def _count(entry: dict, offset: int) -> int:
    return entry["parts"][str(offset)]


def _delete_chunks(store: Store, keys: list[str]) -> None:
    """Best-effort delete of this rank's chunks of an attempt whose manifest write never began."""
    for key in keys:
        try:
            store.delete(key)
        except Exception:  # retention removes what is left
            log.warning("could not delete %s after a failed publish", key, exc_info=True)


def _prepare(shard: Mapping[str, torch.Tensor | Slice]) -> tuple[dict[str, torch.Tensor], list[list]]:
    """This rank's tensors (contiguous CPU, by global name) and layout rows
    ``[name, dtype, global shape, element offset, element count]``, sorted by name. A slice of
    no rows is dropped, unless the whole tensor has no elements (then any rank may pass it)."""
    tensors: dict[str, torch.Tensor] = {}
    rows: list[list] = []
    for name, value in shard.items():
        check_tensor_name(name)
        if isinstance(value, Slice):
            t, gshape = value.tensor, value.global_shape
            if (not isinstance(gshape, Sequence) or len(gshape) < 1
                    or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in gshape)):
                raise ShardLayoutError(f"{name}: global_shape {gshape!r} must be at least one non-negative int")
            gshape = tuple(int(d) for d in gshape)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"shard[{name!r}] is a Slice of a {type(t).__name__}, not a tensor")
            off = value.offset
            if isinstance(off, bool) or not isinstance(off, numbers.Integral):
                raise ShardLayoutError(f"{name}: offset {off!r} is not an integer")
            off = int(off)
            if t.dim() != len(gshape) or tuple(t.shape[1:]) != gshape[1:] or not 0 <= off <= gshape[0] - t.shape[0]:
                raise ShardLayoutError(f"{name}: a slice of shape {tuple(t.shape)} at row {off} is not a dim-0 slice "
                                       f"of a tensor of shape {gshape}")
            if t.numel() == 0 and math.prod(gshape) > 0:
                continue  # this rank holds no rows of it
            rows.append([name, dtype_name(t.dtype), list(gshape), off * math.prod(gshape[1:]), t.numel()])
        elif isinstance(value, torch.Tensor):
            t = value
            rows.append([name, dtype_name(t.dtype), list(t.shape), 0, t.numel()])
        else:
            raise TypeError(f"shard[{name!r}] is a {type(value).__name__}, not a tensor or a Slice")
        tensors[name] = t
    return prepare_state(tensors), sorted(rows)


def _check_layout(layouts: list[list[list]]) -> dict[str, dict]:
    """The ranks' layouts as one: ``{name: {"dtype", "shape", "parts": {offset: count},
    "ranks": {offset: rank}}}``, or
    :class:`ShardLayoutError` when they do not tile every tensor exactly once."""
    by_name: dict[str, list[tuple[int, int, int, str, tuple]]] = {}
    for rank, rows in enumerate(layouts):
        for name, dtype, shape, off, count in rows:
            by_name.setdefault(name, []).append((off, count, rank, dtype, tuple(shape)))
    out: dict[str, dict] = {}
    problems: list[str] = []
    for name in sorted(by_name):
        ps = sorted(by_name[name])
        kinds = {(d, s) for _, _, _, d, s in ps}
        if len(kinds) != 1:
            problems.append(f"{name}: ranks disagree on dtype/global shape: "
                            + ", ".join(f"rank {r} {d}{list(s)}" for _, _, r, d, s in ps))
            continue
        dtype, shape = kinds.pop()
        numel, pos = math.prod(shape), 0
        for off, count, rank, _, _ in ps:
            if off != pos:
                what = "overlap" if off < pos else "hole"
                problems.append(f"{name}: elements [{min(off, pos)}, {max(off, pos)}) are a {what} (rank {rank}'s "
                                f"part starts at element {off}; parts: "
                                + ", ".join(f"rank {r} [{o}, {o + k})" for o, k, r, _, _ in ps) + ")")
                break
            pos = off + count
        else:
            if pos != numel:
                problems.append(f"{name}: parts cover elements [0, {pos}) of {numel}")
        # the owner of each part is in the layout too: ranks that trade equal parts still diff
        # against bases of their own, so such a version must be a keyframe, not a delta
        out[name] = {"dtype": dtype, "shape": list(shape), "parts": {str(o): k for o, k, _, _, _ in ps},
                     "ranks": {str(o): r for o, _, r, _, _ in ps}}
    if problems:
        raise ShardLayoutError("the ranks' shards do not tile the model: " + "; ".join(problems[:20]))
    return out
