"""What both publishers share to make a version: checked inputs, the manifest's chain fields, the
run id, the encode-and-upload of chunks.

:class:`~xcluster.write.publisher.Publisher` and :class:`~xcluster.write.sharded.ShardedPublisher`
(each rank's part) build their versions from these; the post-commit bookkeeping they share is
:mod:`xcluster.write.cadence`.
"""

from __future__ import annotations

import numbers
import secrets
from collections.abc import Mapping
from typing import Any

import torch

from ..codec.dtypes import dtype_name
from ..codec.encode import EncodedVersion
from ..errors import ConfigError
from ..format import DELTA, KEYFRAME, Head, ManifestLink, check_tensor_name, chunk_key
from ..ship.upload import encode_and_upload as upload_chunks
from ..store import Store

MAX_STEP = (1 << 53) - 1


def check_step(step: object) -> int | None:
    """``step`` as an int in ``[0, 2**53-1]`` (None stays None); :class:`ConfigError` otherwise."""
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= int(step) <= MAX_STEP:
        raise ConfigError(f"step must be an integer in [0, 2**53-1] or None, got {step!r}")
    return int(step)


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


def encode_and_upload(store: Store, config: Any, version: int, new: Mapping[str, torch.Tensor],
                      digests: Mapping[str, str], base: Mapping[str, torch.Tensor] | None, *, written: list[str],
                      tags: dict[str, str], chunk_prefix: str) -> tuple[EncodedVersion, int]:
    """Encode ``new`` (against ``base``, or as a keyframe) into chunks ``<chunk_prefix>-NNNNNN.xc``
    of ``version`` and upload them while encoding continues (see :func:`xcluster.ship.upload.encode_and_upload`)."""
    # Chunk names are unique to this attempt, so a publisher that loses the race for a
    # version number (or retries one) never overwrites or deletes another attempt's chunks.
    return upload_chunks(store, config.codec, new, digests, base, key_of=lambda n: chunk_key(version, n),
                         written=written, tags=tags, chunk_prefix=chunk_prefix, upload_workers=config.upload_workers,
                         max_inflight_chunks=config.max_inflight_chunks)
