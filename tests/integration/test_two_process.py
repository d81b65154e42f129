"""Publisher and rollout daemon (in-process, examples/rollout_follow.py) in separate processes on one store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xcluster import Subscriber

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_trainer_and_rollout_processes(tmp_path):
    store = str(tmp_path / "store")
    steps = 12
    follower = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "rollout_follow.py"), "--store", store,
         "--out", str(tmp_path / "rollout"), "--until-version", str(steps), "--poll", "0.01", "--timeout", "120"],
        stdout=subprocess.PIPE, text=True)
    trainer = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trainer_hook.py"), "--store", store, "--steps", str(steps),
         "--checkpoint-every", "5"], capture_output=True, text=True, timeout=180, check=True)
    out, _ = follower.communicate(timeout=180)
    assert follower.returncode == 0
    published = [json.loads(line) for line in trainer.stdout.splitlines()]
    applied = [json.loads(line) for line in out.splitlines()]
    assert [p["kind"] for p in published] == ["keyframe"] + ["delta"] * (steps - 1)  # checkpoints aside
    assert not [a for a in applied if "error" in a]
    want = {p["version"]: p["digest"] for p in published}
    assert applied, "the follower applied nothing"
    for a in applied:  # every version the follower exposed is bit-exact with the trainer's
        assert a["digest"] == want[a["version"]]
    assert applied[-1]["version"] == steps
    # a subscriber started afterwards, in this process, reconstructs the same final weights
    late = Subscriber(store)
    assert late.sync() == steps
    assert late.model_digest == want[steps]
    assert late.stats.checkpoints_applied == 1  # it joined from the newest checkpoint
    # and the rollout node's current model directory holds exactly that version
    from xcluster import model_digest
    from tests.support.slots import read_current

    version, state, _ = read_current(tmp_path / "rollout")
    assert version == steps and model_digest(state) == want[steps]
