"""The daemon's crash-safe record of what it applied, under ``--out``.

``OUT/state.json`` names the applied version, its model digest and manifest hash, and the version
the engine last confirmed; ``OUT/state/manifest-<V>.json`` keeps that version's manifest bytes, so
a restarted daemon can vouch for the model directory it finds (every tensor re-hashed against the
manifest) and continue the chain without re-reading anything from the store. Every write is a
temp file, fsync, rename, fsync of the directory: after ``kill -9`` at any moment the record is
the old one or the new one, never a mix.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import StateFileError
from ..util.fsutil import write_atomic
from ..format import xxh3_128

STATE_FORMAT = "xcluster-daemon-state"
MAX_STATE_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class DaemonState:
    """What the daemon has applied and handed over, as recorded on disk."""

    version: int
    """The version whose complete model directory is ``OUT/versions/<version>``."""
    model_digest: str
    manifest_xxh3_128: str
    committed_unix_ms: int | None = None
    """When that version was committed (for staleness), if known."""
    engine_version: int | None = None
    """The version the engine last confirmed loading (None: not yet, or no engine)."""
    slot: str = "a"
    """The slot (``OUT/slots/<slot>``, named by ``OUT/current``) that holds ``version``."""
    patching: bool = False
    """With one slot: ``slot`` is being patched (``current`` is unlinked meanwhile) and must be
    proven by its digests before it is trusted again."""
    standby_version: int | None = None
    """With two slots: the version the other slot holds exactly and durably. None: it is being
    written or patched, or was never made, and must be repaired (from ``slot``) before use."""
    standby_manifest_xxh3_128: str | None = None

    def to_bytes(self) -> bytes:
        return json.dumps({"format": STATE_FORMAT, **asdict(self)}, sort_keys=True, indent=1).encode()

    def with_engine(self, version: int | None) -> DaemonState:
        return replace(self, engine_version=version)

    def kept_versions(self) -> set[int]:
        """The versions whose manifests the record needs kept."""
        return {self.version} | ({self.standby_version} if self.standby_version is not None else set())


class StateStore:
    """Reads and writes ``OUT/state.json`` and the manifest bytes beside it."""

    def __init__(self, out: Path | str) -> None:
        self.out = Path(out)
        self.path = self.out / "state.json"
        self.manifests = self.out / "state"

    def manifest_path(self, version: int) -> Path:
        return self.manifests / f"manifest-{version:012d}.json"

    def load(self) -> tuple[DaemonState, bytes] | None:
        """The recorded state and its manifest bytes; None if nothing was recorded yet.
        Raises :class:`StateFileError` if the record is unreadable or its manifest is missing
        or does not hash to the recorded value (the daemon then starts from the newest keyframe)."""
        if not self.path.exists():
            return None
        try:
            raw = self.path.read_bytes()
            if len(raw) > MAX_STATE_BYTES:
                raise ValueError("too large")
            obj = json.loads(raw)
            if not isinstance(obj, dict) or obj.pop("format", None) != STATE_FORMAT:
                raise ValueError("not a daemon state file")
            st = DaemonState(**obj)
            if type(st.version) is not int or st.version < 1:
                raise ValueError(f"bad version {st.version!r}")
            if st.slot not in ("a", "b") or not (st.standby_version is None or type(st.standby_version) is int):
                raise ValueError(f"bad slot {st.slot!r} or standby_version {st.standby_version!r}")
        except (OSError, ValueError, TypeError) as exc:
            raise StateFileError(f"{self.path} is unreadable ({exc}); starting from the newest keyframe") from exc
        mpath = self.manifest_path(st.version)
        try:
            mdata = mpath.read_bytes()
        except OSError as exc:
            raise StateFileError(f"{mpath} is missing ({exc}); starting from the newest keyframe") from exc
        if xxh3_128(mdata) != st.manifest_xxh3_128:
            raise StateFileError(f"{mpath} does not hash to the recorded {st.manifest_xxh3_128}; "
                                 "starting from the newest keyframe")
        return st, mdata

    def save(self, state: DaemonState, manifest_data: bytes | None = None) -> None:
        """Record ``state`` (manifest bytes first, then the state file that names them), and
        drop manifests of versions it no longer names."""
        if manifest_data is not None:
            write_atomic(self.manifest_path(state.version), manifest_data)
        write_atomic(self.path, state.to_bytes())
        keep = {self.manifest_path(v).name for v in state.kept_versions()}
        if self.manifests.is_dir():
            for p in self.manifests.iterdir():
                if p.name not in keep and p.name.startswith("manifest-"):
                    p.unlink(missing_ok=True)

    def manifest(self, version: int, xxh3: str) -> bytes:
        """The kept manifest bytes of ``version``, checked against their recorded hash."""
        mpath = self.manifest_path(version)
        try:
            mdata = mpath.read_bytes()
        except OSError as exc:
            raise StateFileError(f"{mpath} is missing ({exc})") from exc
        if xxh3_128(mdata) != xxh3:
            raise StateFileError(f"{mpath} does not hash to the recorded {xxh3}")
        return mdata
