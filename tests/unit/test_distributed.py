"""Sharded publishing over torch.distributed (gloo on CPU, ranks as spawned processes).

Every scenario runs real ranks: a process group over ``file://``, each rank passing only its
own tensors and dim-0 slices, each uploading its own chunks. The test process then reads the
store as any subscriber would and compares every version, bit for bit, with the full state
dict computed here.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from xcluster import Subscriber, SubscriberConfig, model_digest
from xcluster.errors import ConfigError, ShardLayoutError
from xcluster.format import HEAD_KEY, parse_head, parse_manifest
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal, manifest_bytes


GOLDEN_KEY = Path(__file__).parent.parent / "golden" / "signing-key.pem"
ROWS = {"embed": (600, 16), "layers.0.w": (24, 8), "head": (6, 4)}  # sliced in dim 0


def full_state(step: int) -> dict[str, torch.Tensor]:
    """The whole model at ``step``: every rank computes it, keeps only its part."""
    g = torch.Generator().manual_seed(11)
    st = {"embed": torch.randn(ROWS["embed"], generator=g).to(torch.bfloat16),
          "layers.0.w": torch.randn(ROWS["layers.0.w"], generator=g),
          "head": torch.randn(ROWS["head"], generator=g).to(torch.float16),
          "norm": torch.ones(16, dtype=torch.bfloat16),
          "step": torch.tensor(step, dtype=torch.int64),
          "mask": torch.tensor([True, False, True, True, False, False, True])}
    for s in range(1, step + 1):  # an RL step: a few elements move by one ulp
        for name in ("embed", "layers.0.w", "norm"):
            bits = st[name].view(torch.int16 if st[name].element_size() == 2 else torch.int32).reshape(-1)
            idx = torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(100 * s + len(name)))
            bits[idx[:max(1, bits.numel() // 50)]] += 1
    return st


def bounds(rows: int, world: int, skew: int) -> list[int]:
    """Uneven dim-0 split points: rank r holds rows [b[r], b[r+1])."""
    cuts = [min(rows, max(0, rows * r // world + (skew if 0 < r < world else 0))) for r in range(world + 1)]
    return sorted(cuts)


def shard_of(state: dict[str, torch.Tensor], rank: int, world: int, *, skew: int = 0) -> dict:
    from xcluster.write.sharded import Slice

    out: dict = {}
    for name, (rows, _) in ROWS.items():
        if name == "head":  # all rows on rank 0; the others pass a zero-row slice (ignored)
            b = [0] + [rows] * world
        else:
            b = bounds(rows, world, skew)
        t = state[name]
        out[name] = Slice(t[b[rank]:b[rank + 1]].clone(), offset=b[rank], global_shape=tuple(t.shape))
    whole = {"norm": world - 1, "step": 0, "mask": 1 % world}
    for name, owner in whole.items():
        if owner == rank:
            out[name] = state[name].clone()
    return out


def expected_parts(world: int, skew: int = 0) -> dict[str, list[int]]:
    parts = {}
    for name, (rows, cols) in ROWS.items():
        if name == "head" or world == 1:
            continue
        b = bounds(rows, world, skew)
        counts = [(b[r + 1] - b[r]) * cols for r in range(world) if b[r + 1] > b[r]]
        if len(counts) > 1:
            parts[name] = counts
    return parts


class DyingStore:
    """Wraps a store: after ``after`` chunk puts, dies (``os._exit``) or raises on the next one."""

    def __init__(self, inner, *, after: int, mode: str):
        self.inner, self.after, self.mode, self.armed = inner, after, mode, False
        self.url = inner.url

    def put(self, key, data, **kw):
        if self.armed and key.endswith(".xc"):
            if self.after == 0:
                if self.mode == "kill":
                    os._exit(17)
                if self.mode == "hang":
                    time.sleep(3600)
                from xcluster.errors import StoreError
                raise StoreError(f"injected failure writing {key}")
            self.after -= 1
        return self.inner.put(key, data, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _worker(rank: int, world: int, root: str, scenario: str) -> None:
    import torch.distributed as dist

    from xcluster import CodecConfig, PublisherConfig
    from xcluster.write.sharded import ShardedConfig, ShardedPublisher
    from xcluster.errors import RankLostError, ShardedPublishError, ShardLayoutError

    torch.set_num_threads(1)
    rootp = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{rootp / 'rendezvous'}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    log: dict = {"rank": rank, "events": []}
    ev = log["events"].append
    store = DyingStore(LocalStore(rootp / "store", fsync=False), after=0,
                       mode=scenario[:4] if scenario.startswith(("kill", "hang")) else "raise")
    cfg = PublisherConfig(keyframe_every=10, checkpoint_chain_fraction=None, upload_workers=2,
                          checkpoint_every=2 if scenario == "ckpt" else 32,
                          codec=CodecConfig(block_bytes=4096, chunk_bytes=4096, workers=1),
                          signing_key=str(GOLDEN_KEY) if scenario == "plain" else None)
    timeout = 3 if scenario.startswith("hang") else 20
    pub = ShardedPublisher(store=store, config=cfg, sharded=ShardedConfig(timeout_s=timeout))

    def publish(step: int, **kw) -> None:
        r = pub.publish(shard_of(full_state(step), rank, world, skew=kw.pop("skew", 0)), step=step, **kw)
        ev({"step": step, "version": r.version, "kind": r.kind, "rank_bytes": r.rank_bytes,
            "bytes_written": r.bytes_written, "digest": r.model_digest, "rank_elements": r.rank_elements})

    try:
        if scenario == "main":
            bad = shard_of(full_state(0), rank, world)
            bad["norm"] = full_state(0)["norm"]  # every rank claims it whole
            try:
                pub.publish(bad, step=0)
                ev({"bad_layout": "published"})
            except ShardLayoutError as exc:
                ev({"bad_layout": type(exc).__name__, "msg": str(exc)})
            for step in range(3):
                publish(step)
            store.armed = rank == world - 1  # the last rank fails its first chunk upload of step 3
            try:
                publish(3)
            except ShardedPublishError as exc:
                ev({"failed": type(exc).__name__, "msg": str(exc),
                    "head": parse_head(store.inner.get(HEAD_KEY).data).version})
            store.armed = False
            dist.barrier()  # every rank has cleaned up
            ev({"left": store.inner.list("versions/000000000004/")})
            publish(3)  # the same version number again, still a delta
            publish(4, skew=3)  # the ranks own other rows now: a keyframe
        elif scenario == "plain":
            for step in range(2):
                publish(step)
        elif scenario == "ckpt":
            for step in range(4):
                publish(step)
        elif scenario == "swap":  # the ranks trade their equal slices (and the whole tensors) at step 1
            publish(0)
            for step in (1, 2):  # swapped from now on
                r = pub.publish(shard_of(full_state(step), world - 1 - rank, world), step=step)
                ev({"step": step, "version": r.version, "kind": r.kind})
        elif scenario.startswith(("kill", "hang")):
            publish(0)
            victim = int(scenario[4:])
            store.armed = rank == victim
            t0 = time.monotonic()
            try:
                publish(1)
            except RankLostError as exc:
                ev({"lost": type(exc).__name__, "seconds": time.monotonic() - t0, "msg": str(exc)})
            except ShardedPublishError as exc:
                ev({"lost": type(exc).__name__, "seconds": time.monotonic() - t0, "msg": str(exc)})
    finally:
        (rootp / f"rank{rank}.json").write_text(json.dumps(log))
    if scenario in ("main", "plain", "swap", "ckpt"):
        dist.destroy_process_group()
    os._exit(0)  # a survivor of a lost rank must not wait for the group at exit


def run_ranks(tmp_path: Path, world: int, scenario: str, *, timeout: float = 120,
              victim: int | None = None) -> list[dict]:
    """Run ``scenario`` on ``world`` spawned ranks; each rank's log (None if it wrote none).
    The ``victim`` rank (one that hangs) is killed once the others are done."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, str(tmp_path), scenario)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for r, p in enumerate(procs):
            if r != victim:
                p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
    assert all(not p.is_alive() for p in procs)
    logs = []
    for r in range(world):
        f = tmp_path / f"rank{r}.json"
        logs.append(json.loads(f.read_text()) if f.exists() else None)
    return logs


