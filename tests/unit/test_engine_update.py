"""Updating a running engine in place: the changes a delta records, the change log, the patch file,
the engine-side mapping (``vllm_worker``) on a model outside vLLM, and ``VllmHandoff``'s in-place,
verify and fall-back paths against a stand-in engine whose workers really hold their slices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber
from xcluster.errors import EngineWeightsMismatchError
from xcluster.follow import vllm_worker
from xcluster.follow.engine_update import ChangeLog, WeightsUpdate, expected_digests, write_patch
from xcluster.follow.handoff import HandoffConfig, VllmHandoff
from xcluster.follow.slots import Slots
from xcluster.store import LocalStore
from tests.support.engines import vllm_stand_in
from tests.unit.helpers import make_weights

FAST = HandoffConfig(timeout_s=10, attempts=2, backoff_s=0.0, backoff_max_s=0.0)
SHAPES = {"a.weight": (64, 48), "b.weight": (96,), "c.weight": (32, 16)}


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.int16).numpy()


# --- what a delta records ------------------------------------------------------------------------
@pytest.mark.parametrize("changed", [3, 0.01, 0.3, 0.9])  # sparse … dense blocks, each encoding's path
def test_recorded_changes_are_exactly_the_elements_whose_bits_changed(tmp_path, changed):
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=50))
    sub = Subscriber(store=store)
    sub.record_changes = True
    seen = []
    sub.on_apply = seen.append
    prev = None
    for step in range(4):
        w = make_weights(step, shapes=SHAPES, changed=changed, pick="randint")
        if step == 3:
            w["b.weight"] = w["b.weight"].clone()  # one tensor left alone: it must not be listed
            w["b.weight"].copy_(prev["b.weight"])
        pub.publish(w)
        sub.sync()
        ev = seen[-1]
        if prev is None:
            assert ev.kind == "keyframe" and ev.changes is None
        else:
            assert ev.kind == "delta"
            for name in SHAPES:
                want = np.flatnonzero(bits(w[name]) != bits(prev[name]))
                got = ev.changes.get(name, np.empty(0, np.int64))
                assert got.dtype == np.int64 and np.array_equal(np.sort(got), want), name
            if step == 3:
                assert "b.weight" not in ev.changes
        prev = w
    sub.record_changes = False
    pub.publish(make_weights(4, shapes=SHAPES, changed=changed))
    sub.sync()
    assert seen[-1].changes is None  # not recorded unless asked


def test_change_log_covers_exactly_the_versions_since_the_engines():
    log = ChangeLog()
    p = {"w": np.array([1, 5], np.int64)}
    log.add(2, p, engine_version=1)
    assert log.covers(1, 2) and not log.covers(None, 2) and not log.covers(1, 3)
    log.add(2, {"w": np.array([9], np.int64)}, engine_version=1)  # the same delta on the other slot
    assert log.elements() == 2
    log.add(3, {"w": np.array([5, 7], np.int64), "v": np.array([0], np.int64)}, engine_version=1)
    assert log.covers(1, 3) and np.array_equal(log.positions["w"], [1, 5, 7]) and log.elements() == 4
    log.add(4, None, engine_version=1)  # a keyframe: the engine must reload
    assert not log.covers(1, 4)
    log.add(5, p, engine_version=1)  # a gap: no way to say what changed since 1
    assert not log.covers(1, 5)
    log.reset(5)
    log.add(6, p, engine_version=5)
    assert log.covers(5, 6)
    fresh = ChangeLog()  # a restarted daemon whose engine holds version 7
    fresh.add(8, p, engine_version=7)
    assert fresh.covers(7, 8)


def test_patch_file_holds_the_positions_and_the_slot_values(tmp_path):
    from safetensors.torch import load_file

    w = {"x": torch.randn(10, 3).to(torch.bfloat16), "y": torch.arange(5, dtype=torch.int64)}
    size = write_patch(tmp_path / "e" / "p.safetensors", w, {"x": np.array([0, 29], np.int64),
                                                             "y": np.array([4], np.int64), "z": np.empty(0)})
    got = load_file(str(tmp_path / "e" / "p.safetensors"))
    assert size > 0 and sorted(got) == ["x:idx", "x:val", "y:idx", "y:val"]
    assert got["x:idx"].dtype == torch.int32 and got["x:idx"].tolist() == [0, 29]
    assert torch.equal(got["x:val"], w["x"].view(-1)[[0, 29]]) and got["y:val"].tolist() == [4]


# --- the engine side, on a model outside vLLM ----------------------------------------------------
class Toy(torch.nn.Module):
    """Fuses q/k/v into one parameter (rows 0–7, 8–11, 12–15) as vLLM does, loads ``t`` transposed
    (not a shifted rectangle), holds columns 4–7 of ``o`` (as one tensor-parallel rank of a
    row-parallel layer) and skips ``skip`` (as a tied head is skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(16, 6, dtype=torch.bfloat16), requires_grad=False)
        self.qkv.weight_loader = self._qkv
        self.norm = torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16), requires_grad=False)
        self.t = torch.nn.Parameter(torch.zeros(4, 5, dtype=torch.bfloat16), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16), requires_grad=False)

    @staticmethod
    def _qkv(param, loaded, shard):
        start, n = {"q": (0, 8), "k": (8, 4), "v": (12, 4)}[shard]
        param.data[start:start + n].copy_(loaded)

    def load_weights(self, weights):
        for name, w in weights:
            if name in ("q", "k", "v"):
                self.qkv.weight_loader(self.qkv, w, name)
            elif name == "norm":  # as vLLM models do: the parameter's loader, else a plain copy
                getattr(self.norm, "weight_loader", _copy)(self.norm, w)
            elif name == "t":
                getattr(self.t, "weight_loader", _copy)(self.t, w.t())
            elif name == "o":  # the second half of the columns, as rank 1 of a row-parallel layer holds
                getattr(self.o, "weight_loader", _copy)(self.o, w[:, 4:])


