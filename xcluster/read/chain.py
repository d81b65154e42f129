"""The read path, torch-free: HEAD, manifests (bounded and hash-checked) and the chain between them.

Everything that reads a store's versions — the subscriber, ``xcluster ls/verify/status/gc``, a
relay — goes through these functions, so a manifest is read one way: at most
``MAX_MANIFEST_BYTES + 1`` bytes, unpacked (one zstd frame, manifest_object.py), its hash
checked against the link that named it (HEAD or the successor's ``base_manifest_xxh3_128``) before
it is parsed, its version checked against its key.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import (ChainBrokenError, ChecksumMismatchError, DecodeError, DecompressionBombError, FormatError,
                     ObjectNotFoundError, ResourceLimitError, RunMismatchError, SignatureError, XclusterError)
from ..format import (KEYFRAME, MAX_CHAIN, MAX_MANIFEST_BYTES, Head, Manifest, manifest_key,
                     xxh3_128)
from ..codec.encoding import parse_manifest  # with this build's encodings: one it lacks is refused by name
from ..format.packing import unpack
from ..store import Store
from ..ship.head import poll_head, read_head  # the reader's API too: HEAD as both sides read it

__all__ = ["Link", "LinkedManifest", "Plan", "find_link", "poll_head", "read_head", "read_manifest", "walk_back", "walk_links"]
from ..util.retry import retry_integrity

log = logging.getLogger(__name__)


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
    def prev_of(cls, m: Manifest) -> Link | None:
        """The link to version − 1's committed manifest: ``prev_manifest`` (keyframes too), else
        a delta's base link; None for version 1 and for a keyframe written without the field."""
        if m.prev_manifest is not None:
            p = m.prev_manifest
            return cls(p.version, p.manifest, p.xxh3_128)
        return cls.base_of(m) if m.kind != KEYFRAME else None

    @classmethod
    def base_of(cls, m: Manifest) -> Link:
        """The link a delta holds to its base."""
        assert m.base_version is not None and m.base_manifest is not None and m.base_manifest_xxh3_128 is not None
        return cls(m.base_version, m.base_manifest, m.base_manifest_xxh3_128)


@dataclass(frozen=True, slots=True)
class LinkedManifest:
    """A manifest read through a link: parsed, with the hash and name it was verified under."""

    manifest: Manifest
    link: Link
    data: bytes
    """The canonical JSON (what the link's hash covers)."""
    stored: bytes
    """The object's bytes as stored (the zstd frame of ``data``)."""

    @property
    def version(self) -> int:
        return self.manifest.version


def read_manifest(store: Store, link: Link, *, retries: int = 2,
                  on_retry: Callable[[str], None] | None = None, memo: ManifestMemo | None = None) -> LinkedManifest:
    """Read and verify the manifest ``link`` names. A hash mismatch is re-read up to ``retries``
    times (corruption in transit; :func:`~xcluster.util.retry.retry_integrity`), then raises
    :class:`ChecksumMismatchError`; ``on_retry(message)`` runs after each mismatch, the last
    included. A missing object raises :class:`ChainBrokenError`. With ``memo`` the bytes of a
    manifest read before under the same key and hash are used again (they are content-addressed
    by the link's hash, so this is no trust in the store)."""
    key = link.key
    if memo is not None and (hit := memo.get(key, link.xxh3_128)) is not None:
        m = parse_manifest(hit[1], where=f"{store.url}/{key}")
        return LinkedManifest(m, link, hit[1], hit[0])
    where = f"{store.url}/{key}"
    problem = ""

    def attempt() -> tuple[bytes, bytes]:
        nonlocal problem
        try:  # bounded read: a hostile object cannot make us allocate more than the limit
            stored = store.get_range(key, 0, MAX_MANIFEST_BYTES + 1)
        except ObjectNotFoundError:
            raise ChainBrokenError(f"{where} is missing: the chain to HEAD is broken "
                                   "(retention removed it?); the next keyframe repairs this") from None
        try:
            data = unpack(stored, where=where)
        except DecompressionBombError:
            raise
        except DecodeError as exc:  # a packed manifest garbled in transit: like a hash mismatch, re-read
            problem = f"does not unpack ({exc})"
        else:
            got = xxh3_128(data)
            if got == link.xxh3_128:
                return stored, data
            problem = f"hashes to {got}"
        raise ChecksumMismatchError(f"{where} {problem}, its successor says {link.xxh3_128}: "
                                    "the manifest is corrupt or was replaced")

    def failed(_exc: BaseException, n: int) -> None:
        msg = f"{where} {problem}, expected {link.xxh3_128} (attempt {n} of {retries + 1})"
        log.warning(msg)
        if on_retry is not None:
            on_retry(msg)

    stored, data = retry_integrity(attempt, attempts=retries + 1, on_failure=failed,
                                   retry_on=ChecksumMismatchError)
    if memo is not None:
        memo.put(key, link.xxh3_128, stored, data)
    m = parse_manifest(data, where=where)
    if m.version != link.version:
        raise FormatError(f"{where} says it is version {m.version}")
    return LinkedManifest(m, link, data, stored)