def check_versions(store, want: dict[int, tuple[int, dict[str, list[int]]]], *, trust: tuple[str, ...] = ()) -> None:
    """A fresh subscriber applies each version in turn and holds exactly the full state of its step."""
    sub = Subscriber(store=store, config=SubscriberConfig(trusted_keys=trust))
    for version, (step, parts) in sorted(want.items()):
        assert sub.sync(until=version) == version
        full = full_state(step)
        assert_state_equal(sub.state_dict(), full)
        assert sub.model_digest == model_digest(full, parts=parts)
        m = sub.manifest
        assert {t.name: list(t.parts) for t in m.tensors if t.parts} == parts
        assert m.encodings == tuple(sorted({b.encoding for b in m.blocks}))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_slices_deltas_failure_and_reshard(tmp_path):
    logs = run_ranks(tmp_path, 2, "main")
    assert all(lg is not None for lg in logs)
    for lg in logs:
        evs = lg["events"]
        assert evs[0]["bad_layout"] == "ShardLayoutError" and "norm" in evs[0]["msg"]
        ok = [e for e in evs if "version" in e]
        assert [(e["version"], e["kind"]) for e in ok] == [
            (1, "keyframe"), (2, "delta"), (3, "delta"), (4, "delta"), (5, "keyframe")]
        failed = next(e for e in evs if "failed" in e)
        assert failed["failed"] == "ShardedPublishError" and "injected failure" in failed["msg"]
        assert failed["head"] == 3  # nothing of the failed attempt became visible
        assert all(e["rank_bytes"] > 0 for e in ok)
        assert len({e["digest"] for e in ok}) == 5
    # the failed attempt's chunks were deleted by their ranks (its manifest was never written)
    assert [e for e in logs[0]["events"] if "left" in e][0]["left"] == []
    assert logs[0]["events"][1]["digest"] == logs[1]["events"][1]["digest"]
    # every rank encoded only its part: the ranks' elements add up to the model, none holds it all
    total = sum(t.numel() for t in full_state(0).values())
    first = [lg["events"][1]["rank_elements"] for lg in logs]
    assert sum(first) == total and max(first) < total

    store = LocalStore(tmp_path / "store")
    parts = expected_parts(2)
    check_versions(store, {1: (0, parts), 2: (1, parts), 3: (2, parts), 4: (3, parts), 5: (4, expected_parts(2, 3))})
    for v in (4, 5):  # a delta and a keyframe: chunks c<attempt>-r<rank>-NNNNNN.xc from both ranks
        m = parse_manifest(manifest_bytes(store, v))
        assert {c.name.split("-")[1] for c in m.chunks} == {"r0", "r1"}
    assert m.kind == "keyframe" and len(m.chunks) > 2  # several chunks per rank, renumbered in one manifest


