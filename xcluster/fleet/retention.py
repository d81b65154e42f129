"""Retention (``xcluster gc``), torch-free: keep what HEAD, joiners and live subscribers need, delete the rest.

Kept, whatever else is asked:

1. HEAD, and HEAD's chain back to the oldest of its newest ``keep_checkpoints`` checkpoints (or
   to its keyframe, when it has fewer): each manifest on it and every chunk it names, and those
   checkpoints (manifest and chunks). A checkpoint counts only if it reproduces the version it
   names on HEAD's chain (checkpoint.py); others go.
2. For every *live* lease (updated within ``lease_ttl_s``): what that subscriber still needs to
   follow by deltas alone: HEAD's chain from the version after the one it holds. If it is fetching
   a target that is not on HEAD's chain (it read HEAD just before a forced keyframe), every object
   under the version directories from the keyframe at or below its applied version (or, when that
   cannot be read, from its applied version) up to its target.
3. ``files/<hash>`` named by any kept manifest, including every manifest in a lease-kept version.
4. Anything modified less than ``grace_s`` ago: in-flight fetches, a slow publisher's attempt
   whose HEAD write may still land, a checkpoint being written. Objects whose age the store cannot
   tell are kept.

Everything else under ``versions/``, ``checkpoints/`` and ``files/`` goes: versions behind what
joiners and leases need, older checkpoints, and the leftovers of failed attempts. Leases expired
for more than ``lease_expiry_factor × lease_ttl_s`` are deleted too. Dry run unless ``apply=True``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..read.chain import Link, read_head, read_manifest
from ..read.checkpoint import CheckpointRef, check_checkpoint, checkpoint_version_of, list_checkpoints, read_checkpoint
from ..errors import ChainBrokenError, ConfigError, ObjectNotFoundError, XclusterError
from ..format import (CHECKPOINT_PREFIX, INFLIGHT_PREFIX, KEYFRAME, MAX_LEASE_BYTES, MAX_MANIFEST_BYTES, Lease,
                     Manifest, chunk_key, file_key, is_manifest_name, object_key, parse_lease, parse_manifest,
                     version_dir)
from ..format.packing import unpack
from ..store import Store

log = logging.getLogger(__name__)
_VERSION_KEY = re.compile(r"versions/(\d{12})/(.+)")
_CHECKPOINT_OBJECT = re.compile(r"checkpoints/(\d{12})/(.+)")
_ATTEMPT_OBJECT = re.compile(r"c([a-z0-9]{1,32})-\d+\.xc|manifest-([a-z0-9]{1,32})\.json\.zst")


@dataclass(frozen=True, kw_only=True)
class RetentionConfig:
    lease_ttl_s: float = 300.0
    """A lease updated within this many seconds protects what its subscriber needs."""
    grace_s: float = 3600.0
    """No object modified within this many seconds is deleted: far beyond the longest request, so
    a fetch in flight or a HEAD write that is still travelling never loses what it needs."""
    lease_expiry_factor: float = 30.0
    """Leases older than this many TTLs are deleted (their subscriber is long gone)."""
    keep_checkpoints: int = 2
    """The newest this many checkpoints on HEAD's chain are kept, with the deltas from the oldest of
    them to HEAD: a node joins from the newest, or from the one before should the newest fail."""
    max_clock_skew_s: float = 300.0
    """A lease dated more than this many seconds ahead of gc's clock protects nothing (it is
    reported in ``GcReport.future_leases``): a node's clock that far off, or a forged lease, would
    otherwise pin its versions forever."""

    def __post_init__(self) -> None:
        if not self.lease_ttl_s > 0 or self.grace_s < 0 or not self.lease_expiry_factor >= 1:
            raise ConfigError("lease_ttl_s must be > 0, grace_s >= 0 and lease_expiry_factor >= 1")
        if self.keep_checkpoints < 1:
            raise ConfigError("keep_checkpoints must be >= 1")
        if not self.max_clock_skew_s >= 0:
            raise ConfigError("max_clock_skew_s must be >= 0")


@dataclass
class GcReport:
    head_version: int | None
    kept: int = 0
    """Objects kept under versions/, files/ and leases/."""
    deleted: list[tuple[str, int, str]] = field(default_factory=list)
    """(key, bytes, why) of what goes (or went, with ``apply``)."""
    protected_by_leases: dict[str, tuple[int, int]] = field(default_factory=dict)
    """node → (first, last) version range kept for it beyond HEAD's chain."""
    future_leases: list[str] = field(default_factory=list)
    """Nodes whose lease is dated beyond ``max_clock_skew_s`` ahead of gc's clock (ignored)."""
    applied: bool = False

    @property
    def bytes(self) -> int:
        return sum(b for _, b, _ in self.deleted)


def _attempt_of(name: str) -> str | None:
    """The commit attempt an object under ``versions/<V>/`` belongs to (``c<attempt>-NNNNNN.xc``,
    ``manifest-<attempt>.json.zst``), or None."""
    m = _ATTEMPT_OBJECT.fullmatch(name)
    return None if m is None else (m.group(1) or m.group(2))


