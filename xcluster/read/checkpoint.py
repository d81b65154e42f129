"""Checkpoints, torch-free: full states of committed versions, for nodes that join (FORMAT.md §3a).

Every version after a chain's first is a delta, so a node that follows downloads deltas only. A
node that joins (or fell behind what retention keeps) starts from a checkpoint instead of walking
the chain from its root: ``checkpoints/<V>/manifest-<id>.json.zst`` and its chunks, a manifest of
kind ``checkpoint`` whose ``checkpoint_of`` names version V's committed manifest.

A checkpoint is never signed and never trusted: a reader accepts it only if its tensor table,
model digest, run and files equal those of V's manifest as read through HEAD's (signed) chain
(:func:`check_checkpoint`), and then verifies every tensor it decodes against those digests, as
for any version. So anyone may write one — the publisher, or a subscriber in a cluster from the
state it verified (no WAN bytes) — and a bad one is refused by name and skipped.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from ..codec.encoding import parse_manifest
from ..errors import CheckpointMismatchError, FormatError, ObjectNotFoundError
from ..format import (CHECKPOINT, CHECKPOINT_PREFIX, MAX_MANIFEST_BYTES, Manifest, checkpoint_key,
                     xxh3_128)
from ..format.packing import unpack
from ..store import Store

log = logging.getLogger(__name__)
_CHECKPOINT_KEY = re.compile(r"checkpoints/(\d{12})/(manifest-[a-z0-9]{1,32}\.json\.zst)")
_CHECKPOINT_OBJECT = re.compile(r"checkpoints/(\d{12})/(.+)")


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    version: int
    key: str


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    manifest: Manifest
    key: str
    stored: bytes
    data: bytes

    @property
    def xxh3_128(self) -> str:
        return xxh3_128(self.data)


def checkpoint_version_of(key: str) -> int | None:
    """The version an object under ``checkpoints/`` belongs to (None for any other key)."""
    m = _CHECKPOINT_OBJECT.fullmatch(key)
    return None if m is None else int(m.group(1))


def list_checkpoints(store: Store, *, at_most: int | None = None, keys: list[str] | None = None) -> list[CheckpointRef]:
    """Checkpoint manifests in ``store`` (one LIST), newest version first; ``at_most`` drops those
    above a version (a checkpoint is written after its version commits, never before)."""
    found = []
    for key in store.list(CHECKPOINT_PREFIX) if keys is None else keys:
        m = _CHECKPOINT_KEY.fullmatch(key)
        if m is not None and (at_most is None or int(m.group(1)) <= at_most):
            found.append(CheckpointRef(int(m.group(1)), key))
    found.sort(key=lambda r: (-r.version, r.key))
    return found


def newest_checkpoint_version(store: Store) -> int | None:
    refs = list_checkpoints(store)
    return refs[0].version if refs else None


def read_checkpoint(store: Store, ref: CheckpointRef) -> LoadedCheckpoint:
    """A checkpoint manifest, bounded, unpacked and parsed; it must be a checkpoint of the version
    its key names (:class:`FormatError` otherwise). Not yet checked against the chain."""
    where = f"{store.url}/{ref.key}"
    stored = store.get_range(ref.key, 0, MAX_MANIFEST_BYTES + 1)
    data = unpack(stored, where=where)
    m = parse_manifest(data, where=where)
    if m.kind != CHECKPOINT or m.version != ref.version:
        raise FormatError(f"{where} is a {m.kind} of version {m.version}, not a checkpoint of version {ref.version}")
    return LoadedCheckpoint(m, ref.key, stored, data)


def check_checkpoint(cp: Manifest, version: Manifest, version_hash: str, version_manifest: str, *,
                     where: str) -> None:
    """Refuse (:class:`CheckpointMismatchError`) a checkpoint that does not claim to be exactly the
    committed manifest ``version`` (read through HEAD's chain, its hash ``version_hash``)."""
    link = cp.checkpoint_of
    problems = []
    if link is None or (link.version, link.manifest, link.xxh3_128) != (version.version, version_manifest,
                                                                          version_hash):
        problems.append(f"it names manifest {link}, the chain has {version_manifest} ({version_hash})")
    ours = [(t.name, t.dtype, t.shape, t.digest, t.parts) for t in cp.tensors]
    theirs = [(t.name, t.dtype, t.shape, t.digest, t.parts) for t in version.tensors]
    if ours != theirs:
        a, b = next((a, b) for a, b in zip(ours + [None], theirs + [None]) if a != b)
        what = ("name, dtype, shape, digest, parts".split(", ")[next(i for i in range(5) if a[i] != b[i])]
                if a is not None and b is not None and a[0] == b[0] else "names")
        problems.append(f"its tensors differ from the version's (first in {what}, at {(a or b)[0]!r})")
    if cp.model_digest != version.model_digest:
        problems.append(f"model digest {cp.model_digest}, the version's is {version.model_digest}")
    if cp.run_id != version.run_id:
        problems.append(f"run {cp.run_id!r}, the version's is {version.run_id!r}")
    if cp.files != version.files:
        problems.append("its files differ from the version's")
    if problems:
        raise CheckpointMismatchError(f"{where} is not a checkpoint of version {version.version}: "
                                      + "; ".join(problems))


def has_checkpoint(store: Store, version: int) -> bool:
    try:
        return any(_CHECKPOINT_KEY.fullmatch(k) for k in store.list(f"checkpoints/{version:012d}/"))
    except ObjectNotFoundError:
        return False


__all__ = ["CheckpointRef", "LoadedCheckpoint", "check_checkpoint", "checkpoint_key",
           "checkpoint_version_of", "has_checkpoint", "list_checkpoints", "newest_checkpoint_version",
           "read_checkpoint"]
