"""canonical: see docs/FORMAT.md."""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import (FormatError, LegacyFormatError, SchemaVersionError)

from .keys import _KEY_ID, check_run_id
from .limits import MAX_VERSION


SIGNATURE_ALGS = ("ed25519",)
SIGNATURE_BYTES = 64

FORMAT_VERSION = 1
"""The one format this package writes and reads (docs/FORMAT.md): manifests, HEAD and leases all
declare ``"format_version": 1``. What a manifest needs beyond the core is named, not numbered: its
``encodings`` list (a reader refuses a manifest naming an encoding it lacks, by name). Objects
written by xcluster before 1.0 carry a ``schema_version`` instead: :class:`LegacyFormatError`."""
MANIFEST_FORMAT = "xcluster-manifest"
HEAD_FORMAT = "xcluster-head"
LEASE_FORMAT = "xcluster-lease"

def canonical_json(obj: Any) -> bytes:
    """The one byte encoding of a JSON object that xcluster writes (and a signature covers)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def xxh3_128(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


# --- signatures ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Signature:
    """An Ed25519 signature over an object's *signed payload*: the canonical JSON of the object
    without its ``signature`` member (docs/FORMAT.md §Signatures). xcluster/trust/signing.py makes
    and checks them; this module only carries and validates them."""

    alg: str
    key_id: str
    """First 16 hex digits of SHA-256 of the raw 32-byte public key."""
    value: bytes

    def to_obj(self) -> dict[str, str]:
        return {"alg": self.alg, "key_id": self.key_id, "value": base64.b64encode(self.value).decode("ascii")}


def _signature(obj: dict, where: str) -> tuple[Signature | None, bytes | None]:
    """The object's signature and signed payload (None, None when unsigned)."""
    raw = obj.get("signature")
    if raw is None:
        return None, None
    if not isinstance(raw, dict) or set(raw) != {"alg", "key_id", "value"}:
        raise FormatError(f"{where}: 'signature' must be an object with exactly alg, key_id and value")
    alg = _str(raw, "alg", f"{where}: signature", choices=SIGNATURE_ALGS)
    kid = _str(raw, "key_id", f"{where}: signature", pattern=_KEY_ID)
    value = raw["value"]
    try:
        if not isinstance(value, str) or len(value) > 4 * SIGNATURE_BYTES:
            raise ValueError("not a short string")
        sig = base64.b64decode(value, validate=True)
    except (ValueError, binascii.Error):
        raise FormatError(f"{where}: signature value is not base64") from None
    if len(sig) != SIGNATURE_BYTES:
        raise FormatError(f"{where}: a {alg} signature is {SIGNATURE_BYTES} bytes, got {len(sig)}")
    return Signature(alg, kid, sig), canonical_json({k: v for k, v in obj.items() if k != "signature"})


def _run_id(obj: dict, where: str) -> str | None:
    v = obj.get("run_id")
    if v is None:
        return None
    try:
        return check_run_id(v)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None


# --- schema ----------------------------------------------------------------------------------
def _int(obj: dict, key: str, where: str, *, lo: int = 0, hi: int = MAX_VERSION, null: bool = False) -> Any:
    v = obj.get(key)
    if v is None and null:
        return None
    if type(v) is not int or not lo <= v <= hi:
        raise FormatError(f"{where}: field {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _str(obj: dict, key: str, where: str, *, pattern: re.Pattern | None = None, choices=None,
         null: bool = False) -> Any:
    v = obj.get(key)
    if v is None and null:
        return None
    if not isinstance(v, str) or (pattern and not pattern.fullmatch(v)) or (choices and v not in choices):
        raise FormatError(f"{where}: field {key!r} is invalid: {v!r}")
    return v


def _list(obj: dict, key: str, where: str) -> list:
    v = obj.get(key)
    if not isinstance(v, list):
        raise FormatError(f"{where}: field {key!r} must be a list")
    return v


def _no_constant(name: str) -> None:
    """``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (RFC 8259), though Python's json reads
    them; no xcluster object holds one, and a signed payload could not be re-encoded with it."""
    raise ValueError(f"{name} is not a JSON value")


def _load_json(data: bytes, where: str, limit: int, fmt: str) -> dict:
    if len(data) > limit:
        raise FormatError(f"{where}: {len(data)} bytes is over the {limit}-byte limit")
    try:
        obj = json.loads(data, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise FormatError(f"{where}: not valid JSON ({exc}); the object is corrupt or not xcluster's") from exc
    if not isinstance(obj, dict):
        raise FormatError(f"{where}: top level must be a JSON object")
    if obj.get("format") != fmt:
        raise FormatError(f"{where}: 'format' must be {fmt!r}, got {obj.get('format')!r}")
    fv = obj.get("format_version")
    if fv is None and "schema_version" in obj:
        raise LegacyFormatError(
            f"{where}: written by xcluster 0.x (schema_version {obj['schema_version']!r}); this reader reads "
            f"format {FORMAT_VERSION} only. Read that store with the release that wrote it "
            "(pip install 'xcluster<1'), or publish a keyframe into a fresh prefix")
    if type(fv) is not int or fv != FORMAT_VERSION:
        raise SchemaVersionError(f"{where}: format_version {fv!r} is not supported by this reader (it reads "
                                 f"{FORMAT_VERSION}); upgrade xcluster")
    return obj