def _live_attempts(store: Store, t: float, config: RetentionConfig, report: GcReport) -> set[str]:
    """Attempts whose ``inflight/<attempt>`` marker is younger than the grace period by its
    LastModified (a publisher rewrites it while it uploads): their objects are kept whatever their
    own age. An older marker is stale (its publisher is gone) and goes like other garbage."""
    live: set[str] = set()
    for key in store.list(INFLIGHT_PREFIX):
        try:
            st = store.stat(key)
        except ObjectNotFoundError:
            continue
        if st.modified_unix is None or t - st.modified_unix < config.grace_s:
            live.add(key[len(INFLIGHT_PREFIX):])
            report.kept += 1
        else:
            report.deleted.append((key, st.size, "a stale in-flight marker (its publisher stopped)"))
    return live


def read_lease(store: Store, key: str) -> Lease:
    """The lease at ``key``, read in at most ``MAX_LEASE_BYTES + 1`` bytes (a larger object is
    refused by the parser without being read whole)."""
    return parse_lease(store.get_range(key, 0, MAX_LEASE_BYTES + 1), where=f"{store.url}/{key}")


def _chain(store: Store, link: Link, keep: set[str], files: set[str], *, checkpoints: dict[int, list[CheckpointRef]],
           keep_checkpoints: int, floor: int) -> tuple[int, Link | None]:
    """Add ``link``'s chain to ``keep``, back to its keyframe, or to the version of the
    ``keep_checkpoints``-th newest checkpoint that reproduces its version on the chain once at or
    below ``floor`` (leases need the deltas above it), keeping those checkpoints' objects too.
    Returns the keyframe version (0 when the walk ended at checkpoints) and the link to the version
    before the lowest one walked (None if there is none)."""
    anchors = 0
    while True:
        try:
            lm = read_manifest(store, link)
        except ChainBrokenError:
            if anchors:  # what lies below the checkpoints kept is not needed (a relay's copy starts at one)
                return 0, None
            raise
        m = lm.manifest
        keep.add(link.key)
        keep.update(chunk_key(m.version, c.name) for c in m.chunks)
        files.update(f.xxh3_128 for f in m.files)
        for ref in checkpoints.get(m.version, ()):
            try:
                cp = read_checkpoint(store, ref)
                check_checkpoint(cp.manifest, m, lm.link.xxh3_128, lm.link.manifest, where=f"{store.url}/{ref.key}")
            except (XclusterError, ObjectNotFoundError) as exc:
                log.warning("not keeping checkpoint %s: %s", ref.key, exc)
                continue
            keep.add(ref.key)
            keep.update(object_key(cp.manifest, c.name) for c in cp.manifest.chunks)
            anchors += 1
            break  # one checkpoint per version is enough
        if m.kind == KEYFRAME:
            return m.version, Link.prev_of(m)
        if anchors >= keep_checkpoints and m.version <= floor:
            return 0, Link.prev_of(m)
        link = Link.base_of(m)


def _links_down_to(store: Store, link: Link | None, lowest: int, keep: set[str]) -> None:
    """Keep the manifests (not their chunks) linking HEAD's keyframe down to ``lowest``: a
    reader authenticates an older version by following them (FORMAT.md §4)."""
    while link is not None and link.version > lowest:
        try:
            m = read_manifest(store, link).manifest
        except XclusterError as exc:  # already gone or broken: nothing below can be linked anyway
            log.warning("the links from HEAD's keyframe stop at version %d: %s", link.version, exc)
            return
        keep.add(link.key)
        link = Link.prev_of(m)


