"""Encode tensors into chunks and upload them while encoding continues (both sides use it: the
publisher for versions and checkpoints, a subscriber for the checkpoints it writes locally)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..codec.encode import CodecConfig, EncodedVersion, encode_version
from ..util.failures import raise_first_failure
from ..format import ChunkEntry
from ..store import Store


def encode_and_upload(store: Store, codec: CodecConfig, new: Mapping[str, torch.Tensor],
                      digests, base: Mapping[str, torch.Tensor] | None, *, key_of: Callable[[str], str],
                      written: list[str], tags: dict[str, str] | None, chunk_prefix: str, upload_workers: int,
                      max_inflight_chunks: int) -> tuple[EncodedVersion, int]:
    """Encode ``new`` (against ``base``, or in full) into chunks ``<chunk_prefix>-NNNNNN.xc`` and put
    each at ``key_of(name)`` while encoding continues, at most ``max_inflight_chunks`` held at once.
    Every key put (or being put) is appended to ``written``. Returns the encoded tensors and the
    chunk bytes uploaded."""
    slots = threading.BoundedSemaphore(max_inflight_chunks)
    futures: list[Future] = []
    total = 0

    with ThreadPoolExecutor(max_workers=upload_workers, thread_name_prefix="xc-upload") as pool:
        def upload(key: str, data: bytes) -> None:
            try:
                store.put(key, data, tags=tags)
            finally:
                slots.release()

        def emit(entry: ChunkEntry, data: bytes) -> None:
            nonlocal total
            key = key_of(entry.name)
            slots.acquire()
            written.append(key)
            total += len(data)
            futures.append(pool.submit(upload, key, data))
            raise_first_failure(futures, done_only=True)  # fail fast if an upload already failed

        encoded = encode_version(new, digests, base, codec, emit, chunk_prefix=chunk_prefix)
        raise_first_failure(futures)
    return encoded, total
