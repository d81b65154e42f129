"""The object-store interface: a handful of primitives every backend implements.

Keys are relative to the store's root (its URL). They are ``/``-separated, made of
``[A-Za-z0-9._-]`` segments, never empty, never ``.`` or ``..``, never absolute:
:func:`check_key` enforces this for every backend, so no key can escape the prefix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import xxhash

from ..errors import ConfigError, UnsafeKeyError

_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
MAX_KEY_LEN = 1024


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise :class:`UnsafeKeyError`."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN:
        raise UnsafeKeyError(f"object key {key!r} is empty, not a string or longer than {MAX_KEY_LEN}")
    for seg in key.split("/"):
        if not _SEGMENT.fullmatch(seg) or seg in (".", ".."):
            raise UnsafeKeyError(
                f"object key {key!r} has an unsafe segment {seg!r}: keys are relative, "
                "'/'-separated segments of [A-Za-z0-9._-] that do not start with '.' or '-'"
            )
    return key


def check_prefix(prefix: str, url: str) -> str:
    """``prefix`` with its outer ``/`` trimmed; refuses an empty, ``.`` or ``..`` segment inside it
    (``runs//exp``): some servers (SeaweedFS) store keys under the collapsed path while LIST filters
    on the verbatim prefix, so such a store would publish and sync but list as empty."""
    trimmed = prefix.strip("/")
    segs = trimmed.split("/")
    if trimmed and any(seg in ("", ".", "..") for seg in segs):
        fixed = "/".join(s for s in segs if s not in ("", ".", ".."))
        raise ConfigError(
            f"{url}: the prefix {prefix!r} has an empty or '.'/'..' path segment, which object stores "
            f"collapse inconsistently (keys written under one path, listed under another); write it "
            f"without them (did you mean {fixed!r}?)")
    return trimmed


@dataclass(frozen=True, slots=True)
class Blob:
    """An object's bytes and the opaque version tag (ETag) they were read at."""

    data: bytes
    etag: str


@dataclass(frozen=True, slots=True)
class Stat:
    size: int
    etag: str
    modified_unix: float | None = None
    """Last modification time (Unix seconds) where the backend knows it; retention's grace needs it."""


def content_etag(data: bytes | memoryview) -> str:
    """ETag of backends without server-side etags: the xxh3-64 of the content."""
    return xxhash.xxh3_64_hexdigest(data)


def blob_unless_match(data: bytes, if_none_match: str | None) -> Blob | None:
    """A :class:`Blob` of ``data`` with its content etag, or None when it equals ``if_none_match``."""
    etag = content_etag(data)
    return None if if_none_match is not None and etag == if_none_match else Blob(data, etag)


@runtime_checkable
class Store(Protocol):
    """What xcluster needs from object storage.

    Errors: a missing object raises :class:`~xcluster.errors.ObjectNotFoundError`; a lost
    conditional write raises :class:`~xcluster.errors.PreconditionFailedError`; an unsafe key
    raises :class:`~xcluster.errors.UnsafeKeyError`. Writes are atomic: a reader sees the old
    object or the whole new one, never a part.
    """

    url: str

    def get(self, key: str, *, if_none_match: str | None = None) -> Blob | None:
        """Read a whole object. With ``if_none_match`` set to the etag last seen, return
        ``None`` when the object is unchanged (a cheap poll)."""
        ...

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Read ``length`` bytes from offset ``start`` (fewer only at the end of the object)."""
        ...

    def put(self, key: str, data: bytes | memoryview, *, if_match: str | None = None,
            if_none_match: bool = False, tags: Mapping[str, str] | None = None) -> str:
        """Write an object and return its new etag.

        ``if_none_match=True``: succeed only if the key does not exist (create-once).
        ``if_match=etag``: succeed only if the object's current etag is ``etag`` (compare-and-swap).
        ``tags``: object tags for the store's lifecycle rules (S3 object tagging); backends without
        tags ignore them.
        """
        ...

    def stat(self, key: str) -> Stat:
        ...

    def list(self, prefix: str = "") -> list[str]:
        """All keys that start with ``prefix``, sorted."""
        ...

    def delete(self, key: str) -> None:
        """Delete an object; deleting a missing key is not an error."""
        ...
