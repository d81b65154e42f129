"""The subscriber: follows a store and holds verified weights.

``sync()`` walks HEAD's chain back to the version it holds (or to the newest keyframe), then
applies each version: fetch chunks in parallel, verify every chunk checksum, decode, apply,
verify every digest. Any failure undoes that version and raises a named error; the weights
stay those of the last version that verified.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from .codec.decode import Fill, Patch, decode_block, fill, patch
from .digest import model_digest_from, tensor_digest
from .dtypes import np_bits, torch_dtype
from .errors import (BaseMismatchError, ChainBrokenError, ChecksumMismatchError, ConfigError, DecodeError,
                     DigestMismatchError,
                     FormatError, IntegrityError, ObjectNotFoundError, TruncatedObjectError)
from .format import (HEAD_KEY, INIT_BASE, KEYFRAME, MAX_MANIFEST_BYTES, Head, Manifest, chunk_key, manifest_key,
                     parse_head, parse_manifest, xxh3_128)
from .store import Store, resolve_store

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SubscriberConfig:
    fetch_workers: int = 8
    """Chunks fetched in parallel."""
    decode_workers: int = 2
    """Threads decoding blocks and hashing tensors."""
    integrity_retries: int = 2
    """A chunk whose bytes fail their checksum is fetched again this many times before the
    version is refused with ChecksumMismatchError."""
    max_model_bytes: int = 1 << 40
    """Refuse a manifest whose weights would need more memory than this (checked before allocating)."""
    max_chain: int = 4096
    """Refuse to walk more than this many manifests back from HEAD."""
    prefetch_next_manifest: bool = True
    """Fetch the next version's manifest together with each HEAD poll (one GET more per poll,
    usually a 404), so a new version is applied one round trip sooner."""

    def __post_init__(self) -> None:
        if self.fetch_workers < 1 or self.decode_workers < 1:
            raise ConfigError("fetch_workers and decode_workers must be >= 1")
        if self.integrity_retries < 0:
            raise ConfigError("integrity_retries must be >= 0")


@dataclass(frozen=True, slots=True)
class AppliedVersion:
    version: int
    kind: str
    model_digest: str
    applied_unix: float
    bytes_fetched: int
    seconds: float


class Subscriber:
    def __init__(self, url: str | None = None, *, store: Store | None = None,
                 config: SubscriberConfig | None = None,
                 on_apply: Callable[[AppliedVersion], None] | None = None) -> None:
        self.store = resolve_store(url, store, "Subscriber")
        self.config = config or SubscriberConfig()
        self.on_apply = on_apply
        self._lock = threading.RLock()
        self._state: dict[str, torch.Tensor] = {}
        self._digests: dict[str, str] = {}
        self._manifest: Manifest | None = None
        self._manifest_hash: str | None = None
        self._head_etag: str | None = None
        self._head: Head | None = None
        self._prefetched: tuple[int, bytes] | None = None
        self._prefetch_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xc-prefetch")

    # --- what it holds ------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        return self._manifest.version if self._manifest else None

    @property
    def model_digest(self) -> str | None:
        return self._manifest.model_digest if self._manifest else None

    @property
    def manifest(self) -> Manifest | None:
        return self._manifest

    def state_dict(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The current verified weights. With ``copy=False`` the subscriber's own tensors are
        returned: valid only until the next ``sync()``, which patches them in place."""
        with self._lock:
            if copy:
                return {n: t.clone() for n, t in self._state.items()}
            return dict(self._state)

    # --- following ----------------------------------------------------------------------------
    def poll(self) -> Head | None:
        """The newest committed HEAD (one conditional GET when unchanged); None while empty."""
        try:
            blob = self.store.get(HEAD_KEY, if_none_match=self._head_etag)
        except ObjectNotFoundError:
            return None
        if blob is not None:
            self._head = parse_head(blob.data, where=f"{self.store.url}/{HEAD_KEY}")
            self._head_etag = blob.etag
        return self._head

    def sync(self, *, until: int | None = None) -> int | None:
        """Apply every committed version up to HEAD (or up to ``until``); returns the version now
        held (None while the store is empty)."""
        with self._lock:
            head = self._poll_and_prefetch()
            if head is None:
                return self.version
            target, expect = head.version, head.manifest_xxh3_128
            if until is not None and until < head.version:
                target, expect = until, self._hash_of(until, head)
            if target == self.version and expect == self._manifest_hash:
                return self.version
            if self.version is not None and target < self.version:
                raise ConfigError(f"this subscriber holds version {self.version}; it cannot go back to {target}")
            # (same number, other manifest: the prefix was re-published; the walk back finds out)
            for manifest, mhash in self._plan(target, expect):
                self._apply(manifest, mhash)
            return self.version

    def _poll_and_prefetch(self) -> Head | None:
        """Poll HEAD and, at the same time, fetch the manifest of the next version if it already
        exists: when HEAD moves to it, the manifest is in hand one round trip sooner. It is used
        only once HEAD names it and its hash matches; until then it is nothing."""
        self._prefetched = None
        nxt = (self.version or 0) + 1
        if not self.config.prefetch_next_manifest or self.version is None:
            return self.poll()
        pool = self._prefetch_pool
        fut = pool.submit(self.store.get_range, manifest_key(nxt), 0, MAX_MANIFEST_BYTES + 1)
        try:
            head = self.poll()
        finally:
            try:
                self._prefetched = (nxt, fut.result())
            except Exception:  # not there yet (the usual case) or unreadable: fetch it normally later
                self._prefetched = None
        return head

    def _hash_of(self, version: int, head: Head) -> str:
        """The manifest hash of an older committed ``version``, from the links back from HEAD.
        A version behind the newest keyframe is not linked: its manifest is taken as stored."""
        v, expect = head.version, head.manifest_xxh3_128
        while v > version:
            m, _ = self._read_manifest(v, expect)
            if m.kind == KEYFRAME:
                key = manifest_key(version)
                try:
                    return xxh3_128(self.store.get_range(key, 0, MAX_MANIFEST_BYTES + 1))
                except ObjectNotFoundError:
                    raise ChainBrokenError(f"{self.store.url}/{key} does not exist") from None
            assert m.base_version is not None and m.base_manifest_xxh3_128 is not None
            v, expect = m.base_version, m.base_manifest_xxh3_128
        if v != version:
            raise ChainBrokenError(f"version {version} is not on the chain back from HEAD {head.version}")
        return expect

    def _read_manifest(self, version: int, expect_hash: str) -> tuple[Manifest, str]:
        key = manifest_key(version)
        where = f"{self.store.url}/{key}"
        for attempt in range(self.config.integrity_retries + 1):
            pre, self._prefetched = self._prefetched, None
            try:  # bounded read: a hostile object cannot make us allocate more than the limit
                if pre is not None and pre[0] == version and attempt == 0:
                    data = pre[1]
                else:
                    data = self.store.get_range(key, 0, MAX_MANIFEST_BYTES + 1)
            except ObjectNotFoundError:
                raise ChainBrokenError(f"{where} is missing: the chain to HEAD is broken "
                                       "(retention removed it?); the next keyframe repairs this") from None
            got = xxh3_128(data)
            if got == expect_hash:
                break
            log.warning("%s hashes to %s, expected %s (attempt %d of %d)", where, got, expect_hash,
                        attempt + 1, self.config.integrity_retries + 1)
        else:
            raise ChecksumMismatchError(f"{where} hashes to {got}, its successor says {expect_hash}: "
                                        "the manifest is corrupt or was replaced")
        m = parse_manifest(data, where=where)
        if m.version != version:
            raise FormatError(f"{where} says it is version {m.version}")
        return m, got

    def _plan(self, version: int, expect: str) -> list[tuple[Manifest, str]]:
        """Manifests to apply, oldest first: back from ``version`` to ours or to a keyframe."""
        chain: list[tuple[Manifest, str]] = []
        v = version
        while True:
            if len(chain) >= self.config.max_chain:
                raise ChainBrokenError(f"more than {self.config.max_chain} versions between HEAD and a keyframe")
            m, h = self._read_manifest(v, expect)
            chain.append((m, h))
            if m.kind == KEYFRAME:
                break
            assert m.base_version is not None and m.base_manifest_xxh3_128 is not None
            if m.base_version == self.version:
                if m.base_manifest_xxh3_128 != self._manifest_hash:
                    raise BaseMismatchError(
                        f"version {m.version} builds on a version {m.base_version} that is not the one this "
                        "subscriber holds (the prefix was re-published?); it will reload at the next keyframe")
                break
            v, expect = m.base_version, m.base_manifest_xxh3_128
        chain.reverse()
        return chain

    # --- applying -----------------------------------------------------------------------------
    def _fetch_chunk(self, m: Manifest, i: int) -> bytes:
        c = m.chunks[i]
        key = chunk_key(m.version, c.name)
        where = f"{self.store.url}/{key}"
        err: IntegrityError | None = None
        for attempt in range(self.config.integrity_retries + 1):
            try:  # one byte more than expected tells "too long" without reading a hostile object whole
                data = self.store.get_range(key, 0, c.size + 1)
            except ObjectNotFoundError:
                raise ChainBrokenError(f"{where} is missing: version {m.version} cannot be applied") from None
            if len(data) != c.size:
                err = TruncatedObjectError(f"{where} is {len(data)} bytes, the manifest says {c.size}")
            elif (got := xxh3_128(data)) != c.xxh3_128:
                err = ChecksumMismatchError(f"{where} hashes to {got}, the manifest says {c.xxh3_128}: "
                                            "corrupt in storage or in transit")
            else:
                return data
            log.warning("%s (attempt %d of %d)", err, attempt + 1, self.config.integrity_retries + 1)
        assert err is not None
        raise err

    def _apply(self, m: Manifest, mhash: str) -> None:
        t0 = time.perf_counter()
        cfg = self.config
        where = f"{self.store.url}/{manifest_key(m.version)}"
        if m.model_bytes > cfg.max_model_bytes:
            raise FormatError(f"{where}: weights of {m.model_bytes} bytes exceed max_model_bytes "
                              f"({cfg.max_model_bytes})")
        is_key = m.kind == KEYFRAME
        if not is_key and (m.base_version != self.version or m.base_model_digest != self.model_digest):
            raise BaseMismatchError(f"{where}: delta on version {m.base_version} ({m.base_model_digest}) but "
                                    f"this subscriber holds {self.version} ({self.model_digest})")
        # tensors of the new state: patched in place (init base) or fresh (init none)
        target: list[torch.Tensor] = []
        for t in m.tensors:
            if t.init == INIT_BASE:
                cur = self._state.get(t.name)
                if cur is None or cur.dtype != torch_dtype(t.dtype) or tuple(cur.shape) != t.shape:
                    raise BaseMismatchError(f"{where}: {t.name} is carried over from the base but this "
                                            "subscriber's tensor differs in name, dtype or shape")
                target.append(cur)
            else:
                target.append(torch.empty(t.shape, dtype=torch_dtype(t.dtype)))
        applied: list[tuple[torch.Tensor, Patch]] = []
        ok = False
        with ThreadPoolExecutor(max_workers=cfg.fetch_workers, thread_name_prefix="xc-fetch") as fetch_pool, \
                ThreadPoolExecutor(max_workers=cfg.decode_workers, thread_name_prefix="xc-decode") as pool:
            try:
                chunks = list(fetch_pool.map(lambda i: self._fetch_chunk(m, i), range(len(m.chunks))))
                touched: set[int] = set()
                plock = threading.Lock()

                def run_block(bi: int) -> None:
                    b = m.blocks[bi]
                    ops = decode_block(b, chunks[b.chunk], m.tensors, where=f"{where} block {bi}")
                    for op in ops:  # decoded and bounds-checked whole before any of it is applied
                        tgt = target[op.tensor]
                        if isinstance(op, Fill):
                            fill(tgt, op)
                        else:
                            patch(tgt, op)
                            with plock:
                                applied.append((tgt, op))

                for b in m.blocks:
                    touched.update(s.tensor for s in b.segments)
                # every block runs to its end (done or failed) before we judge, so nothing is
                # still patching while a failure is being undone
                futures = [pool.submit(run_block, bi) for bi in range(len(m.blocks))]
                wait(futures)
                for f in futures:
                    f.result()
                del chunks
                for i, t in enumerate(m.tensors):
                    if t.dtype == "bool" and i in touched and bool((np_bits(target[i]) > 1).any()):
                        raise DecodeError(f"{where}: {t.name} holds bool bytes other than 0 and 1")
                # verify: hash what changed; what did not change keeps the digest we verified before
                idx = sorted(touched | {i for i, t in enumerate(m.tensors) if t.init != INIT_BASE})
                for i, got in zip(idx, pool.map(lambda i: tensor_digest(target[i]), idx)):
                    if got != m.tensors[i].digest:
                        raise DigestMismatchError(f"{where}: {m.tensors[i].name} hashes to {got} after applying, "
                                                  f"the manifest says {m.tensors[i].digest}")
                for i, t in enumerate(m.tensors):
                    if i not in touched and t.init == INIT_BASE and self._digests.get(t.name) != t.digest:
                        raise DigestMismatchError(f"{where}: {t.name} is unchanged but the manifest's digest "
                                                  "differs from the verified base")
                got = model_digest_from((t.name, t.dtype, t.shape, t.digest) for t in m.tensors)
                if got != m.model_digest:
                    raise DigestMismatchError(f"{where}: model digest {got} != manifest {m.model_digest}")
                ok = True
            finally:
                if not ok:
                    for tgt, op in reversed(applied):
                        patch(tgt, op, undo=True)
        self._state = {t.name: target[i] for i, t in enumerate(m.tensors)}
        self._digests = {t.name: t.digest for t in m.tensors}
        self._manifest, self._manifest_hash = m, mhash
        ev = AppliedVersion(version=m.version, kind=m.kind, model_digest=m.model_digest, applied_unix=time.time(),
                            bytes_fetched=m.chunk_bytes, seconds=time.perf_counter() - t0)
        log.info("applied version %d (%s, %d bytes) in %.3fs", m.version, m.kind, m.chunk_bytes, ev.seconds)
        if self.on_apply is not None:
            self.on_apply(ev)
