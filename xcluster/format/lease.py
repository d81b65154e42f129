"""lease: see docs/FORMAT.md."""

from __future__ import annotations

from dataclasses import dataclass


from ..errors import FormatError

from .canonical import FORMAT_VERSION, LEASE_FORMAT, _int, _load_json, _str, canonical_json
from .keys import _HEX128, check_node_id
from .limits import MAX_LEASE_BYTES


@dataclass(frozen=True, slots=True)
class Lease:
    """What one subscriber (a daemon on a rollout node) reports at ``leases/<node_id>.json``:
    the version it holds, the version it is fetching (retention keeps both chains), and how its
    engine is doing. Informative for ``xcluster status``; protective for ``xcluster gc``."""

    node_id: str
    version: int | None
    """The version applied and verified (None before the first)."""
    target_version: int | None
    """The version being fetched/applied right now (None when idle)."""
    model_digest: str | None
    updated_unix_ms: int
    engine_state: str = "none"
    """``none`` (no engine), ``ok``, ``pending`` (a hand-off not yet done) or ``failing``."""
    engine_version: int | None = None
    """The version the engine last confirmed."""
    last_error: str | None = None
    committed_unix_ms: int | None = None
    """HEAD's commit time of the applied version (for staleness)."""
    head_version: int | None = None
    """The newest HEAD this subscriber has seen."""
    engine_update: str | None = None
    """How the engine got ``engine_version``: ``in-place`` (the changed elements only) or
    ``reload`` (from the model directory; also after an in-place update that did not verify)."""
    engine_verified_version: int | None = None
    """The version the engine's workers proved by hashing their loaded parameters (None: not
    checked, e.g. an engine without xcluster's extension)."""

    def to_bytes(self) -> bytes:
        return canonical_json({
            "format": LEASE_FORMAT, "format_version": FORMAT_VERSION, "node_id": self.node_id,
            "version": self.version, "target_version": self.target_version, "model_digest": self.model_digest,
            "updated_unix_ms": self.updated_unix_ms, "engine_state": self.engine_state,
            "engine_version": self.engine_version,
            "last_error": None if self.last_error is None else self.last_error[:2000],
            "committed_unix_ms": self.committed_unix_ms, "head_version": self.head_version,
            "engine_update": self.engine_update, "engine_verified_version": self.engine_verified_version})


ENGINE_STATES = ("none", "ok", "pending", "failing")
ENGINE_UPDATES = ("in-place", "reload")


def parse_lease(data: bytes, *, where: str = "lease") -> Lease:
    obj = _load_json(data, where, MAX_LEASE_BYTES, LEASE_FORMAT)
    err = obj.get("last_error")
    if err is not None and (not isinstance(err, str) or len(err) > 4000):
        raise FormatError(f"{where}: field 'last_error' must be a string of at most 4000 characters")
    return Lease(node_id=check_node_id(obj.get("node_id")),
                 version=_int(obj, "version", where, lo=1, null=True),
                 target_version=_int(obj, "target_version", where, lo=1, null=True),
                 model_digest=_str(obj, "model_digest", where, pattern=_HEX128, null=True),
                 updated_unix_ms=_int(obj, "updated_unix_ms", where),
                 engine_state=_str(obj, "engine_state", where, choices=ENGINE_STATES),
                 engine_version=_int(obj, "engine_version", where, lo=1, null=True),
                 last_error=err, committed_unix_ms=_int(obj, "committed_unix_ms", where, null=True),
                 head_version=_int(obj, "head_version", where, lo=1, null=True),
                 engine_update=_str(obj, "engine_update", where, choices=ENGINE_UPDATES, null=True),
                 engine_verified_version=_int(obj, "engine_verified_version", where, lo=1, null=True))
