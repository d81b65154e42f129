"""``xcluster relay SRC DST``: one WAN copy per cluster (torch-free).

A relay mirrors committed versions from a remote store (SRC) into a cluster-local one (DST: a
SeaweedFS or MinIO in the same datacenter, or any URL) **verbatim** — the same chunk objects,
files, manifests and HEAD bytes, signatures included — so every subscriber behind it reads the
local copy and verifies it exactly as it would the original. Per cycle:

1. Poll SRC's HEAD (one conditional GET). Nothing new: done.
2. Walk SRC's chain back from HEAD (chain.py: each manifest checked against its link) to the
   version DST's HEAD names: only deltas cross the WAN for a destination that follows. A
   destination that holds nothing (or whose version SRC no longer keeps) starts from SRC's
   newest checkpoint (checked against the chain, checkpoint.py) instead of the chain's keyframe.
3. Oldest first, copy each version's chunks and files — each fetched once, its size and XXH3-128
   checked against the manifest before it is written, skipped when DST already holds a copy of
   that size and XXH3-128 (a corrupt copy is copied again) — then its manifest (same name, same bytes).
4. Compare-and-swap DST's HEAD to SRC's HEAD bytes. Local subscribers see only complete versions,
   in commit order.
5. Checkpoints for local joiners: a checkpoint crosses the WAN only when DST has none within
   ``checkpoint_lag`` versions of HEAD. Run one subscriber in the cluster with
   ``--write-checkpoints`` and DST gets fresh checkpoints from verified local state instead.

Nothing that fails to verify is written (the cycle raises and is retried with backoff). A HEAD
below what DST holds is refused (:class:`RollbackError`), never propagated. A relay killed at any
moment leaves DST's HEAD on a complete version; the next run skips what was already copied.

The relay writes a lease into SRC (what it holds and what it is copying), so SRC's retention keeps
what it still needs; DST's retention follows the local subscribers' leases (``gc``). Relays chain:
DST of one is SRC of the next. Subscribers never trust a relay: signatures and hashes are checked
end to end.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..read.chain import Link, LinkedManifest, Plan, read_manifest, walk_links
from ..read.checkpoint import LoadedCheckpoint, check_checkpoint, list_checkpoints, read_checkpoint
from ..errors import (ChainBrokenError, ChecksumMismatchError, ConcurrentPublisherError, ConfigError, FormatError,
                     ObjectNotFoundError, PreconditionFailedError, RollbackError, RunMismatchError, StoreError,
                     TruncatedObjectError, XclusterError)
from ..format import (CHECKPOINT, HEAD_KEY, KEYFRAME, KIND_TAG, MAX_CHAIN, Head, Lease, check_node_id, check_run_id,
                     chunk_key, file_key, lease_key, object_key, parse_head, xxh3_128)
from .retention import RetentionConfig, gc
from ..util.retry import Backoff, retry_integrity
from ..trust.signing import load_verifier
from ..store import Store, resolve_store

log = logging.getLogger(__name__)


def default_relay_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname()) or "host"
    return f"relay-{host}"[:128]


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    poll_s: float = 1.0
    """Seconds between polls of SRC's HEAD."""
    backoff_max_s: float = 30.0
    """Longest wait between cycles while they fail (exponential backoff with full jitter)."""
    once: bool = False
    """Copy what is there, then return."""
    workers: int = 8
    """Objects copied in parallel (memory: about ``workers`` × the largest chunk)."""
    integrity_retries: int = 2
    """An object whose bytes fail their checksum is fetched again this many times, then refused."""
    node_id: str = field(default_factory=default_relay_id)
    """Name of this relay's lease in SRC (``leases/<node_id>.json``)."""
    lease_every_s: float = 5.0
    """Seconds between lease writes into SRC (0: none)."""
    trusted_keys: tuple[str, ...] = ()
    """Ed25519 public keys: copy only HEADs and manifests signed by one of them (subscribers
    check again). Empty: ``$XCLUSTER_TRUSTED_KEYS`` when set, else signatures are copied unchecked."""
    gc: RetentionConfig | None = None
    """Run retention on DST (by the local subscribers' leases) whenever DST gained a keyframe or a
    newer checkpoint (copied, or written there by a local subscriber)."""
    checkpoint_lag: int | None = 256
    """Copy SRC's newest checkpoint when DST's newest is this many versions or more behind HEAD
    (DST holding none counts as 0): local joiners then never walk more deltas than that. A local
    subscriber with ``--write-checkpoints`` keeps DST fresher without WAN bytes. None: only when
    DST starts empty."""
    run_id: str | None = None
    """Relay only this training run: a HEAD or manifest of another run raises
    :class:`RunMismatchError` before anything is copied (DST keeps its version). None: the run of
    the HEAD DST already holds, else of the first version this relay copies."""
    max_plan_bytes: int = 256 << 20
    """Refuse (:class:`ResourceLimitError`, nothing copied) a cycle whose chain of manifests, from
    SRC's HEAD back to what DST holds or to the keyframe, adds up to more than this many bytes.
    The walk holds one parsed manifest at a time; each is read again, hash-checked, to copy it."""

    def __post_init__(self) -> None:
        if not self.poll_s > 0 or self.backoff_max_s < self.poll_s:
            raise ConfigError("poll_s must be > 0 and backoff_max_s >= poll_s")
        if self.workers < 1 or self.integrity_retries < 0 or self.lease_every_s < 0:
            raise ConfigError("workers must be >= 1, integrity_retries and lease_every_s >= 0")
        if isinstance(self.trusted_keys, (str, bytes)):
            raise ConfigError("trusted_keys is a tuple of paths, not one string")
        if self.max_plan_bytes < 1:
            raise ConfigError("max_plan_bytes must be >= 1 byte")
        if self.checkpoint_lag is not None and self.checkpoint_lag < 1:
            raise ConfigError("checkpoint_lag must be >= 1 or None")
        if self.run_id is not None:
            try:
                check_run_id(self.run_id)
            except FormatError as exc:
                raise ConfigError(str(exc)) from None
        check_node_id(self.node_id)


