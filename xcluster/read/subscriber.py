"""The subscriber: follows a store and holds verified weights.

``sync()`` polls HEAD (one conditional GET when nothing is new), walks HEAD's chain back to the
version it holds (or to the newest keyframe) with :mod:`xcluster.read.chain`, then applies each
version: fetch chunks in parallel (no lock held), verify every chunk checksum, then — under the
state lock — decode, patch in place, verify every digest. Any failure or interrupt undoes that
version only after every worker has stopped, and raises; the weights stay those of the last
version that verified. ``snapshot()`` reads weights, version and digest together.

This module is the subscriber's face, its configuration, planning (chain.py, checkpoint.py) and
the sync loop; fetching verified chunks is :mod:`.fetch`, patching and verifying weights :mod:`.apply`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from .apply import alloc_fresh, check_limits, fill_block, patch_and_verify, verify_state
from .chain import Link, LinkedManifest, ManifestMemo, Plan, find_link, poll_head, read_manifest, walk_links
from .checkpoint import LoadedCheckpoint, check_checkpoint, list_checkpoints, read_checkpoint
from .fetch import ChunkCache, ChunkFetcher, shielded
from ..errors import (BaseMismatchError, ChainBrokenError, CheckpointMismatchError, ConfigError, FormatError,
                     IntegrityError, ObjectNotFoundError, ResourceLimitError, RollbackError, RunMismatchError,
                     StaleHeadError, XclusterError)
from ..codec.encoding import parse_manifest
from ..format import FULL_KINDS, KEYFRAME, MAX_CHAIN, Head, Manifest, check_run_id, xxh3_128
from ..trust.signing import load_verifier
from ..store import Store, resolve_store

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SubscriberConfig:
    fetch_workers: int = 8
    """Chunks fetched in parallel."""
    decode_workers: int = 2
    """Threads decoding blocks and hashing tensors."""
    integrity_retries: int = 2
    """A chunk or manifest whose bytes fail their checksum is fetched again this many times
    before the version is refused with ChecksumMismatchError."""
    max_model_bytes: int = 1 << 40
    """Refuse a manifest whose weights would need more memory than this (checked before allocating)."""
    max_tensor_bytes: int | None = None
    """Refuse a manifest with a single tensor larger than this, before fetching anything
    (None: only ``max_model_bytes`` bounds it). An allocation that fails anyway raises
    ResourceLimitError."""
    max_block_bytes: int = 8 << 30
    """Refuse, before fetching anything, a version with a block whose decoding would hold more
    than this (``codec.decode.block_memory``, from the manifest's sizes). A block written with
    ``CodecConfig.block_bytes`` B needs about 2-4 B; B is at most 1 GiB."""
    max_plan_bytes: int = 256 << 20
    """Refuse a sync whose chain of manifests (from the target back to what is held, or to the
    keyframe) adds up to more than this many bytes, once read that far: it bounds the work of
    planning. Publishers' ``checkpoint_chain_fraction`` keeps legitimate chains far below it. A
    refused chain is remembered: later syncs raise the same error without reading it again."""
    max_chain: int = MAX_CHAIN
    """Refuse to walk more than this many manifests back from HEAD. Publishers keep chains
    shorter than ``format.MAX_CHAIN`` (their ``keyframe_every`` is capped there), so the default
    accepts every chain a conforming publisher writes; a smaller value trades late-join cost for
    refusing stores whose ``keyframe_every`` exceeds it."""
    chunk_cache_dir: str | None = None
    """Keep verified chunks here until their version is applied, so a process killed halfway
    through a big version resumes without fetching them again. None: chunks live in memory only."""
    chunk_cache_full: bool = True
    """Cache the chunks of full versions (keyframes, checkpoints) too. False caches deltas' chunks
    only, so the cache never holds most of a model (a keyframe cut short is fetched again)."""
    chunk_cache_prune: bool = True
    """Drop a version's cached chunks once it is applied. False: the owner prunes them
    (:meth:`Subscriber.prune_chunk_cache`), e.g. to apply the same deltas to a second copy."""
    trusted_keys: tuple[str, ...] = ()
    """Paths of Ed25519 public keys (PEM, several for a key rotation). Every HEAD and manifest must
    then be signed by one of them, or :class:`SignatureError` is raised and nothing changes. Empty:
    ``$XCLUSTER_TRUSTED_KEYS`` / ``$XCLUSTER_TRUSTED_KEY_FILES`` when set, else no signature checks."""
    run_id: str | None = None
    """Follow only this training run: a HEAD or manifest of another run raises
    :class:`RunMismatchError`. None: with trusted keys, the run of the first version applied (a
    validly signed keyframe of another run is refused all the same); without, any run."""
    max_staleness_s: float | None = None
    """Refuse (``StaleHeadError``, nothing applied, what is held stays) a HEAD committed longer
    ago than this: with signed HEADs, a replayed or frozen store shows as staleness instead of
    passing for the truth. Set it above the longest pause between two publishes."""

    def __post_init__(self) -> None:
        if self.fetch_workers < 1 or self.decode_workers < 1:
            raise ConfigError("fetch_workers and decode_workers must be >= 1")
        if min(self.max_model_bytes, self.max_block_bytes, self.max_tensor_bytes or 1, self.max_plan_bytes) < 1:
            raise ConfigError("max_model_bytes, max_tensor_bytes, max_block_bytes and max_plan_bytes must be >= 1 byte")
        if self.integrity_retries < 0:
            raise ConfigError("integrity_retries must be >= 0")
        if not 1 <= self.max_chain <= MAX_CHAIN:
            raise ConfigError(f"max_chain must be in [1, {MAX_CHAIN}] (format.MAX_CHAIN), got {self.max_chain}")
        if isinstance(self.trusted_keys, (str, bytes)):
            raise ConfigError("trusted_keys is a tuple of paths, not one string")
        if self.run_id is not None:
            try:
                check_run_id(self.run_id)
            except FormatError as exc:
                raise ConfigError(str(exc)) from None
        if self.max_staleness_s is not None and not self.max_staleness_s > 0:
            raise ConfigError(f"max_staleness_s must be > 0 seconds or None, got {self.max_staleness_s}")


@dataclass(frozen=True, slots=True)
class AppliedVersion:
    version: int
    kind: str
    model_digest: str
    applied_unix: float
    bytes_fetched: int
    seconds: float
    fetch_seconds: float = 0.0
    """Fetching and checking the chunks (no lock held)."""
    apply_seconds: float = 0.0
    """Decoding, patching and verifying digests (under the state lock)."""
    committed_unix_ms: int | None = None
    """HEAD's commit time, when this version is the HEAD that was polled."""
    manifest_xxh3_128: str = ""
    bytes_patched: int = 0
    """Bytes of the elements a delta's patches wrote into the tensors held (0 for a full version)."""
    changes: Mapping[str, np.ndarray] | None = None
    """With :attr:`Subscriber.record_changes`, for a delta: the flat positions (int64) of the
    elements it changed, by tensor name (tensors it left alone are absent). None otherwise."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Weights and the version they are, read together (one lock acquisition)."""

    state: dict[str, torch.Tensor]
    version: int | None
    model_digest: str | None
    manifest: Manifest | None
    manifest_xxh3_128: str | None
    manifest_data: bytes | None = None
    """The manifest's bytes as stored (what :meth:`Subscriber.restore` takes back)."""


@dataclass
class SubscriberStats:
    """Counters since the subscriber was created (the daemon exports them as metrics)."""

    bytes_fetched: int = 0
    chunk_cache_hits: int = 0
    refetches: int = 0
    checksum_failures: int = 0
    versions_applied: int = 0
    checkpoints_applied: int = 0
    """Joins (or rejoins after falling behind retention) that started from a checkpoint."""
    checkpoints_refused: int = 0
    """Checkpoints skipped: unreadable, not the version they name, or failing their digests."""


@dataclass(frozen=True, slots=True)
class _Held:
    manifest: Manifest
    xxh3_128: str
    digests: dict[str, str] = field(default_factory=dict)
    data: bytes = b""
    name: str | None = None
    """The manifest object's name (``manifest-<id>.json.zst``) when known (not after a restore)."""

    @property
    def version(self) -> int:
        return self.manifest.version


class Subscriber:
    def __init__(self, url: str | None = None, *, store: Store | None = None,
                 config: SubscriberConfig | None = None,
                 on_apply: Callable[[AppliedVersion], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = resolve_store(url, store, "Subscriber")
        self.config = config or SubscriberConfig()
        self.on_apply = on_apply
        self.on_chunk: Callable[[Manifest, int], None] | None = None
        """Called from fetch threads with each verified chunk's size (progress bars)."""
        self.record_changes = False
        """Record the positions each delta changes (:attr:`AppliedVersion.changes`), for an engine
        updated in place."""
        self.allocate: Callable[[Manifest, str], dict[int, torch.Tensor] | None] | None = None
        """Makes the empty tensors a version fills (those of ``init: none``, by index), e.g. in a
        model directory's memory-mapped files; None, or a call that returns None: in memory."""
        self.stats = SubscriberStats()
        self.verifier = load_verifier(self.config.trusted_keys)
        """Checks signatures when trusted keys are configured (None: no checks)."""
        self._clock = clock
        self._sync_lock = threading.Lock()  # one sync at a time
        self._lock = threading.RLock()  # guards what is held; taken while patching, never while fetching
        self._state: dict[str, torch.Tensor] = {}
        self._held: _Held | None = None
        self._head_etag: str | None = None
        self._head: Head | None = None
        self._floor = 0  # never go below this version (what a restarted daemon had applied)
        # links refused for what their manifest bytes say, while what is held stays the same
        self._refused: dict[tuple[int, str], XclusterError] = {}
        self._refused_for: tuple[int, str] | None = None
        self._bad_checkpoints: set[str] = set()  # checkpoint keys that failed: never tried again
        self._memo = ManifestMemo()  # the daemon's second slot applies the same versions again
        self._verify = True

    # --- what it holds ------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        held = self._held
        return held.version if held else None

    @property
    def model_digest(self) -> str | None:
        held = self._held
        return held.manifest.model_digest if held else None

    @property
    def manifest(self) -> Manifest | None:
        held = self._held
        return held.manifest if held else None

    @property
    def head(self) -> Head | None:
        """The HEAD seen by the last poll."""
        return self._head

    def snapshot(self, *, copy: bool = True) -> Snapshot:
        """Weights, version and digest read together. With ``copy=False`` the tensors are the
        subscriber's own: valid only until the next ``sync()`` patches them."""
        with self._lock:
            held = self._held
            state = {n: t.clone() for n, t in self._state.items()} if copy else dict(self._state)
            if held is None:
                return Snapshot(state=state, version=None, model_digest=None, manifest=None, manifest_xxh3_128=None)
            return Snapshot(state=state, version=held.version, model_digest=held.manifest.model_digest,
                            manifest=held.manifest, manifest_xxh3_128=held.xxh3_128, manifest_data=held.data)

    def state_dict(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The current verified weights (see :meth:`snapshot` to read their version with them)."""
        return self.snapshot(copy=copy).state

    def refuse_below(self, version: int) -> None:
        """Never apply a version below ``version`` (:class:`RollbackError`), even holding nothing:
        a daemon whose saved weights could not be restored still remembers how far it had got."""
        self._floor = max(self._floor, version)

    def restore(self, state: Mapping[str, torch.Tensor], manifest_data: bytes, *, verify: bool = True) -> int:
        """Start from weights kept elsewhere (the daemon's model directory after a restart) and
        the bytes of the manifest they are said to be: every tensor is re-hashed and must match
        the manifest, or :class:`DigestMismatchError` is raised and nothing changes. Returns the
        version now held; later ``sync()`` calls apply only what comes after it.

        ``verify=False`` skips the hashing (names, dtypes and shapes are still checked): only for
        tensors the caller verified itself and has not let anyone change since (the daemon's
        other slot, which held exactly that version when it was last verified)."""
        m = parse_manifest(manifest_data, where="restored manifest")
        where = f"restored version {m.version}"
        self._check_trust(m, None, where=where)
        if verify:
            tensors = verify_state(state, m, workers=self.config.decode_workers, where=where)
        else:
            tensors = _same_layout(state, m, where)
        with self._sync_lock, self._lock:
            self._state = tensors
            self._held = _Held(m, xxh3_128(manifest_data), {t.name: t.digest for t in m.tensors}, manifest_data)
        return m.version

    def release(self) -> None:
        """Drop the weights held and their label (the store still may not go below what was held):
        for an owner about to replace them all, e.g. by a keyframe written into the very files that
        held them (``allocate``, which may call this). The next sync starts as a node holding nothing."""
        with self._lock:
            held = self._held
            if held is not None:
                self._floor = max(self._floor, held.version)
            self._state, self._held = {}, None

    def rebind(self, state: Mapping[str, torch.Tensor]) -> None:
        """Hold ``state`` instead of the tensors held, keeping the version: the caller vouches that
        it is bit for bit what is held (a copy just written from it, e.g. into a model directory
        whose mapped files later patches go to). Names, dtypes and shapes are checked."""
        with self._sync_lock, self._lock:
            held = self._held
            if held is None:
                raise ConfigError("rebind() needs weights held; restore() or sync() first")
            self._state = _same_layout(state, held.manifest, f"rebound version {held.version}")

    def write_checkpoint(self, store: Store | None = None, *, codec=None, upload_workers: int = 4):
        """Write the verified weights held as a checkpoint of their version (FORMAT.md §3a) into
        ``store`` (default: the store followed, e.g. the cluster-local copy a relay fills): nodes
        that join there start from it without a byte across the WAN. Nobody has to trust this
        node: a reader accepts the checkpoint only if it reproduces the version's signed manifest
        and every tensor it decodes hashes to that manifest's digests. Returns the
        :class:`~xcluster.ship.checkpoint.WrittenCheckpoint`, or None when nothing is held."""
        from ..ship.checkpoint import write_checkpoint

        with self._sync_lock:  # no sync patches the weights while they are encoded
            held = self._held
            if held is None or held.name is None:  # restored: the name comes with the next version
                return None
            return write_checkpoint(store or self.store, self._state, held.manifest, held.name, held.xxh3_128,
                                    codec=codec, upload_workers=upload_workers, clock=self._clock)

    # --- following ----------------------------------------------------------------------------
    def poll(self) -> Head | None:
        """The newest committed HEAD: one conditional GET, which costs no body when unchanged."""
        r = poll_head(self.store, self._head_etag)
        if r is not None:
            self._head, self._head_etag = r
        return self._head

    def sync(self, *, until: int | None = None, poll: bool = True, verify: bool = True) -> int | None:
        """Apply every committed version up to HEAD (or up to ``until``); returns the version now
        held (None while the store is empty). A HEAD below what is held raises
        :class:`RollbackError` and changes nothing. ``poll=False``: up to the HEAD the caller's
        own :meth:`poll` just read (no second request).

        ``verify=False`` applies without hashing (chunk checksums are still checked): for an owner
        replaying versions it verified before onto a copy proven to be their base (the daemon's
        second slot). What is held is then *unverified*: the next version applied hashes every
        tensor, and :attr:`verified` is False until then."""
        with self._sync_lock:
            self._verify = verify
            try:
                return self._sync(until, poll)
            finally:
                self._verify = True

    @property
    def verified(self) -> bool:
        """False while what is held was applied with ``sync(verify=False)`` and not verified since."""
        held = self._held
        return held is None or bool(held.digests) or not held.manifest.tensors

    def _sync(self, until: int | None, poll: bool) -> int | None:
        head = self.poll() if poll or self._head is None else self._head
        if head is None:
            return self.version
        held = self._held
        self._check_head(head, held)
        target = Link.of_head(head)
        if until is not None and until < head.version:
            target = find_link(self.store, head, until, max_chain=self.config.max_chain,
                               retries=self.config.integrity_retries, memo=self._memo)
        if held is not None:
            if target.version == held.version and target.xxh3_128 == held.xxh3_128:
                return held.version
            if target.version < held.version:
                raise RollbackError(
                    f"{self.store.url}: HEAD names version {target.version} but this subscriber already "
                    f"holds version {held.version}: the store was rolled back or replaced by an older copy; "
                    f"it keeps serving version {held.version} and refuses to go backwards")
        if target.version < self._floor:
            raise RollbackError(
                f"{self.store.url}: HEAD names version {target.version} but version {self._floor} was already "
                "applied here before a restart: the store was rolled back or replaced by an older copy; "
                "this subscriber refuses to go backwards")
        def reaches_held(lm: LinkedManifest) -> bool:
            m = lm.manifest
            return (held is not None and m.base_version == held.version
                    and m.base_manifest_xxh3_128 == held.xxh3_128)

        def count_retry(_msg: str) -> None:
            self.stats.refetches += 1
            self.stats.checksum_failures += 1

        held_key = None if held is None else (held.version, held.xxh3_128)
        if self._refused_for != held_key or len(self._refused) > 1024:
            self._refused.clear()
            self._refused_for = held_key
        cfg = self.config

        def check(lm: LinkedManifest) -> None:  # before any chunk is fetched
            where = f"{self.store.url}/{lm.link.key}"
            m = lm.manifest
            if m.version == head.version and (m.kind, m.keyframe_version) != (head.kind, head.keyframe_version):
                raise ChainBrokenError(
                    f"{self.store.url}: HEAD says version {head.version} is a {head.kind} of keyframe_version "
                    f"{head.keyframe_version}, its manifest says {m.kind} of {m.keyframe_version}")
            if reaches_held(lm) and m.kind != KEYFRAME and m.keyframe_version != held.manifest.keyframe_version:
                raise ChainBrokenError(
                    f"{where}: keyframe_version {m.keyframe_version} differs from its base's (version "
                    f"{held.version}, keyframe_version {held.manifest.keyframe_version})")
            self._check_trust(m, head, where=where)
            check_limits(m, self.config, where)

        walk = dict(check=check, max_chain=cfg.max_chain, max_bytes=cfg.max_plan_bytes, refused=self._refused,
                    retries=cfg.integrity_retries, on_retry=count_retry, memo=self._memo)
        # A node that holds nothing starts from the newest checkpoint (when there is one); a
        # node that follows walks back to what it holds and downloads deltas only, unless
        # retention removed them (then from a checkpoint newer than what it holds).
        while True:  # a checkpoint that fails to apply is set aside: plan again without it
            plan, cp = self._plan(target, held, reaches_held, walk)
            links, first = plan.links, plan.oldest
            del plan  # the oldest is dropped once applied, like the ones read again after it
            if cp is None:
                break
            try:  # the checkpoint stands for the oldest link: applied in its place, labelled as it
                self._apply(cp.manifest, cp.xxh3_128, cp.data, head, where=f"{self.store.url}/{cp.key}",
                            label=first)
            except (IntegrityError, ChainBrokenError, FormatError, ResourceLimitError) as exc:
                log.warning("checkpoint %s/%s refused (%s: %s); trying without it", self.store.url, cp.key,
                            type(exc).__name__, exc)
                self._bad_checkpoints.add(cp.key)
                self.stats.checkpoints_refused += 1
                continue
            self.stats.checkpoints_applied += 1
            links, first = links[1:], None
            break
        for link in links:  # later ones read again, hash-checked: one parsed manifest held at a time
            lm = first if first is not None else read_manifest(self.store, link, retries=cfg.integrity_retries,
                                                               on_retry=count_retry, memo=self._memo)
            first = None
            self._apply(lm.manifest, lm.link.xxh3_128, lm.data, head, where=f"{self.store.url}/{lm.link.key}",
                        name=lm.link.manifest)
            del lm
        return self.version

    def _plan(self, target: Link, held: _Held | None, reaches_held: Callable[[LinkedManifest], bool],
              walk: dict) -> tuple[Plan, LoadedCheckpoint | None]:
        """What to apply: a node that holds nothing starts from the newest usable checkpoint (when
        there is one); a node that follows walks back to what it holds and downloads deltas only,
        unless they are gone (retention): then from a checkpoint newer than what it holds."""
        if held is None:
            plan, cp = self._checkpoint_plan(target, reaches_held, walk, 0)
            if plan is not None:
                return plan, cp
        try:
            return walk_links(self.store, target, stop=reaches_held, **walk), None
        except ChainBrokenError as exc:
            if held is None:
                raise
            plan, cp = self._checkpoint_plan(target, reaches_held, walk, held.version)
            if plan is None:
                raise
            log.warning("%s; continuing from checkpoint %s", exc, cp.key if cp else "(none)")
            return plan, cp

    def _checkpoint_plan(self, target: Link, reaches_held: Callable[[LinkedManifest], bool], walk: dict,
                         above: int) -> tuple[Plan | None, LoadedCheckpoint | None]:
        """The plan from the newest usable checkpoint above version ``above`` up to ``target``:
        HEAD's chain walked back to the checkpoint's version, whose committed manifest the
        checkpoint must reproduce (checkpoint.py). ``(None, None)`` when no checkpoint serves;
        ``(plan, None)`` when the walk met a keyframe or what is held first."""
        for ref in list_checkpoints(self.store, at_most=target.version):
            if ref.version <= above:
                break
            if ref.key in self._bad_checkpoints:
                continue
            where = f"{self.store.url}/{ref.key}"
            try:
                cp = read_checkpoint(self.store, ref)
            except (FormatError, IntegrityError, ObjectNotFoundError) as exc:
                log.warning("skipping checkpoint %s (%s): %s", where, type(exc).__name__, exc)
                self._bad_checkpoints.add(ref.key)
                self.stats.checkpoints_refused += 1
                continue
            v = ref.version
            plan = walk_links(self.store, target, stop=lambda lm: reaches_held(lm) or lm.version == v, **walk)
            oldest = plan.oldest
            if oldest.version != v or oldest.manifest.kind == KEYFRAME:
                return plan, None
            try:
                check_checkpoint(cp.manifest, oldest.manifest, oldest.link.xxh3_128, oldest.link.manifest, where=where)
                check_limits(cp.manifest, self.config, where)
            except (CheckpointMismatchError, ResourceLimitError) as exc:
                log.warning("skipping checkpoint (%s): %s", type(exc).__name__, exc)
                self._bad_checkpoints.add(ref.key)
                self.stats.checkpoints_refused += 1
                continue
            return plan, cp
        return None, None

    # --- trust ----------------------------------------------------------------------------------
    def _check_head(self, head: Head, held: _Held | None) -> None:
        """Signature, run and freshness of a HEAD, before anything it names is read."""
        where = f"{self.store.url}/HEAD (version {head.version})"
        if self.verifier is not None:
            self.verifier.verify(head, where=where)
        self._check_run(head.run_id, held, where=where)
        max_age = self.config.max_staleness_s
        if max_age is not None:
            age = self._clock() - head.committed_unix_ms / 1000
            if age > max_age:
                keeps = f"keeps serving version {held.version}" if held else "holds no weights yet"
                raise StaleHeadError(
                    f"{where} was committed {age:.0f} s ago, more than max_staleness_s ({max_age:g} s): the trainer "
                    f"stopped publishing, or the store is frozen or replaying an old HEAD; this subscriber {keeps}")

    def _check_trust(self, m: Manifest, head: Head | None, *, where: str) -> None:
        """A manifest's signature and run, before any of its chunks is fetched."""
        if self.verifier is not None:
            self.verifier.verify(m, where=where)
            if head is not None and m.run_id != head.run_id:
                raise RunMismatchError(f"{where} belongs to run {m.run_id!r}, HEAD to run {head.run_id!r}")
        self._check_run(m.run_id, self._held, where=where)

    def _check_run(self, run_id: str | None, held: _Held | None, *, where: str) -> None:
        want = self.config.run_id
        if want is not None and run_id != want:
            raise RunMismatchError(f"{where} belongs to run {run_id!r}; this subscriber follows run {want!r}")
        if self.verifier is None:
            return  # unsigned, anything can be forged: run ids are only enforced with signatures (or a pin)
        have = held.manifest.run_id if held is not None else None
        if have is not None and run_id is not None and run_id != have:
            raise RunMismatchError(
                f"{where} belongs to run {run_id!r}, but the weights held (version {held.version}) are of run "
                f"{have!r}: another run's versions were put under this prefix; this subscriber keeps serving "
                f"version {held.version}")

    # --- applying -----------------------------------------------------------------------------
    def _chunk_cache(self) -> ChunkCache | None:
        root = self.config.chunk_cache_dir
        return None if root is None else ChunkCache(root)

    def prune_chunk_cache(self, up_to: int | None = None) -> None:
        """Drop cached chunks of versions up to ``up_to`` (default: the one held; they were applied)."""
        cache, held = self._chunk_cache(), self._held
        if up_to is None and held is not None:
            up_to = held.version
        if cache is not None and up_to is not None:
            cache.prune(up_to)

    def _apply(self, m: Manifest, mhash: str, data: bytes, head: Head, *, where: str,
               label: LinkedManifest | None = None, name: str | None = None) -> None:
        """Apply manifest ``m`` (a version's, or with ``label`` a checkpoint, which is held as the
        version manifest ``label`` once it verified): fetch and verify its chunks with no lock
        held, filling the tensors that start empty as they arrive (fetch.py); then, under the
        lock, patch and verify (apply.py)."""
        t0 = time.perf_counter()
        cfg = self.config
        check_limits(m, cfg, where)
        cache = self._chunk_cache() if cfg.chunk_cache_full or m.kind not in FULL_KINDS else None
        fetcher = ChunkFetcher(self.store, self.stats, integrity_retries=cfg.integrity_retries,
                               workers=cfg.fetch_workers, decode_workers=cfg.decode_workers, cache=cache)
        fresh = self.allocate(m, where) if self.allocate is not None else None
        if fresh is None:
            fresh = alloc_fresh(m, where)
        chunks = fetcher.stream(m, mhash, lambda bi, chunk: fill_block(m, bi, chunk, fresh, where),
                                on_chunk=self.on_chunk)
        t1 = time.perf_counter()
        with self._lock:  # on a thread of its own: an interrupt waits until weights and label agree
            changes: dict | None = {} if self.record_changes and m.kind not in FULL_KINDS else None
            patched = shielded(lambda: self._patch_and_verify(m, mhash, chunks, fresh, where, data, label, name,
                                                              changes))
        chunks.clear()  # free the compressed bytes now
        fresh.clear()
        self.stats.versions_applied += 1
        if cfg.chunk_cache_prune:
            self.prune_chunk_cache()
        t2 = time.perf_counter()
        ev = AppliedVersion(version=m.version, kind=m.kind, model_digest=m.model_digest, applied_unix=time.time(),
                            bytes_fetched=m.chunk_bytes, seconds=t2 - t0, fetch_seconds=t1 - t0,
                            apply_seconds=t2 - t1, bytes_patched=patched, changes=changes,
                            manifest_xxh3_128=mhash if label is None else label.link.xxh3_128,
                            committed_unix_ms=head.committed_unix_ms if head.version == m.version else None)
        log.info("applied version %d (%s, %d bytes) in %.3fs", m.version, m.kind, m.chunk_bytes, ev.seconds)
        if self.on_apply is not None:
            self.on_apply(ev)

    def _patch_and_verify(self, m: Manifest, mhash: str, chunks: dict[int, bytes], fresh: dict[int, torch.Tensor],
                          where: str, data: bytes, label: LinkedManifest | None = None,
                          name: str | None = None, changes: dict | None = None) -> int:
        """Patch ``m`` onto what is held, verify, and swap weights and label together
        (apply.py); on any failure what is held stays, bit for bit."""
        held = self._held
        is_key = m.kind in FULL_KINDS
        if not is_key and (held is None or m.base_version != held.version
                           or m.base_manifest_xxh3_128 != held.xxh3_128):
            raise BaseMismatchError(f"{where}: delta on version {m.base_version} ({m.base_model_digest}) but "
                                    f"this subscriber holds {self.version} ({self.model_digest})")
        verified = {t.name: t.digest for t in m.tensors} if self._verify else {}
        held_as = _Held(m, mhash, verified, data, name) if label is None else \
            _Held(label.manifest, label.link.xxh3_128, verified, label.data, label.link.manifest)

        def swap(state: dict[str, torch.Tensor]) -> None:  # one statement: weights and label move together
            self._state, self._held = state, held_as

        return patch_and_verify(m, chunks, fresh, where, base=self._state,
                         digests=held.digests if held is not None and not is_key else {},
                         workers=self.config.decode_workers, commit=swap, verify=self._verify,
                         changes=changes)


def _same_layout(state: Mapping[str, torch.Tensor], m: Manifest, where: str) -> dict[str, torch.Tensor]:
    """``state`` by name, after checking it has exactly ``m``'s tensors with their dtypes and shapes."""
    from ..codec.dtypes import dtype_name
    from ..errors import DigestMismatchError

    if set(state) != {t.name for t in m.tensors}:
        raise DigestMismatchError(f"{where}: tensor names differ from the manifest's")
    for t in m.tensors:
        cur = state[t.name]
        if dtype_name(cur.dtype) != t.dtype or tuple(cur.shape) != t.shape:
            raise DigestMismatchError(f"{where}: {t.name} is {dtype_name(cur.dtype)}{tuple(cur.shape)}, the "
                                      f"manifest says {t.dtype}{t.shape}")
    return {t.name: state[t.name] for t in m.tensors}


__all__ = ["AppliedVersion", "Snapshot", "Subscriber", "SubscriberConfig", "SubscriberStats"]