def _copy(param, loaded):
    param.data.copy_(loaded)


CKPT = {"q": (8, 6), "k": (4, 6), "v": (4, 6), "norm": (6,), "t": (5, 4), "o": (4, 8), "skip": (3,)}


def test_layout_probes_the_models_own_loader_without_touching_its_weights():
    toy = Toy()
    before = {n: p.clone() for n, p in toy.named_parameters()}
    lay = vllm_worker.layout(toy, [(n, list(s), "bfloat16") for n, s in CKPT.items()])
    assert {r["tensor"]: (r["param"], r["rows"], r["cols"], r["at"]) for r in lay["regions"]} == {
        "q": ("qkv", [0, 8], [0, 6], [0, 0]), "k": ("qkv", [0, 4], [0, 6], [8, 0]),
        "v": ("qkv", [0, 4], [0, 6], [12, 0]), "norm": ("norm", [0, 6], [0, 1], [0, 0]),
        "o": ("o", [0, 4], [4, 8], [0, 0])}
    assert lay["ignored"] == ["skip"] and list(lay["unsupported"]) == ["t"]
    assert all(torch.equal(before[n], p) for n, p in toy.named_parameters())
    assert not hasattr(toy.norm, "weight_loader") and toy.qkv.weight_loader == Toy._qkv  # loaders restored
    lay = vllm_worker.layout(toy, [("q", [8, 6], "float32")])
    assert "float32" in lay["unsupported"]["q"]  # a dtype the engine would convert to


def test_apply_and_digests_round_trip_through_fused_regions(tmp_path):
    toy = Toy()
    ckpt = {n: torch.randn(s).to(torch.bfloat16) for n, s in CKPT.items() if n in ("q", "k", "v", "norm", "o")}
    toy.load_weights(ckpt.items())
    lay = vllm_worker.layout(toy, [(n, list(t.shape), "bfloat16") for n, t in ckpt.items()])
    assert vllm_worker.digests(toy, lay["regions"]) == expected_digests(lay["regions"], ckpt)
    new = {n: t.clone() for n, t in ckpt.items()}
    # k: whole rows of a fused parameter; o: held columns 4-7 only (3 and 8+3 are another rank's)
    pos = {"k": np.array([0, 7, 23], np.int64), "norm": np.array([5], np.int64),
           "o": np.array([3, 4, 11, 31], np.int64)}
    for n, p in pos.items():
        new[n].view(-1)[p] += 1
    write_patch(tmp_path / "p.safetensors", new, pos)
    got = vllm_worker.apply_patch(toy, lay["regions"], str(tmp_path / "p.safetensors"))
    assert (got["elements"], got["written"]) == (8, 6)
    assert vllm_worker.digests(toy, lay["regions"]) == expected_digests(lay["regions"], new)
    assert torch.equal(toy.qkv[8:12], new["k"]) and torch.equal(toy.qkv[:8], ckpt["q"])
    assert torch.equal(toy.o, new["o"][:, 4:])