@dataclass
class RelayStats:
    """Counters since the relay started."""

    versions_copied: int = 0
    checkpoints_copied: int = 0
    objects_copied: int = 0
    objects_present: int = 0
    """Already in DST (a restart after a crash, or a file unchanged since an earlier version)."""
    bytes_from_source: int = 0
    """Bytes read from SRC: what crosses the WAN (HEAD polls excluded)."""
    bytes_to_destination: int = 0
    refetches: int = 0
    failures: int = 0
    last_error: str | None = None


class Relay:
    """Mirrors ``src`` into ``dst``; ``run()`` blocks until stopped, ``step()`` runs one cycle."""

    def __init__(self, src: str | None = None, dst: str | None = None, *, config: RelayConfig | None = None,
                 src_store: Store | None = None, dst_store: Store | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.src = resolve_store(src, src_store, "Relay (source)")
        self.dst = resolve_store(dst, dst_store, "Relay (destination)")
        self.config = config or RelayConfig()
        self.verifier = load_verifier(self.config.trusted_keys)
        self.stats = RelayStats()
        self._stats_lock = threading.Lock()  # copy workers count concurrently
        self._clock = clock
        self._stop = threading.Event()
        self._src_etag: str | None = None
        self._src_head: tuple[Head, bytes] | None = None
        self._dst_head: Head | None = None
        self._dst_etag: str | None = None
        self._dst_read = False
        self._target: int | None = None
        self._lease_at = float("-inf")
        self._files_done: set[str] = set()
        self._run_id: str | None = self.config.run_id
        """The run relayed: the pin, else DST's HEAD's run, else the first copied HEAD's."""
        self._refused: dict[tuple[int, str], XclusterError] = {}
        self._refused_for: tuple[int, str] | None = None
        self._gc_checkpoint: int | None = None  # DST's newest checkpoint at the last retention run

    @property
    def version(self) -> int | None:
        """The version DST's HEAD names (as this relay last wrote or read it)."""
        return self._dst_head.version if self._dst_head else None

    # --- loop -------------------------------------------------------------------------------------
    def run(self) -> int:
        backoff = Backoff(self.config.poll_s, self.config.backoff_max_s)
        while not self._stop.is_set():
            try:
                self.step()
                backoff.reset()
                ok = True
            except (StoreError, XclusterError) as exc:
                ok = False
                self.stats.failures += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("relay cycle failed (DST keeps version %s): %s", self.version, self.stats.last_error)
            self._write_lease()
            if self.config.once:
                return 0 if ok else 1
            self._stop.wait(self.config.poll_s if ok else backoff.next_delay())
        self._write_lease(force=True)
        return 0

    def stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> Callable[[], None]:
        """SIGTERM / SIGINT: finish the cycle in progress (a half-copied version stays invisible), exit 0.
        Returns a function that puts the previous handlers back."""
        def handler(signum, _frame) -> None:
            log.info("signal %d: stopping after the current cycle", signum)
            self.stop()
        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        return lambda: [signal.signal(s, h) for s, h in old.items()] and None

    def step(self) -> int | None:
        """One cycle: copy what SRC's HEAD names and DST lacks; returns DST's version after it."""
        if not self._dst_read:
            self._dst_head, self._dst_etag = self._read_dst_head()
            self._dst_read = True
            if self._run_id is None and self._dst_head is not None:
                self._run_id = self._dst_head.run_id
        try:
            blob = self.src.get(HEAD_KEY, if_none_match=self._src_etag)
        except ObjectNotFoundError:
            return self.version  # SRC is empty
        if blob is not None:
            self._src_head = (parse_head(blob.data, where=f"{self.src.url}/{HEAD_KEY}"), bytes(blob.data))
            self._src_etag = blob.etag
        if self._src_head is None:
            return self.version
        head, head_bytes = self._src_head
        have = self._dst_head
        if have is not None and (have.version, have.manifest_xxh3_128) == (head.version, head.manifest_xxh3_128):
            return self.version
        if have is not None and head.version < have.version:
            raise RollbackError(f"{self.src.url}: HEAD names version {head.version}, below the {have.version} that "
                                f"{self.dst.url} holds: the source was rolled back; the relay does not propagate it")
        if self.verifier is not None:
            self.verifier.verify(head, where=f"{self.src.url}/{HEAD_KEY}")
        self._check_run(head.run_id, where=f"{self.src.url}/{HEAD_KEY} (version {head.version})")
        self._target = head.version
        self._write_lease(force=True)
        held = Link.of_head(have) if have is not None else None
        held_key = None if have is None else (have.version, have.manifest_xxh3_128)
        if self._refused_for != held_key or len(self._refused) > 1024:
            self._refused.clear()
            self._refused_for = held_key

        def reaches_held(lm: LinkedManifest) -> bool:  # a delta on what DST holds: its base is not read
            return held is not None and lm.manifest.kind != KEYFRAME and Link.base_of(lm.manifest) == held

        def check(lm: LinkedManifest) -> None:  # every manifest of the plan, before anything is copied
            self._count(bytes_from_source=len(lm.stored))
            where = f"{self.src.url}/{lm.link.key}"
            m = lm.manifest
            if self.verifier is not None:
                self.verifier.verify(m, where=where)
            self._check_run(m.run_id, where=where)
            if m.run_id != head.run_id:
                raise RunMismatchError(f"{where} belongs to run {m.run_id!r}, HEAD to run {head.run_id!r}")
            if reaches_held(lm) and m.keyframe_version != have.keyframe_version:
                raise ChainBrokenError(f"{where}: keyframe_version {m.keyframe_version} differs from its base's "
                                       f"(version {have.version}: {have.keyframe_version}): one of them lies")

        walk = dict(check=check, max_chain=MAX_CHAIN, max_bytes=self.config.max_plan_bytes, refused=self._refused,
                    retries=self.config.integrity_retries, on_retry=self._count_retry)
        plan, cp = (None, None) if have is not None else self._checkpoint_plan(head, reaches_held, walk)
        if plan is None:
            try:
                plan = walk_links(self.src, Link.of_head(head), stop=reaches_held, **walk)
            except ChainBrokenError as exc:  # SRC no longer keeps what follows DST's version
                if have is None:
                    raise
                plan, cp = self._checkpoint_plan(head, reaches_held, walk)
                if plan is None:
                    raise
                log.warning("%s; DST continues from checkpoint %s", exc, cp.key)
        links, first = plan.links, plan.oldest
        del plan
        keyframe = False
        self._files_done = set()
        if cp is not None:  # the checkpoint stands for the oldest version: its manifest, not its chunks
            self._copy_checkpoint(cp)
            self._copy_version(first, chunks=False)
            links, first = links[1:], None
        for link in links:  # one parsed manifest at a time: later ones read again, hash-checked
            if first is not None:
                lm, first = first, None
            else:
                lm = read_manifest(self.src, link, retries=self.config.integrity_retries, on_retry=self._count_retry)
                self._count(bytes_from_source=len(lm.stored))
            self._copy_version(lm)
            keyframe |= lm.manifest.kind == KEYFRAME
            del lm
        self._commit(head, head_bytes)
        newest = self._refresh_checkpoint(head, reaches_held, walk)
        if self._run_id is None:
            self._run_id = head.run_id  # the first version copied pins the run
        self._target = None
        self._write_lease(force=True)
        log.info("relayed up to version %d (%d version(s) copied)", head.version, len(links))
        if self.config.gc is not None and (keyframe or newest != self._gc_checkpoint):
            self._gc_checkpoint = newest
            try:
                report = gc(self.dst, config=self.config.gc, now=self._clock, apply=True)
                log.info("retention on %s: deleted %d objects (%d bytes)", self.dst.url, len(report.deleted),
                         report.bytes)
            except Exception:  # housekeeping never fails a relay cycle
                log.warning("retention on %s failed", self.dst.url, exc_info=True)
        return self.version

    # --- checkpoints ------------------------------------------------------------------------------
    def _checkpoint_plan(self, head: Head, reaches_held, walk: dict) -> tuple[Plan | None, LoadedCheckpoint | None]:
        """SRC's chain from HEAD back to its newest usable checkpoint, and that checkpoint; ``(plan,
        None)`` when a keyframe or DST's version comes first; ``(None, None)`` when none serves."""
        for ref in list_checkpoints(self.src, at_most=head.version):
            try:
                cp = read_checkpoint(self.src, ref)
            except (XclusterError, ObjectNotFoundError) as exc:
                log.warning("skipping checkpoint %s/%s: %s", self.src.url, ref.key, exc)
                continue
            self._count(bytes_from_source=len(cp.stored))
            v = ref.version
            plan = walk_links(self.src, Link.of_head(head), stop=lambda lm: reaches_held(lm) or lm.version == v,
                              **walk)
            oldest = plan.oldest
            if oldest.version != v or oldest.manifest.kind == KEYFRAME:
                return plan, None
            try:
                check_checkpoint(cp.manifest, oldest.manifest, oldest.link.xxh3_128, oldest.link.manifest,
                                 where=f"{self.src.url}/{ref.key}")
            except XclusterError as exc:
                log.warning("skipping checkpoint: %s", exc)
                continue
            return plan, cp
        return None, None

    def _copy_checkpoint(self, cp: LoadedCheckpoint) -> None:
        """A checkpoint's chunks (verified like a version's), then its manifest, create-once."""
        m = cp.manifest
        tags = {KIND_TAG: CHECKPOINT}
        jobs = [(object_key(m, c.name), c.size, c.xxh3_128, tags) for c in m.chunks]
        with ThreadPoolExecutor(max_workers=self.config.workers) as pool:
            for _ in pool.map(lambda job: self._copy_object(*job), jobs):
                pass
        try:
            self.dst.put(cp.key, cp.stored, if_none_match=True, tags=tags)
        except PreconditionFailedError:
            pass  # already there (a restart): same name, and a reader checks it whatever it holds
        self._count(bytes_to_destination=len(cp.stored), checkpoints_copied=1)

    def _refresh_checkpoint(self, head: Head, reaches_held, walk: dict) -> int | None:
        """After a cycle: copy SRC's newest checkpoint when DST's newest is ``checkpoint_lag`` or
        more versions behind HEAD. Returns DST's newest checkpoint version after it."""
        dst_refs = list_checkpoints(self.dst, at_most=head.version)
        newest = dst_refs[0].version if dst_refs else None
        lag = self.config.checkpoint_lag
        if lag is None or head.version - (newest or 0) < lag:
            return newest
        src_refs = list_checkpoints(self.src, at_most=head.version)
        if not src_refs or src_refs[0].version <= (newest or 0):
            return newest
        try:
            plan, cp = self._checkpoint_plan(head, lambda lm: False, walk)
            if cp is not None and cp.manifest.version > (newest or 0):
                self._copy_checkpoint(cp)
                return cp.manifest.version
        except (StoreError, XclusterError) as exc:  # DST's versions are all there: the next cycle tries again
            log.warning("could not copy a checkpoint into %s: %s", self.dst.url, exc)
        return newest

    # --- copying ----------------------------------------------------------------------------------
    def _copy_version(self, lm: LinkedManifest, *, chunks: bool = True) -> None:
        m = lm.manifest
        where = f"{self.src.url}/{lm.link.key}"
        if self.verifier is not None:
            self.verifier.verify(m, where=where)
        tags = {KIND_TAG: m.kind}
        jobs = [(chunk_key(m.version, c.name), c.size, c.xxh3_128, tags) for c in m.chunks] if chunks else []
        jobs += [(file_key(f.xxh3_128), f.size, f.xxh3_128, None) for f in m.files
                 if f.xxh3_128 not in self._files_done]  # content-addressed: once per cycle
        self._files_done.update(f.xxh3_128 for f in m.files)
        with ThreadPoolExecutor(max_workers=self.config.workers) as pool:
            for _ in pool.map(lambda job: self._copy_object(*job), jobs):
                pass  # map re-raises the first failure
        # the manifest last: nothing names it until DST's HEAD does, so rewriting it is harmless
        self.dst.put(lm.link.key, lm.stored, tags=tags)  # as stored: packed stays packed
        self._count(bytes_to_destination=len(lm.stored), versions_copied=1)

    def _copy_object(self, key: str, size: int, digest: str, tags: dict[str, str] | None) -> None:
        try:  # bounded, like the source read; a copy of the right size can still be corrupt: hash it
            held = self.dst.get_range(key, 0, size + 1)
        except ObjectNotFoundError:
            pass
        else:
            ok = len(held) == size and xxh3_128(held) == digest
            del held
            if ok:
                self._count(objects_present=1)
                return
            log.warning("%s/%s does not match its manifest (size or XXH3-128): copying it again", self.dst.url, key)
        where = f"{self.src.url}/{key}"
        seen = (0, "")  # the last attempt's length and XXH3-128, for its log line

        def fetch() -> bytes:
            nonlocal seen
            data = self.src.get_range(key, 0, size + 1)  # bounded: a longer object is detected, not read
            self._count(bytes_from_source=len(data))
            got = xxh3_128(data)
            if len(data) == size and got == digest:
                return data
            seen = (len(data), got)
            if len(data) != size:
                raise TruncatedObjectError(f"{where} is {len(data)}{'+' if len(data) > size else ''} bytes, "
                                           f"its manifest says {size}: not copied")
            raise ChecksumMismatchError(f"{where} hashes to {got}, its manifest says {digest}: not copied")

        def failed(_exc: BaseException, n: int) -> None:  # every failed attempt counts, the last included
            self._count_retry(f"{where}: {seen[0]} bytes hashing to {seen[1]} (attempt {n})")

        data = retry_integrity(fetch, attempts=self.config.integrity_retries + 1, on_failure=failed)
        self.dst.put(key, data, tags=tags)
        self._count(objects_copied=1, bytes_to_destination=size)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, d in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + d)

    def _commit(self, head: Head, head_bytes: bytes) -> None:
        try:
            if self._dst_etag is None:
                etag = self.dst.put(HEAD_KEY, head_bytes, if_none_match=True)
            else:
                etag = self.dst.put(HEAD_KEY, head_bytes, if_match=self._dst_etag)
        except PreconditionFailedError:
            self._dst_read = False  # look again next cycle
            raise ConcurrentPublisherError(
                f"{self.dst.url}/{HEAD_KEY} changed under this relay: another relay or publisher writes this "
                "prefix; run one writer per destination") from None
        self._dst_head, self._dst_etag = head, etag

    def _read_dst_head(self) -> tuple[Head | None, str | None]:
        try:
            blob = self.dst.get(HEAD_KEY)
        except ObjectNotFoundError:
            return None, None
        return parse_head(blob.data, where=f"{self.dst.url}/{HEAD_KEY}"), blob.etag

    def _check_run(self, run_id: str | None, *, where: str) -> None:
        want = self._run_id
        if want is not None and run_id != want:
            pinned = "this relay was given" if self.config.run_id is not None else f"{self.dst.url} holds"
            raise RunMismatchError(f"{where} belongs to run {run_id!r}; {pinned} run {want!r}: another run's "
                                   f"versions are under this prefix; nothing copied, DST keeps version {self.version}")

    def _count_retry(self, msg: str) -> None:
        log.warning("%s", msg)
        self._count(refetches=1)

    # --- lease in SRC -------------------------------------------------------------------------------
    def _write_lease(self, *, force: bool = False) -> None:
        every = self.config.lease_every_s
        now = time.monotonic()
        if every <= 0 or (not force and now - self._lease_at < every):
            return
        self._lease_at = now
        have = self._dst_head
        src = self._src_head[0] if self._src_head else None
        lease = Lease(node_id=self.config.node_id, version=have.version if have else None,
                      target_version=self._target, model_digest=None,
                      updated_unix_ms=int(self._clock() * 1000), last_error=self.stats.last_error,
                      committed_unix_ms=have.committed_unix_ms if have else None,
                      head_version=src.version if src else None)
        try:
            self.src.put(lease_key(self.config.node_id), lease.to_bytes())
        except Exception as exc:  # advisory: a read-only credential on SRC still relays
            log.warning("could not write %s to %s: %s", lease_key(self.config.node_id), self.src.url, exc)


__all__ = ["Relay", "RelayConfig", "RelayStats", "default_relay_id"]
