"""The read path, torch-free: HEAD, manifests (bounded and hash-checked) and the chain between them.

Everything that reads a store's versions — the subscriber, ``xcluster ls/verify/status/gc``, a
relay — goes through these functions, so a manifest is read one way: at most
``MAX_MANIFEST_BYTES + 1`` bytes, its hash checked against the link that named it (HEAD or the
successor's ``base_manifest_xxh3_128``) before it is parsed, its version checked against its key.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ChainBrokenError, ChecksumMismatchError, FormatError, ObjectNotFoundError
from .format import (HEAD_KEY, KEYFRAME, MAX_CHAIN, MAX_MANIFEST_BYTES, Head, Manifest, manifest_key, parse_head,
                     parse_manifest, version_dir, xxh3_128)
from .store import Store

log = logging.getLogger(__name__)
_MANIFEST_KEY = re.compile(r"manifest(-[a-z0-9]{1,32})?\.json")


@dataclass(frozen=True, slots=True)
class Link:
    """How a version is named from its successor (or HEAD): number, manifest object, hash."""

    version: int
    manifest: str
    xxh3_128: str

    @property
    def key(self) -> str:
        return manifest_key(self.version, self.manifest)

    @classmethod
    def of_head(cls, head: Head) -> Link:
        return cls(head.version, head.manifest, head.manifest_xxh3_128)

    @classmethod
    def base_of(cls, m: Manifest) -> Link:
        """The link a delta holds to its base (schema 1 bases are always ``manifest.json``)."""
        assert m.base_version is not None and m.base_manifest_xxh3_128 is not None
        return cls(m.base_version, m.base_manifest or "manifest.json", m.base_manifest_xxh3_128)


@dataclass(frozen=True, slots=True)
class LinkedManifest:
    """A manifest read through a link: parsed, with the hash and name it was verified under."""

    manifest: Manifest
    link: Link
    data: bytes

    @property
    def version(self) -> int:
        return self.manifest.version


def read_head(store: Store) -> tuple[Head | None, str | None]:
    """HEAD and its etag; ``(None, None)`` on an empty prefix."""
    try:
        blob = store.get(HEAD_KEY)
    except ObjectNotFoundError:
        return None, None
    assert blob is not None
    return parse_head(blob.data, where=f"{store.url}/{HEAD_KEY}"), blob.etag


def poll_head(store: Store, etag: str | None) -> tuple[Head | None, str | None] | None:
    """One conditional GET of HEAD: ``None`` when it still has ``etag`` (nothing new), else
    ``(head, etag)`` — ``(None, None)`` when the prefix is empty."""
    try:
        blob = store.get(HEAD_KEY, if_none_match=etag)
    except ObjectNotFoundError:
        return None, None
    if blob is None:
        return None
    return parse_head(blob.data, where=f"{store.url}/{HEAD_KEY}"), blob.etag


def read_manifest(store: Store, link: Link, *, retries: int = 2,
                  on_retry: Callable[[str], None] | None = None) -> LinkedManifest:
    """Read and verify the manifest ``link`` names. A hash mismatch is re-read up to ``retries``
    times (corruption in transit), then raises :class:`ChecksumMismatchError`; a missing object
    raises :class:`ChainBrokenError`."""
    key = link.key
    where = f"{store.url}/{key}"
    got = ""
    for attempt in range(retries + 1):
        try:  # bounded read: a hostile object cannot make us allocate more than the limit
            data = store.get_range(key, 0, MAX_MANIFEST_BYTES + 1)
        except ObjectNotFoundError:
            raise ChainBrokenError(f"{where} is missing: the chain to HEAD is broken "
                                   "(retention removed it?); the next keyframe repairs this") from None
        got = xxh3_128(data)
        if got == link.xxh3_128:
            break
        msg = f"{where} hashes to {got}, expected {link.xxh3_128} (attempt {attempt + 1} of {retries + 1})"
        log.warning(msg)
        if on_retry is not None:
            on_retry(msg)
    else:
        raise ChecksumMismatchError(f"{where} hashes to {got}, its successor says {link.xxh3_128}: "
                                    "the manifest is corrupt or was replaced")
    m = parse_manifest(data, where=where)
    if m.version != link.version:
        raise FormatError(f"{where} says it is version {m.version}")
    return LinkedManifest(m, link, data)


def walk_back(store: Store, link: Link, *, stop: Callable[[LinkedManifest], bool] | None = None,
              max_chain: int = MAX_CHAIN, retries: int = 2,
              on_retry: Callable[[str], None] | None = None) -> list[LinkedManifest]:
    """Manifests from ``link`` back to the newest keyframe at or below it, or to the first one
    for which ``stop`` is true (that one included), **oldest first**. Refuses a chain longer
    than ``max_chain`` before reading past it, and one whose deltas disagree with their bases on
    ``keyframe_version`` (:class:`ChainBrokenError`)."""
    chain: list[LinkedManifest] = []
    cur = link
    while True:
        if len(chain) >= max_chain:
            raise ChainBrokenError(f"{store.url}: more than {max_chain} versions between version "
                                   f"{link.version} and a keyframe (max_chain)")
        lm = read_manifest(store, cur, retries=retries, on_retry=on_retry)
        if chain and lm.manifest.keyframe_version != chain[-1].manifest.keyframe_version:
            raise ChainBrokenError(
                f"{store.url}/{chain[-1].link.key}: keyframe_version {chain[-1].manifest.keyframe_version} differs "
                f"from its base's ({lm.link.key}: {lm.manifest.keyframe_version}): one of them lies")
        chain.append(lm)
        if lm.manifest.kind == KEYFRAME or (stop is not None and stop(lm)):
            break
        cur = Link.base_of(lm.manifest)
    chain.reverse()
    return chain


def find_link(store: Store, head: Head, version: int, *, max_chain: int = MAX_CHAIN,
              retries: int = 2) -> Link:
    """The link to an older committed ``version``, followed back from HEAD through the
    ``base_manifest`` links. A version behind HEAD's keyframe is not linked from HEAD: its
    manifest is taken as stored if ``versions/<V>/`` holds exactly one (it is still checked
    against its own successors when replayed). Otherwise :class:`ChainBrokenError`."""
    if version > head.version:
        raise ChainBrokenError(f"{store.url}: version {version} is above HEAD ({head.version})")
    cur = Link.of_head(head)
    for _ in range(max_chain):
        if cur.version == version:
            return cur
        lm = read_manifest(store, cur, retries=retries)
        if lm.manifest.kind == KEYFRAME:
            break
        cur = Link.base_of(lm.manifest)
    names = [k.rsplit("/", 1)[1] for k in store.list(version_dir(version) + "/")
             if _MANIFEST_KEY.fullmatch(k.rsplit("/", 1)[1])]
    if len(names) != 1:
        raise ChainBrokenError(f"{store.url}: version {version} is behind HEAD's keyframe and has {len(names)} "
                               "manifests; no link from HEAD says which one was committed")
    key = manifest_key(version, names[0])
    try:
        data = store.get_range(key, 0, MAX_MANIFEST_BYTES + 1)
    except ObjectNotFoundError:
        raise ChainBrokenError(f"{store.url}/{key} does not exist") from None
    return Link(version, names[0], xxh3_128(data))