def test_ranks_write_a_checkpoint_together_and_a_joiner_starts_from_it(tmp_path):
    from xcluster.read.checkpoint import list_checkpoints, read_checkpoint

    logs = run_ranks(tmp_path, 2, "ckpt")
    assert all(lg is not None for lg in logs)
    assert [(e["version"], e["kind"]) for e in logs[0]["events"]] == [
        (1, "keyframe"), (2, "delta"), (3, "delta"), (4, "delta")]
    store = LocalStore(tmp_path / "store")
    refs = list_checkpoints(store)
    assert [r.version for r in refs] == [3]
    cp = read_checkpoint(store, refs[0]).manifest
    assert {c.name.split("-")[1] for c in cp.chunks} == {"r0", "r1"}  # each rank encoded its own part
    assert cp.tensors == tuple(t if t.init == "none" else t.__class__(t.name, t.dtype, t.shape, t.digest, "none",
                                                                      t.parts)
                               for t in parse_manifest(manifest_bytes(store, 3)).tensors)
    joiner = Subscriber(store=store)
    assert joiner.sync() == 4 and joiner.stats.checkpoints_applied == 1 and joiner.stats.versions_applied == 2
    assert_state_equal(joiner.state_dict(), full_state(3))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_four_ranks_reconstruct_bit_exactly(tmp_path):
    logs = run_ranks(tmp_path, 4, "plain")
    assert all(lg is not None for lg in logs)
    assert [[(e["version"], e["kind"]) for e in lg["events"]] for lg in logs] == [[(1, "keyframe"), (2, "delta")]] * 4
    parts = expected_parts(4)
    assert len(parts["embed"]) == 4
    check_versions(LocalStore(tmp_path / "store"), {1: (0, parts), 2: (1, parts)}, trust=(f"{GOLDEN_KEY}.pub",))
    assert parse_manifest(manifest_bytes(LocalStore(tmp_path / "store"), 2)).signature


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ranks_that_swap_equal_slices_publish_versions_every_subscriber_applies(tmp_path):
    """Review 2, item 13: the layout recorded offsets and counts, not which rank held them, so two
    ranks trading equal slices each encoded a delta against the other's rows: a version no
    subscriber could apply. Now the owner is part of the layout: the swap is a keyframe."""
    logs = run_ranks(tmp_path, 2, "swap")
    assert all(lg is not None for lg in logs)
    assert [[(e["version"], e["kind"]) for e in lg["events"]] for lg in logs] == \
        [[(1, "keyframe"), (2, "keyframe"), (3, "delta")]] * 2
    parts = expected_parts(2)
    assert parts["embed"] == [300 * 16, 300 * 16]  # equal slices: offsets and counts unchanged by the swap
    check_versions(LocalStore(tmp_path / "store"), {1: (0, parts), 2: (1, parts), 3: (2, parts)})


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario, victim, within", [("kill", 1, 19), ("kill", 0, 19), ("hang", 1, 15)],
                         ids=["worker-killed", "rank0-killed", "worker-hangs"])
