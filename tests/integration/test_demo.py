"""The demo end to end: a real training loop, a real store, a follower in its own process."""

from __future__ import annotations

import argparse
import io
import json
import os
from pathlib import Path

import pytest

from xcluster.demo import DemoConfig, register, run_demo
from xcluster.errors import ConfigError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def short_demo(tmp_path: Path, **overrides) -> DemoConfig:
    kw = dict(steps=6, keyframe_every=3, model="tiny", out=tmp_path / "out")
    kw.update(overrides)
    return DemoConfig(**kw)


def table_rows(table: str) -> list[list[str]]:
    """The table's body rows split into cells (header and rule line dropped)."""
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["step", "version"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    return [line.split() for line in lines[2:]]


@pytest.mark.slow
@pytest.mark.integration
def test_demo_ships_every_step_and_the_follower_verifies_each(tmp_path):
    printed: list[str] = []
    report = run_demo(short_demo(tmp_path), echo=printed.append)

    assert report.ok, report.failures
    assert report.follower_returncode == 0
    assert [r.step for r in report.rows] == [1, 2, 3, 4, 5, 6]
    assert all(r.verified for r in report.rows)
    # committed_unix is stamped before HEAD is written, so no follower can apply before it.
    assert all(r.latency_seconds is not None and r.latency_seconds >= 0 for r in report.rows)
    kinds = [r.kind for r in report.rows]
    assert kinds[0] == "keyframe" and "delta" in kinds and kinds.count("keyframe") >= 2
    deltas = [r for r in report.rows if r.kind == "delta"]
    assert all(0 < r.changed_elements < r.total_elements for r in deltas)
    assert all(r.bytes_shipped < r.model_bytes for r in deltas)

    # The follower is another process: it wrote its own pid.
    assert report.follower_pid is not None and report.follower_pid != os.getpid()

    # A row per step in the printed table, each verified.
    body = table_rows(report.table)
    assert [int(cells[0]) for cells in body] == [1, 2, 3, 4, 5, 6]
    assert all(cells[-1] == "✓" for cells in body)
    assert report.table in "\n".join(printed)
    assert report.summary_line in printed and "6/6 verified" in report.summary_line

    assert report.plot_path.read_bytes()[:8] == PNG_SIGNATURE
    assert report.plot_path.stat().st_size > 5_000
    steps = json.loads(report.steps_json.read_text())
    assert [s["version"] for s in steps] == [r.version for r in report.rows]

    # Independently of the demo: a fresh subscriber here reaches the same weights.
    from xcluster import Subscriber, SubscriberConfig
    from xcluster.digest import model_digest

    sub = Subscriber(short_demo(tmp_path).store_url, config=SubscriberConfig())
    assert sub.sync() == report.rows[-1].version
    assert model_digest(sub.state_dict()) == report.rows[-1].trainer_digest


@pytest.mark.slow
@pytest.mark.integration
def test_a_single_flipped_bit_in_the_follower_fails_the_demo_with_a_cross(tmp_path, capsys):
    # The follower hashes its weights after flipping one bit at version 2 (a test hook). If the
    # verification compared anything but digests of the weights the follower holds, this
    # would still pass.
    parser = argparse.ArgumentParser(prog="xcluster")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["demo", "--steps", "4", "--keyframe-every", "3", "--model", "tiny",
                              "--out", str(tmp_path / "out"), "--tamper-version", "2"])
    assert args.func(args) == 1

    out = capsys.readouterr().out
    table = out[out.index("step  version"):]
    body = table_rows(table.split("\n\n")[0])
    assert [(int(c[0]), c[-1]) for c in body] == [(1, "✓"), (2, "✗"), (3, "✓"), (4, "✓")]
    assert "FAILED: step 2: version 2 digest mismatch" in out


@pytest.mark.slow
@pytest.mark.integration
def test_follower_exits_non_zero_with_the_error_named_when_nothing_arrives(tmp_path):
    from xcluster.demo.follow import Follower, read_results

    store = tmp_path / "empty-store"
    store.mkdir()
    follower = Follower(str(store), until_version=1, results=tmp_path / "f.jsonl", timeout=0.5)
    code, output = follower.join(timeout=60)
    assert code != 0
    assert "FollowerError" in output and "no new version" in output
    results = read_results(tmp_path / "f.jsonl")
    assert results.pid == follower.pid and results.applied == {}
    assert results.error.startswith("FollowerError:")


def test_refuses_to_wipe_a_store_location_that_is_not_an_xcluster_store(tmp_path):
    foreign = tmp_path / "my-files"
    foreign.mkdir()
    (foreign / "thesis.txt").write_text("do not delete")
    with pytest.raises(ConfigError, match="refusing to wipe"):
        run_demo(short_demo(tmp_path, store=str(foreign)), echo=io.StringIO().write)
    assert (foreign / "thesis.txt").read_text() == "do not delete"


@pytest.mark.slow
@pytest.mark.integration
def test_demo_over_s3(tmp_path, moto_s3, monkeypatch):
    # Both processes find the endpoint and credentials the standard AWS way, from the environment.
    monkeypatch.setenv("AWS_PROFILE", moto_s3.profile)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    url = f"s3://{moto_s3.bucket}/demo-{tmp_path.name}"
    report = run_demo(short_demo(tmp_path, store=url, steps=3, keyframe_every=2),
                      echo=io.StringIO().write)
    assert report.ok, report.failures
    assert [r.kind for r in report.rows] == ["keyframe", "delta", "keyframe"]
    keys = [o["Key"] for o in moto_s3.client().list_objects_v2(
        Bucket=moto_s3.bucket, Prefix=f"demo-{tmp_path.name}/").get("Contents", [])]
    assert f"demo-{tmp_path.name}/HEAD" in keys


def test_training_is_seeded_and_ships_bf16_with_int_buffers_untouched():
    import torch

    from xcluster.demo.model import PRESETS, build_model
    from xcluster.demo.train import PolicyGradientTrainer, TrainConfig, bf16_state_dict
    from xcluster.digest import model_digest

    def train(seed: int) -> dict:
        trainer = PolicyGradientTrainer(build_model(PRESETS["tiny"], seed=seed), TrainConfig(steps=2, seed=seed))
        before = bf16_state_dict(trainer.model)
        trainer.step(), trainer.step()
        after = bf16_state_dict(trainer.model)
        assert model_digest(after) != model_digest(before)  # the steps moved some bf16 weights
        return after

    a, b, c = train(0), train(0), train(1)
    assert model_digest(a) == model_digest(b) != model_digest(c)
    assert a["position_ids"].dtype == torch.int64
    assert all(t.dtype == torch.bfloat16 for k, t in a.items() if k != "position_ids")