# --- VllmHandoff against a stand-in with the extension -------------------------------------------
@pytest.fixture
def versions(tmp_path):
    """Version 1 and 2 of a model, v2 installed in a slot; the stand-in's workers hold v1."""
    v1 = make_weights(0, shapes=SHAPES)
    v2 = make_weights(1, shapes=SHAPES, changed=5, pick="randint")
    slots = Slots(tmp_path / "out")
    views = slots.write("a", v2, {"config.json": b"{}"})
    slots.switch_current("a")
    pos = {n: np.flatnonzero(bits(v2[n]) != bits(v1[n])) for n in SHAPES}
    patch = tmp_path / "out" / "engine" / "patch-2.safetensors"
    write_patch(patch, views, pos)
    tensors = tuple((n, tuple(t.shape), "bfloat16") for n, t in v2.items())
    update = WeightsUpdate(weights=views, tensors=tensors, patch=patch,
                           patch_elements=sum(p.size for p in pos.values()), base_version=1)
    return v1, v2, slots, update


def held(engine, name: str) -> torch.Tensor:
    return torch.cat([w.params[name] for w in engine.workers]) if len(SHAPES[name]) == 2 else \
        engine.workers[0].params[name]


def test_in_place_writes_only_the_patch_into_each_worker_and_verifies(versions):
    v1, v2, slots, update = versions
    with vllm_stand_in(workers=2, params=v1) as engine:
        res = VllmHandoff(engine.url, config=FAST).hand_over(slots.root / "current", 2, update=update)
        rpcs = [c.body["method"] for c in engine.calls if c.path == "/collective_rpc"]
        assert rpcs == ["xcluster_layout", "xcluster_apply", "xcluster_digests"]
        assert engine.paths()[1:6] == ["/pause", "/collective_rpc", "/reset_prefix_cache",
                                       "/update_weight_version", "/resume"]
        assert res.method == "in-place" and res.verified is True and "written in place" in res.detail
        assert all(torch.equal(held(engine, n), v2[n]) for n in SHAPES)
        assert engine.state["loaded"] is None  # never reloaded


def test_a_damaged_engine_weight_is_caught_and_repaired_by_a_reload(versions):
    v1, v2, slots, update = versions
    with vllm_stand_in(workers=2, params=v1) as engine:
        engine.workers[1].params["a.weight"].view(-1)[3] += 1  # worker 1's slice goes bad
        h = VllmHandoff(engine.url, config=FAST)
        res = h.hand_over(slots.root / "current", 2, update=update)
        assert res.method.startswith("in-place, then reload") and res.verified is True and h.mismatches == 1
        assert engine.state["loaded"] == str(slots.path("a").resolve())
        assert all(torch.equal(held(engine, n), v2[n]) for n in SHAPES)


def test_weights_that_do_not_verify_after_a_reload_fail_the_handoff(versions):
    v1, v2, slots, update = versions
    other = {n: t.clone() for n, t in v2.items()}
    other["c.weight"].view(-1)[0] += 1  # what the daemon believes it installed is not what is on disk
    lie = WeightsUpdate(weights=other, tensors=update.tensors, patch=None)
    with vllm_stand_in(workers=2, params=v1) as engine:
        with pytest.raises(EngineWeightsMismatchError, match="c.weight"):
            VllmHandoff(engine.url, config=FAST).hand_over(slots.root / "current", 2, update=lie)
        assert engine.paths()[-1] == "/collective_rpc" and not engine.state["paused"]