def test_rank_lost_mid_upload_nothing_visible_survivor_raises(tmp_path, scenario, victim, within):
    """A rank killed (SIGKILL-like ``os._exit``) or hung inside a chunk upload: the other rank
    raises RankLostError (at once when the connection closes, after ShardedConfig.timeout_s when
    it hangs) and nothing of the version becomes visible."""
    logs = run_ranks(tmp_path, 2, f"{scenario}{victim}", timeout=60, victim=victim)
    assert logs[victim] is None  # it never got to write its log
    survivor = logs[1 - victim]
    assert survivor is not None
    lost = survivor["events"][-1]
    assert lost["lost"] == "RankLostError", lost
    assert lost["seconds"] < within  # kill: 20 s timeout not needed; hang: the 3 s timeout fired
    if scenario == "hang":
        assert lost["seconds"] > 2.5
    store = LocalStore(tmp_path / "store")
    assert parse_head(store.get(HEAD_KEY).data).version == 1
    check_versions(store, {1: (0, expected_parts(2))})


def test_needs_an_initialised_process_group(tmp_path):
    from xcluster.write.sharded import ShardedPublisher

    with pytest.raises(ConfigError, match="init_process_group"):
        ShardedPublisher(str(tmp_path))


@pytest.mark.parametrize("layouts, problem", [
    ([[["w", "float32", [4, 3], 0, 6]], [["w", "float32", [4, 3], 3, 9]]], "overlap"),
    ([[["w", "float32", [4, 3], 0, 3]], [["w", "float32", [4, 3], 6, 6]]], "hole"),
    ([[["w", "float32", [4, 3], 0, 6]], []], "cover elements [0, 6) of 12"),
    ([[["w", "float32", [4, 3], 0, 6]], [["w", "bfloat16", [4, 3], 6, 6]]], "disagree"),
    ([[["w", "float32", [4, 3], 0, 12]], [["w", "float32", [4, 3], 0, 12]]], "overlap"),
    ([[["e", "float32", [0, 3], 0, 0]], [["e", "float32", [0, 4], 0, 0]]], "disagree"),
])
def test_layout_must_tile_every_tensor(layouts, problem):
    from xcluster.write.shard_layout import check_layout

    with pytest.raises(ShardLayoutError, match=re.escape(problem)):
        check_layout(layouts)


def test_layout_of_slices_and_whole_tensors():
    from xcluster.write.shard_layout import Slice, check_layout, prepare_shard

    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    t0, rows0 = prepare_shard({"w": Slice(w[:1], offset=0, global_shape=(4, 3)), "b": torch.zeros(2)})
    t1, rows1 = prepare_shard({"w": Slice(w[1:], offset=1, global_shape=[4, 3]),
                          "b": Slice(torch.zeros(0), offset=2, global_shape=(2,))})  # zero rows: ignored
    assert rows0 == [["b", "float32", [2], 0, 2], ["w", "float32", [4, 3], 0, 3]]
    assert rows1 == [["w", "float32", [4, 3], 3, 9]] and set(t1) == {"w"}
    assert check_layout([rows0, rows1])["w"]["parts"] == {"0": 3, "3": 9}
    assert check_layout([rows0, rows1])["w"]["ranks"] == {"0": 0, "3": 1}  # who holds each part
    assert check_layout([rows1, rows0])["w"]["ranks"] == {"0": 1, "3": 0}  # swapped: another layout
    # a tensor without elements may come from several ranks (nothing to tile), never vanishes
    _, e0 = prepare_shard({"e": Slice(torch.zeros(0, 3), offset=0, global_shape=(0, 3))})
    _, e1 = prepare_shard({"e": torch.zeros(0, 3)})
    assert check_layout([e0, e1])["e"] == {"dtype": "float32", "shape": [0, 3], "parts": {"0": 0},
                                            "ranks": {"0": 1}}
    for bad in (Slice(w[1:], offset=2, global_shape=(4, 3)), Slice(w, offset=0, global_shape=(4, 4)),
                Slice(w, offset=-1, global_shape=(4, 3))):
        with pytest.raises(ShardLayoutError, match="not a dim-0 slice"):
            prepare_shard({"w": bad})
