"""A checkpoint's manifest (FORMAT.md §3a): the full state of a committed version, written as a
side object of it; built here from the version's manifest and the state's full encoding."""

from __future__ import annotations

from dataclasses import replace

from ..errors import CheckpointMismatchError
from .manifest import CHECKPOINT, INIT_NONE, Manifest, ManifestLink


def checkpoint_manifest(version: Manifest, version_manifest: str, version_hash: str, encoded, *,
                        created_unix_ms: int) -> Manifest:
    """The checkpoint manifest of committed ``version`` from its full encoding ``encoded``
    (tensors in the same, sorted, order): the version's own tensor entries, all ``init: none``."""
    names = [t.name for t in encoded.tensors]
    if names != [t.name for t in version.tensors]:
        raise CheckpointMismatchError(f"the state to checkpoint has other tensors than version {version.version}")
    for e, t in zip(encoded.tensors, version.tensors):
        if (e.dtype, e.shape) != (t.dtype, t.shape):
            raise CheckpointMismatchError(f"{t.name} is {e.dtype}{list(e.shape)} in the state to checkpoint, "
                                          f"{t.dtype}{list(t.shape)} in version {version.version}")
    return Manifest(
        version=version.version, kind=CHECKPOINT, base_version=None, base_model_digest=None,
        base_manifest_xxh3_128=None, keyframe_version=version.keyframe_version, step=version.step,
        created_unix_ms=created_unix_ms, model_digest=version.model_digest,
        tensors=tuple(replace(t, init=INIT_NONE) for t in version.tensors), chunks=tuple(encoded.chunks),
        blocks=tuple(encoded.blocks), changed_elements=version.total_elements, files=version.files,
        run_id=version.run_id, checkpoint_of=ManifestLink(version.version, version_manifest, version_hash))