def test_without_a_patch_or_the_extension_the_engine_reloads(versions):
    v1, v2, slots, update = versions
    no_patch = WeightsUpdate(weights=update.weights, tensors=update.tensors, patch=None)
    with vllm_stand_in(workers=2, params=v1) as engine:
        res = VllmHandoff(engine.url, config=FAST).hand_over(slots.root / "current", 2, update=no_patch)
        assert res.method == "reload" and res.verified is True
    with vllm_stand_in(workers=2) as engine:  # a plain vLLM: the layout call fails, once
        h = VllmHandoff(engine.url, config=FAST)
        for v in (2, 3):
            res = h.hand_over(slots.root / "current", v, update=update)
            assert res.method == "reload" and res.verified is None
        assert [c.body["method"] for c in engine.calls if c.path == "/collective_rpc"] == \
            ["xcluster_layout", "reload_weights", "reload_weights"]
    with vllm_stand_in(workers=2, params=v1) as engine:  # in place turned off: reload, still verified
        res = VllmHandoff(engine.url, in_place=False, config=FAST).hand_over(slots.root / "current", 2,
                                                                              update=update)
        assert res.method == "reload" and res.verified is True


# --- the daemon ----------------------------------------------------------------------------------
@pytest.mark.parametrize("slots", [2, 1])
def test_the_daemon_reloads_first_then_updates_in_place_and_says_so_in_its_lease(tmp_path, slots):
    from xcluster.follow.daemon import Daemon, DaemonConfig
    from xcluster.follow.slots import SlotsConfig
    from xcluster.format import parse_lease

    store = LocalStore(tmp_path / "store", fsync=False)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=3))
    out = tmp_path / "out"
    versions = [make_weights(s, shapes=SHAPES, changed=4, pick="randint") for s in range(5)]
    with vllm_stand_in(workers=2, params=make_weights(0, shapes=SHAPES, seed=9)) as engine:
        d = Daemon(store=store, config=DaemonConfig(out=out, lease_every_s=0.001, warm_up=False, node_id="n0",
                                                    slots=SlotsConfig(slots=slots)),
                   handoff=VllmHandoff(engine.url, config=FAST))
        methods = []
        for s, w in enumerate(versions):  # versions 1 (keyframe), 2, 3, 4 (keyframe: every 3), 5
            pub.publish(w, files={"config.json": b"{}"})
            assert d.step() and d.state.engine_version == s + 1
            rpcs = [c.body["method"] for c in engine.calls if c.path == "/collective_rpc"]
            methods.append("in-place" if "xcluster_apply" in rpcs else "reload")
            engine.calls.clear()
            assert all(torch.equal(held(engine, n), w[n]) for n in SHAPES), s
            assert not list((out / "engine").glob("*"))  # the patch file is gone once taken
            lease = parse_lease(store.get("leases/n0.json").data)
            assert lease.engine_update == methods[-1] and lease.engine_verified_version == s + 1
        assert methods == ["reload", "in-place", "in-place", "reload", "in-place"]
        m = d.metrics.registry
        assert m.get_sample_value("xcluster_engine_updates_total", {"method": "in-place"}) == 3
        assert m.get_sample_value("xcluster_engine_verified_total", {"result": "match"}) == 5
        # a daemon restarted under an engine that holds its version: the next delta goes in place
        del d
        d = Daemon(store=store, config=DaemonConfig(out=out, lease_every_s=0, warm_up=False, node_id="n0",
                                                    slots=SlotsConfig(slots=slots)),
                   handoff=VllmHandoff(engine.url, config=FAST))
        d.resume()
        pub.publish(make_weights(5, shapes=SHAPES, changed=4, pick="randint"), files={"config.json": b"{}"})
        assert d.step() and d.state.engine_version == 6
        assert "xcluster_apply" in [c.body["method"] for c in engine.calls if c.path == "/collective_rpc"]


def test_no_patch_is_written_for_an_engine_that_cannot_use_one(tmp_path, monkeypatch):
    import xcluster.follow.daemon as daemon_mod
    from xcluster.follow.daemon import Daemon, DaemonConfig

    store = LocalStore(tmp_path / "store", fsync=False)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=50))
    with vllm_stand_in(workers=1) as engine:  # no extension: every version reloads
        h = VllmHandoff(engine.url, config=FAST)
        d = Daemon(store=store, config=DaemonConfig(out=tmp_path / "out", lease_every_s=0, warm_up=False),
                   handoff=h)
        written = []
        monkeypatch.setattr(daemon_mod, "write_patch", lambda path, *a: written.append(path) or write_patch(path, *a))
        for s in range(3):
            pub.publish(make_weights(s, shapes=SHAPES, changed=4), files={"config.json": b"{}"})
            assert d.step() and d.state.engine_version == s + 1
        assert not h.wants_patch and written == []
