"""head: see docs/FORMAT.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


from ..errors import (FormatError, UnsafeNameError)

from .canonical import FORMAT_VERSION, HEAD_FORMAT, Signature, _int, _load_json, _run_id, _signature, _str, canonical_json
from .keys import _HEX128, check_manifest_name, manifest_key
from .limits import MAX_HEAD_BYTES
from .manifest import KINDS


@dataclass(frozen=True, slots=True)
class Head:
    version: int
    kind: str
    keyframe_version: int
    manifest_xxh3_128: str
    committed_unix_ms: int
    manifest: str
    """The name of the version's manifest object under ``versions/<V>/``."""
    run_id: str | None = None
    """Optional: the training run, as in the manifest HEAD names."""
    signature: Signature | None = None
    """Optional: the publisher's signature: a signed "version V, manifest M, is the
    newest as of committed_unix_ms" statement."""
    signed_payload: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def manifest_key(self) -> str:
        return manifest_key(self.version, self.manifest)

    def to_obj(self) -> dict[str, Any]:
        obj = {"format": HEAD_FORMAT, "format_version": FORMAT_VERSION,
               "version": self.version, "kind": self.kind, "keyframe_version": self.keyframe_version,
               "manifest_xxh3_128": self.manifest_xxh3_128, "committed_unix_ms": self.committed_unix_ms,
               "manifest": self.manifest}
        if self.run_id is not None:
            obj["run_id"] = self.run_id
        if self.signature is not None:
            obj["signature"] = self.signature.to_obj()
        return obj

    def to_bytes(self) -> bytes:
        return canonical_json(self.to_obj())

    def payload(self) -> bytes:
        """The bytes a signature of this HEAD covers."""
        return canonical_json({k: v for k, v in self.to_obj().items() if k != "signature"})


def parse_head(data: bytes, *, where: str = "HEAD") -> Head:
    obj = _load_json(data, where, MAX_HEAD_BYTES, HEAD_FORMAT)
    name = obj.get("manifest")
    try:
        check_manifest_name(name)
    except UnsafeNameError as exc:
        raise FormatError(f"{where}: field 'manifest' is invalid: {exc}") from None
    signature, payload = _signature(obj, where)
    head = Head(version=_int(obj, "version", where, lo=1), kind=_str(obj, "kind", where, choices=KINDS),
                keyframe_version=_int(obj, "keyframe_version", where, lo=1),
                manifest_xxh3_128=_str(obj, "manifest_xxh3_128", where, pattern=_HEX128),
                committed_unix_ms=_int(obj, "committed_unix_ms", where), manifest=name,
                run_id=_run_id(obj, where), signature=signature, signed_payload=payload)
    if head.keyframe_version > head.version:
        raise FormatError(f"{where}: keyframe_version {head.keyframe_version} > version {head.version}")
    return head


# --- leases ----------------------------------------------------------------------------------
