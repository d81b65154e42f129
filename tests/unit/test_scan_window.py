"""encode.scan_version's window: ranges are scanned ahead by bytes, not by count, so small
tensors are scanned while a large one is, within the same memory bound, and the output does not
depend on it."""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from xcluster import CodecConfig
from xcluster.codec import encode
from xcluster.codec.digest import tensor_digest
from tests.unit.helpers import make_weights


def _state(seed: int) -> dict[str, torch.Tensor]:
    return make_weights(seed=seed, shapes={"a.big": (64 * 1024,),  # 8 ranges of 8K elements
                                          **{f"b.small{i:02d}": (300,) for i in range(40)}})


def _delta(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    new = {n: t.clone() for n, t in base.items()}
    for t in new.values():
        t.view(torch.int16)[::97] += 1
    return new


def test_small_ranges_are_scanned_while_a_large_one_is_and_memory_stays_bounded(monkeypatch):
    cfg = CodecConfig(block_bytes=16 << 10, chunk_bytes=1 << 20, workers=2)
    budget = 2 * cfg.workers * cfg.block_bytes
    base = _state(0)
    new = _delta(base)
    real = encode._encode_range
    lock = threading.Lock()
    inflight = {"bytes": 0, "peak": 0}
    started_while_held: list[str] = []
    small_done = threading.Semaphore(0)
    held = threading.Event()

    def spy(r, t, old, config):
        size = (r.end - r.start) * t.element_size()
        with lock:
            inflight["bytes"] += size
            inflight["peak"] = max(inflight["peak"], inflight["bytes"])
            if held.is_set() and r.name.startswith("b."):
                started_while_held.append(r.name)
        try:
            if r.name == "a.big" and r.start == 7 * 8192:  # the last large range: hold it until small ones ran
                held.set()
                for _ in range(2 * cfg.workers + 2):
                    assert small_done.acquire(timeout=10), "small ranges were not scanned beside the large one"
                held.clear()
            return real(r, t, old, config)
        finally:
            with lock:
                inflight["bytes"] -= size
            if r.name.startswith("b."):
                small_done.release()

    monkeypatch.setattr(encode, "_encode_range", spy)
    chunks: dict[str, bytes] = {}
    digests = {n: tensor_digest(t) for n, t in new.items()}
    got = encode.encode_version(new, digests, base, cfg, lambda e, d: chunks.__setitem__(e.name, bytes(d)))
    # more small ranges started beside the held one than a window of 2 x workers ranges allows
    assert len(started_while_held) > 2 * cfg.workers
    assert inflight["peak"] <= budget
    monkeypatch.setattr(encode, "_encode_range", real)
    one: dict[str, bytes] = {}
    want = encode.encode_version(new, digests, base, replace(cfg, workers=1),
                                 lambda e, d: one.__setitem__(e.name, bytes(d)))
    assert chunks == one and got.blocks == want.blocks and got.changed_elements == want.changed_elements


def test_small_ranges_are_scanned_in_tasks_of_several_and_the_bytes_do_not_change(monkeypatch):
    rs = [encode._Range(i, f"t{i}", 0, n, False) for i, n in enumerate((10, 20, 30, 100, 5, 5, 90, 1))]
    tasks, sizes = encode._tasks(rs, [r.end for r in rs], 60)
    assert [[r.name for r in t] for t in tasks] == [["t0", "t1", "t2"], ["t3"], ["t4", "t5"], ["t6"], ["t7"]]
    assert sizes == [60, 100, 10, 90, 1]
    # a model of many small tensors: fewer tasks than ranges, and the same chunks as one range per task
    cfg = CodecConfig(workers=2)
    base = _state(1)
    new = _delta(base)
    digests = {n: tensor_digest(t) for n, t in new.items()}
    seen = []
    real = encode._tasks
    monkeypatch.setattr(encode, "_tasks", lambda *a: seen.append(real(*a)) or seen[-1])
    batched: dict[str, bytes] = {}
    got = encode.encode_version(new, digests, base, cfg, lambda e, d: batched.__setitem__(e.name, bytes(d)))
    n_ranges = sum(len(t) for t in seen[0][0])
    assert n_ranges == 41 and len(seen[0][0]) < 5  # 40 small tensors and one of 128 KiB (one range)
    monkeypatch.setattr(encode, "TASK_BYTES", 0)
    single: dict[str, bytes] = {}
    want = encode.encode_version(new, digests, base, cfg, lambda e, d: single.__setitem__(e.name, bytes(d)))
    assert len(seen[1][0]) == n_ranges
    assert batched == single and got.blocks == want.blocks