class ManifestMemo:
    """The bytes of the manifests read last, by (key, xxh3-128), up to ``max_bytes`` in all:
    a reader that applies the same versions twice (the daemon's second slot) reads them once."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, str], tuple[bytes, bytes]] = OrderedDict()
        self._bytes = 0

    def get(self, key: str, xxh3: str) -> tuple[bytes, bytes] | None:
        hit = self._items.get((key, xxh3))
        if hit is not None:
            self._items.move_to_end((key, xxh3))
        return hit

    def put(self, key: str, xxh3: str, stored: bytes, data: bytes) -> None:
        if (key, xxh3) in self._items:
            return
        self._items[(key, xxh3)] = (stored, data)
        self._bytes += len(stored) + len(data)
        while self._bytes > self.max_bytes and len(self._items) > 1:
            _, (s, d) = self._items.popitem(last=False)
            self._bytes -= len(s) + len(d)


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


@dataclass(frozen=True, slots=True)
class Plan:
    """The links from a base (excluded) up to a target, oldest first, and the manifest of the
    oldest, read last while walking: it is applied first, so it is used as read (no second GET)."""

    links: list[Link]
    oldest: LinkedManifest


def walk_links(store: Store, link: Link, *, stop: Callable[[LinkedManifest], bool] | None = None,
               check: Callable[[LinkedManifest], None] | None = None, max_chain: int = MAX_CHAIN,
               max_bytes: int | None = None, refused: dict[tuple[int, str], XclusterError] | None = None,
               retries: int = 2, on_retry: Callable[[str], None] | None = None,
               memo: ManifestMemo | None = None) -> Plan:
    """Like :func:`walk_back`, but holding one parsed manifest at a time: returns the links,
    oldest first, and the parsed manifest of only the oldest (the last one read, and the first
    the caller applies); the caller reads each later one again, hash-checked, when it uses it.
    Catching up one version (the usual case) therefore reads its manifest once.

    ``check`` runs on every manifest (a reader's own limits). ``max_bytes`` bounds the manifest
    bytes read (:class:`ResourceLimitError` beyond). ``refused`` remembers, by (version, manifest
    hash), what was refused for what the bytes say (format, limits, budget): meeting such a link
    again raises the same error without reading anything. A budget overflow is remembered under
    ``link``: a walk from a newer version that reaches it would read a superset."""
    links: list[Link] = []
    cur = link
    total = 0
    newer: tuple[str, int] | None = None  # (key, keyframe_version) of the manifest read before
    while True:
        if refused is not None and (known := refused.get((cur.version, cur.xxh3_128))) is not None:
            raise type(known)(str(known))
        if len(links) >= max_chain:
            raise ChainBrokenError(f"{store.url}: more than {max_chain} versions between version "
                                   f"{link.version} and a keyframe (max_chain)")
        try:
            lm = read_manifest(store, cur, retries=retries, on_retry=on_retry, memo=memo)
            total += len(lm.data)
            if max_bytes is not None and total > max_bytes:
                err = ResourceLimitError(
                    f"{store.url}: the manifests from version {link.version} back to version {cur.version} add up to "
                    f"{total} bytes, more than max_plan_bytes ({max_bytes}); the next keyframe repairs this, or "
                    "raise max_plan_bytes")
                if refused is not None:
                    refused[(link.version, link.xxh3_128)] = err
                raise err
            if newer is not None and lm.manifest.keyframe_version != newer[1]:
                raise ChainBrokenError(
                    f"{store.url}/{newer[0]}: keyframe_version {newer[1]} differs from its base's ({lm.link.key}: "
                    f"{lm.manifest.keyframe_version}): one of them lies")
            if check is not None:
                check(lm)
        except (FormatError, ResourceLimitError, SignatureError, RunMismatchError) as exc:  # the same next time
            if refused is not None:
                refused.setdefault((cur.version, cur.xxh3_128), exc)
            raise
        links.append(cur)
        if lm.manifest.kind == KEYFRAME or (stop is not None and stop(lm)):
            break
        newer = (cur.key, lm.manifest.keyframe_version)
        cur = Link.base_of(lm.manifest)
        del lm  # one parsed manifest at a time
    links.reverse()
    return Plan(links, lm)


def find_link(store: Store, head: Head, version: int, *, max_chain: int = MAX_CHAIN,
              retries: int = 2, memo: ManifestMemo | None = None) -> Link:
    """The link to an older committed ``version``, followed back from HEAD through each
    manifest's link to its predecessor (``prev_manifest``, across keyframes, or a delta's base
    link), so every version returned is authenticated by HEAD. Reads at most ``max_chain``
    manifests. A version behind a keyframe written without ``prev_manifest`` (older stores)
    cannot be authenticated: :class:`ChainBrokenError`, never a manifest taken as stored."""
    if version > head.version:
        raise ChainBrokenError(f"{store.url}: version {version} is above HEAD ({head.version})")
    if version < 1:
        raise ChainBrokenError(f"{store.url}: there is no version {version}")
    cur = Link.of_head(head)
    for _ in range(max_chain):
        if cur.version == version:
            return cur
        lm = read_manifest(store, cur, retries=retries, memo=memo)
        prev = Link.prev_of(lm.manifest)
        if prev is None:
            raise ChainBrokenError(
                f"{store.url}: version {version} cannot be authenticated: keyframe {lm.version} on HEAD's chain was "
                "written without prev_manifest (an older xcluster), so no hash link from HEAD reaches versions "
                "before it")
        cur = prev
    if cur.version == version:
        return cur
    raise ChainBrokenError(f"{store.url}: version {version} is more than max_chain ({max_chain}) manifests behind "
                           f"HEAD ({head.version}); raise max_chain or verify a newer version")
