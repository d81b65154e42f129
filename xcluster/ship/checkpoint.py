"""Writing a checkpoint (FORMAT.md §3a) from a state known to be a committed version: the
publisher's copy of what it just committed, or a subscriber's verified weights (a cluster-local
checkpoint that costs no WAN bytes)."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..format.checkpoint import checkpoint_manifest
from ..codec.encode import CodecConfig
from ..errors import PreconditionFailedError
from ..format import CHECKPOINT, KIND_TAG, Manifest, checkpoint_dir, checkpoint_key, manifest_name_for
from ..format.packing import pack
from ..store import Store
from .upload import encode_and_upload

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WrittenCheckpoint:
    version: int
    key: str
    bytes_written: int
    seconds: float


def write_checkpoint(store: Store, state: Mapping[str, torch.Tensor], version: Manifest, version_manifest: str,
                     version_hash: str, *, codec: CodecConfig | None = None, upload_workers: int = 8,
                     max_inflight_chunks: int = 4, attempt: str | None = None,
                     clock=time.time) -> WrittenCheckpoint:
    """Encode ``state`` (contiguous CPU tensors, exactly committed ``version``) in full and write it
    as a checkpoint of that version: chunks first, the manifest last and create-once, so a reader
    never finds a manifest whose chunks are not all there. On failure the chunks written are
    deleted (nothing names them). The tensor digests are the version's: a reader re-hashes what it
    decodes, so a state that is not the version is caught there, never served."""
    t0 = time.perf_counter()
    attempt = attempt or secrets.token_hex(4)
    name = manifest_name_for(attempt)
    d = checkpoint_dir(version.version)
    written: list[str] = []
    tags = {KIND_TAG: CHECKPOINT}
    digests = {t.name: t.digest for t in version.tensors}
    try:
        encoded, total = encode_and_upload(
            store, codec or CodecConfig(), {n: state[n] for n in sorted(state)}, digests, None,
            key_of=lambda n: f"{d}/{n}", written=written, tags=tags, chunk_prefix=f"k{attempt}",
            upload_workers=upload_workers, max_inflight_chunks=max_inflight_chunks)
        cp = checkpoint_manifest(version, version_manifest, version_hash, encoded,
                                 created_unix_ms=int(clock() * 1000))
        blob = pack(cp.to_bytes())
        key = checkpoint_key(version.version, name)
        store.put(key, blob, if_none_match=True, tags=tags)
    except BaseException as exc:
        if not isinstance(exc, PreconditionFailedError):
            for k in written:
                try:
                    store.delete(k)
                except Exception:  # noqa: BLE001 - retention removes what is left
                    log.debug("could not delete %s", k, exc_info=True)
        raise
    return WrittenCheckpoint(version.version, key, total + len(blob), time.perf_counter() - t0)
