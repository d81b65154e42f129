"""A short fault soak in the suite (bench/soak.py is the long one): real SeaweedFS behind fault
proxies, a trainer process and three ``xcluster subscribe`` daemons killed with SIGKILL at random
moments, ``xcluster gc --apply`` while one daemon is offline. Every directory a daemon exposes is
hashed (SHA-256) against the truth computed from the trainer's formula."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.soak import ModelSpec, Soak, SoakConfig, TrainerModel, run_soak
from xcluster.follow.slots import Slots

SMALL = ModelSpec(tensors=3, rows=64, cols=128)


@pytest.mark.integration
@pytest.mark.slow
def test_short_fault_soak_converges_with_no_corrupt_observation(tmp_path):
    cfg = SoakConfig(versions=30, subscribers=3, min_faults=100, min_kills=8, duration_s=100, converge_timeout_s=60,
                     keyframe_every=6, kill_every_s=(2.5, 4.5), gc_every_s=2.0, grace_s=3.0, lease_ttl_s=3.0, seed=5,
                     workdir=tmp_path / "soak")
    report = run_soak(cfg)
    print(report.table())
    assert not report.corrupt, report.table()
    assert not report.problems, report.table()
    # the trial was real: faults of every kind, kills of both roles, versions, gc deleting
    assert sum(report.faults.values()) >= 100 and set(report.faults) == {
        "reset", "truncate", "flip", "slowdown", "error500", "latency"}, report.faults
    assert report.kills >= 8 and report.publisher_kills >= 1 and report.subscriber_kills >= 2
    assert report.versions_published >= 30 and report.gc_deleted > 0
    assert sum(s.observations for s in report.subs.values()) >= 3 * 3
    # the offline daemon's chain was collected; it came back through a keyframe
    assert report.offline["chain_gone"] and report.offline["rejoined_by_keyframe"], report.offline
    assert all(s.converged and s.final_version == report.versions_published for s in report.subs.values())


def _referee(tmp_path, step: int) -> tuple[Soak, Slots, dict[str, torch.Tensor]]:
    soak = Soak(SoakConfig(subscribers=1, model=SMALL, workdir=tmp_path))
    soak.work = tmp_path
    soak.journal_path = tmp_path / "journal.jsonl"
    soak.head_version = 5
    md = Slots(tmp_path / "sub-0")
    m = TrainerModel(SMALL)
    m.advance_to(step)
    return soak, md, m.state()


def _expose(md: Slots, version: int, state: dict[str, torch.Tensor]) -> None:
    """Make ``current`` name a slot tagged ``version`` holding ``state`` (alternating slots)."""
    name = "b" if md.current() == "a" else "a"
    md.write(name, state, {})
    md.tag(name, version, "0" * 32)
    md.switch_current(name)


def test_the_referee_flags_a_flipped_byte_a_wrong_step_and_a_version_above_head(tmp_path):
    """The soak's verdict is worth something only if its referee can say no."""
    soak, md, state = _referee(tmp_path, 4)
    _expose(md, 4, state)
    assert soak._observe("sub-0", 0.0) == 4 and not soak.report.corrupt  # the truth passes
    # one bit of one tensor flipped in a new directory
    bad = {n: t.clone() for n, t in state.items()}
    bad["layers.1.weight"].view(torch.int16).view(-1)[17] ^= 1
    _expose(md, 5, bad)
    soak._observe("sub-0", 0.0)
    assert len(soak.report.corrupt) == 1 and "layers.1.weight" in soak.report.corrupt[0]
    # the right weights of step 4 exposed as version 3, which the trainer journaled as step 3
    soak.report.corrupt.clear()
    soak.journal_path.write_text(json.dumps({"version": 3, "step": 3, "committed_unix": 0}) + "\n")
    _expose(md, 3, state)
    soak._observe("sub-0", 0.0)
    assert soak.report.corrupt == ["sub-0: version 3 holds step 4, the trainer journaled step 3"]
    # a version HEAD never named
    soak.report.corrupt.clear()
    soak.direct = None
    soak._watch_head = lambda: None
    _expose(md, 9, state)
    soak._observe("sub-0", 0.0)
    assert any("above HEAD" in c for c in soak.report.corrupt), soak.report.corrupt