def gc(store: Store, *, config: RetentionConfig = RetentionConfig(), now: Callable[[], float] = time.time,
       apply: bool = False) -> GcReport:
    t = now()
    head, _ = read_head(store)
    report = GcReport(head_version=head.version if head else None)
    if head is None:
        return report  # nothing committed: nothing is provably garbage
    keep: set[str] = set()
    files: set[str] = set()
    lease_keys = store.list("leases/")
    stale_leases: list[str] = []
    live: list[Lease] = []
    for key in lease_keys:
        try:
            lease = read_lease(store, key)
        except (XclusterError, ObjectNotFoundError) as exc:
            log.warning("ignoring unreadable lease %s: %s", key, exc)
            continue
        age = t - lease.updated_unix_ms / 1000
        if age < -config.max_clock_skew_s:
            log.warning("ignoring lease %s: dated %.0f s ahead of this clock (more than max_clock_skew_s)",
                        key, -age)
            report.future_leases.append(lease.node_id)
            continue
        if age > config.lease_ttl_s:
            if age > config.lease_expiry_factor * config.lease_ttl_s:
                stale_leases.append(key)
            continue
        live.append(lease)
    # a live follower keeps the deltas after what it holds (it never needs a checkpoint)
    floor = min((lease.version + 1 for lease in live if lease.version is not None and lease.version < head.version),
                default=head.version)
    checkpoint_keys = store.list(CHECKPOINT_PREFIX)
    checkpoints: dict[int, list[CheckpointRef]] = {}
    for ref in list_checkpoints(store, at_most=head.version, keys=checkpoint_keys):
        checkpoints.setdefault(ref.version, []).append(ref)
    head_keyframe, before_keyframe = _chain(store, Link.of_head(head), keep, files, checkpoints=checkpoints,
                                            keep_checkpoints=config.keep_checkpoints, floor=floor)
    lowest = min((int(m.group(1)) for k in keep if (m := _VERSION_KEY.fullmatch(k))), default=head.version)
    for lease in live:
        if lease.version is not None and lease.version + 1 >= lowest and lease.version < head.version:
            report.protected_by_leases[lease.node_id] = (lease.version + 1, head.version)
    keep_dirs: set[int] = set()
    for lease in live:
        target = lease.target_version
        if target is None or target > head.version or target >= lowest:
            continue  # it reaches HEAD through HEAD's chain, or is idle
        kf = _keyframe_of(store, target)  # the keyframe of the chain that target is on
        held = lease.version
        first = held + 1 if held is not None and kf <= held < target else kf
        keep_dirs.update(range(first, target + 1))
        report.protected_by_leases[lease.node_id] = (first, target)
    if keep_dirs:
        _links_down_to(store, before_keyframe, min(keep_dirs), keep)
    for v in sorted(keep_dirs):
        files.update(_files_named_in(store, v))
    in_flight = _live_attempts(store, t, config, report)
    for key in store.list("versions/"):
        m = _VERSION_KEY.fullmatch(key)
        if key in keep or (m and int(m.group(1)) in keep_dirs) or (m and _attempt_of(m.group(2)) in in_flight):
            report.kept += 1
            continue
        if m and int(m.group(1)) > head.version:
            why = "above HEAD: an attempt that never committed"
        elif m and int(m.group(1)) < lowest:
            why = f"behind what joiners and live leases need (version {lowest} on)"
        else:
            why = "not named by HEAD's chain: a failed attempt's leftover"
        _consider(store, key, why, t, config, report)
    for key in checkpoint_keys:
        if key in keep:
            report.kept += 1
            continue
        v = checkpoint_version_of(key)
        why = ("above HEAD: a checkpoint being written, or of a version that never committed"
               if v is not None and v > head.version else "an older checkpoint, or one that does not reproduce its version")
        _consider(store, key, why, t, config, report)
    for key in store.list("files/"):
        if key.rsplit("/", 1)[-1] in files:
            report.kept += 1
        else:
            _consider(store, key, "no kept manifest names it", t, config, report)
    for key in lease_keys:
        if key in stale_leases:
            _consider(store, key, f"lease expired more than {config.lease_expiry_factor:g}× its TTL ago", t,
                      config, report, grace=False)
        else:
            report.kept += 1
    if apply:
        # Manifests first: a reader then finds a version gone, never a manifest whose chunks are.
        for key, _, _ in sorted(report.deleted, key=lambda d: not _is_manifest_key(d[0])):
            store.delete(key)
        report.applied = True
    return report


def _is_manifest_key(key: str) -> bool:
    m = _VERSION_KEY.fullmatch(key) or _CHECKPOINT_OBJECT.fullmatch(key)
    return bool(m and is_manifest_name(m.group(2)))


def _manifests_of(store: Store, version: int) -> list[Manifest]:
    """Every readable manifest (any attempt) of ``version``."""
    found = []
    for k in store.list(version_dir(version) + "/"):
        if _is_manifest_key(k):
            try:
                found.append(parse_manifest(unpack(store.get_range(k, 0, MAX_MANIFEST_BYTES + 1), where=k)))
            except (XclusterError, ObjectNotFoundError):
                continue
    return found


def _keyframe_of(store: Store, version: int) -> int:
    """The smallest keyframe_version any manifest of ``version`` names (conservative: keeps more);
    1 when none can be read."""
    return min((m.keyframe_version for m in _manifests_of(store, version)), default=1)


def _files_named_in(store: Store, version: int) -> set[str]:
    """Hashes of the files any manifest of ``version`` names: a leased subscriber fetches them too."""
    return {f.xxh3_128 for m in _manifests_of(store, version) for f in m.files}


def _consider(store: Store, key: str, why: str, t: float, config: RetentionConfig, report: GcReport,
              *, grace: bool = True) -> None:
    try:
        st = store.stat(key)
    except ObjectNotFoundError:
        return
    if grace and (st.modified_unix is None or t - st.modified_unix < config.grace_s):
        report.kept += 1  # too young, or of unknown age: a request may still need it
        return
    report.deleted.append((key, st.size, why))


__all__ = ["GcReport", "RetentionConfig", "gc", "file_key"]
