"""Fetching a version's chunks, in parallel and verified (bytes only: no tensors here).

Every chunk is read bounded (one byte more than the manifest says, so a longer object is
detected without being read whole), its size and XXH3-128 checked against the manifest, and
re-fetched when they fail (:func:`~xcluster.util.retry.retry_integrity`). Verified chunks can be
kept in a :class:`ChunkCache` until their version is applied, so a process killed halfway through
a big version resumes without fetching them again. Nothing here touches the weights held: the
subscriber fetches with no lock taken, and hands each chunk to a ``fill`` callback (apply.py).

:func:`run_all` and :func:`shielded` are the two thread helpers both sides use: run calls on a
pool and return only once every one has stopped; run a call to its end whatever interrupts the
caller.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ChainBrokenError, ChecksumMismatchError, ObjectNotFoundError, TruncatedObjectError
from ..codec.encoding import is_fill
from ..format import ChunkEntry, Manifest, object_key, xxh3_128
from ..store import Store
from ..util.fsutil import write_atomic
from ..util.retry import retry_integrity

if TYPE_CHECKING:
    from .subscriber import SubscriberStats

log = logging.getLogger(__name__)


class ChunkCache:
    """Verified chunks on local disk, one directory per version (``<version>-<manifest hash>``),
    kept until that version is applied."""

    def __init__(self, root: str) -> None:
        self.root = root

    def path(self, m: Manifest, mhash: str, name: str) -> Path:
        return Path(self.root) / f"{m.version:012d}-{mhash[:16]}" / name

    def get(self, path: Path, c: ChunkEntry) -> bytes | None:
        """The cached bytes of chunk ``c`` when they are there and still verify, else None."""
        if path.is_file() and path.stat().st_size == c.size:
            data = path.read_bytes()
            if xxh3_128(data) == c.xxh3_128:
                return data
        return None

    def put(self, path: Path, data: bytes) -> None:
        write_atomic(path, data, sync_dir=False)

    def prune(self, version: int) -> None:
        """Drop cached chunks of versions up to ``version`` (they were applied)."""
        if not os.path.isdir(self.root):
            return
        for d in os.listdir(self.root):
            head = d.split("-", 1)[0]
            if head.isdigit() and int(head) <= version:
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)


class ChunkFetcher:
    """Fetches and verifies the chunks of a manifest from ``store``, counting into ``stats``."""

    def __init__(self, store: Store, stats: SubscriberStats, *, integrity_retries: int, workers: int,
                 decode_workers: int, cache: ChunkCache | None = None) -> None:
        self.store = store
        self.stats = stats
        self.integrity_retries = integrity_retries
        self.workers = workers
        self.decode_workers = decode_workers
        self.cache = cache

    def fetch(self, m: Manifest, mhash: str, i: int, *,
              on_chunk: Callable[[Manifest, int], None] | None = None) -> bytes:
        """Chunk ``i`` of ``m``, verified: from the cache when it holds a good copy, else from the
        store, fetched again up to ``integrity_retries`` times while its size or checksum is wrong
        (then :class:`TruncatedObjectError` / :class:`ChecksumMismatchError`). A missing chunk
        raises :class:`ChainBrokenError` at once."""
        c = m.chunks[i]
        key = object_key(m, c.name)
        where = f"{self.store.url}/{key}"
        stats = self.stats
        cached = self.cache.path(m, mhash, c.name) if self.cache is not None else None
        if cached is not None and (data := self.cache.get(cached, c)) is not None:
            stats.chunk_cache_hits += 1
            if on_chunk is not None:
                on_chunk(m, c.size)
            return data

        def attempt() -> bytes:
            try:  # one byte more than expected tells "too long" without reading a hostile object whole
                data = self.store.get_range(key, 0, c.size + 1)
            except ObjectNotFoundError:
                raise ChainBrokenError(f"{where} is missing: version {m.version} cannot be applied") from None
            stats.bytes_fetched += len(data)
            if len(data) != c.size:
                raise TruncatedObjectError(f"{where} is {len(data)} bytes, the manifest says {c.size}")
            if (got := xxh3_128(data)) != c.xxh3_128:
                stats.checksum_failures += 1
                raise ChecksumMismatchError(f"{where} hashes to {got}, the manifest says {c.xxh3_128}: "
                                            "corrupt in storage or in transit")
            return data

        def failed(exc: BaseException, n: int) -> None:
            log.warning("%s (attempt %d of %d)", exc, n, self.integrity_retries + 1)

        def refetch(_exc: BaseException, _n: int) -> None:  # only when another attempt follows
            stats.refetches += 1

        data = retry_integrity(attempt, attempts=self.integrity_retries + 1, on_failure=failed, on_retry=refetch)
        if cached is not None:
            self.cache.put(cached, data)
        if on_chunk is not None:
            on_chunk(m, c.size)
        return data

    def stream(self, m: Manifest, mhash: str, fill: Callable[[int, bytes], None], *,
               on_chunk: Callable[[Manifest, int], None] | None = None) -> dict[int, bytes]:
        """Fetch and verify every chunk of ``m``, at most ``workers`` at a time, in order; as each
        arrives, run ``fill(block, data)`` for each of its fill blocks (``codec.encoding.is_fill``) on
        ``decode_workers`` threads, then drop it. Returns the chunks still needed by the other
        blocks (``-sub`` patches of held tensors, applied under the lock). So a keyframe costs
        its new weights plus a few chunks, never every chunk of the version at once. After a
        failure or an interrupt no further fetch starts."""
        fills: dict[int, list[int]] = {}
        keep: set[int] = set()
        for bi, b in enumerate(m.blocks):
            if is_fill(b.encoding):
                fills.setdefault(b.chunk, []).append(bi)
            else:
                keep.add(b.chunk)
        kept: dict[int, bytes] = {}
        window = self.workers
        pending: deque[tuple[int, Future]] = deque()
        with ThreadPoolExecutor(max_workers=window, thread_name_prefix="xc-fetch") as fetch, \
                ThreadPoolExecutor(max_workers=self.decode_workers, thread_name_prefix="xc-decode") as dec:
            try:
                nxt = 0
                while nxt < len(m.chunks) or pending:
                    while nxt < len(m.chunks) and len(pending) < window:
                        pending.append((nxt, fetch.submit(self.fetch, m, mhash, nxt, on_chunk=on_chunk)))
                        nxt += 1
                    ci, fut = pending.popleft()
                    data = fut.result()
                    blocks = fills.get(ci, ())
                    run_all(dec, lambda k: fill(blocks[k], data), len(blocks))
                    if ci in keep:
                        kept[ci] = data
                    del data
            finally:
                for _, fut in pending:  # after a failure or an interrupt: start no more fetches
                    fut.cancel()
        return kept


def run_all(pool: ThreadPoolExecutor, fn: Callable[[int], object], n: int) -> list:
    """``[fn(0), …, fn(n-1)]`` on ``pool``. Returns (or raises the first error) only once every
    call has finished or was cancelled before starting, even if this thread is interrupted
    (KeyboardInterrupt, a signal handler's SystemExit) meanwhile; the interrupt is re-raised then.
    After a first error no further call starts (a version of many broken blocks costs one)."""
    futures: list[Future] = []
    interrupt: BaseException | None = None
    failed = threading.Event()

    def call(i: int) -> object:
        if failed.is_set():
            return None
        try:
            return fn(i)
        except BaseException:
            failed.set()
            raise

    try:
        for i in range(n):
            if failed.is_set():
                break
            futures.append(pool.submit(call, i))
    except BaseException as exc:  # noqa: BLE001 - interrupted while submitting: stop submitting, wait below
        interrupt = exc
    while True:
        try:
            wait(futures)
            break
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the workers stopped
            interrupt = interrupt or exc
            for f in futures:
                f.cancel()
    if interrupt is not None:
        raise interrupt
    return [f.result() for f in futures]  # a call skipped after an error returned None: that error raises first


def shielded(fn: Callable[[], object]) -> object:
    """Run ``fn`` to its end on another thread, whatever interrupts this one, and return its
    result (or raise its error). Python runs signal handlers only in the main thread, so nothing
    ``fn`` does can be cut short by KeyboardInterrupt or a handler's SystemExit; such an
    interrupt is re-raised here once ``fn`` is done."""
    done = threading.Event()
    box: list = [None, None]

    def run() -> None:
        try:
            box[0] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box[1] = exc
        finally:
            done.set()

    t = threading.Thread(target=run, name="xc-apply")
    interrupt: BaseException | None = None
    try:
        t.start()
    except BaseException as exc:  # noqa: BLE001 - interrupted inside start(): the thread may run anyway
        interrupt = exc
        if not t.ident:  # it never started
            run()
    while not done.is_set():
        try:
            done.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised once fn is done
            interrupt = interrupt or exc
    if box[1] is not None:
        raise box[1]
    if interrupt is not None:
        raise interrupt
    return box[0]


__all__ = ["ChunkCache", "ChunkFetcher", "run_all", "shielded"]
