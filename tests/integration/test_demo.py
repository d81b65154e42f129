"""The demo end to end: a real training loop, a real store, the daemon and an engine in processes of their own."""

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
    kw = dict(steps=6, checkpoint_every=3, model="tiny", out=tmp_path / "out")
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
def test_demo_runs_the_whole_loop_and_the_engine_verifies_what_it_serves(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    printed: list[str] = []
    report = run_demo(short_demo(tmp_path), echo=printed.append)

    assert report.ok, report.failures
    assert report.daemon_returncode == 0  # SIGTERM: finished its step, exited 0
    versions = [r.version for r in report.rows]
    assert versions == sorted(set(versions)) and versions[0] == 1
    assert report.rows[-1].verified
    assert all(r.verified for r in report.rows if not r.skipped)
    assert sum(not r.skipped for r in report.rows) >= 2
    assert all(r.latency_seconds is not None and r.latency_seconds >= 0 for r in report.rows if not r.skipped)
    kinds = [r.kind for r in report.rows]
    assert kinds[0] == "keyframe" and set(kinds[1:]) == {"delta"}  # checkpoints are side objects, not versions
    deltas = [r for r in report.rows if r.kind == "delta"]
    assert all(0 < r.changed_elements < r.total_elements for r in deltas)
    assert all(r.bytes_shipped < r.model_bytes for r in deltas)
    assert report.engine_pid is not None and report.engine_pid != os.getpid()

    body = table_rows(report.table)
    assert [int(cells[1]) for cells in body] == versions
    assert report.table in "\n".join(printed)
    assert report.summary_line in printed and "verified bit-exact" in report.summary_line
    assert report.plot_path.read_bytes()[:8] == PNG_SIGNATURE
    steps = json.loads(report.steps_json.read_text())
    assert [s["version"] for s in steps] == versions

    # the rollout node's current directory is a complete HF model directory transformers loads,
    # holding exactly the trainer's last weights
    from xcluster.codec.digest import model_digest

    assert report.final_dir is not None
    files = {p.name for p in report.final_dir.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"} <= files
    model = AutoModelForCausalLM.from_pretrained(report.final_dir, dtype="bfloat16")
    AutoTokenizer.from_pretrained(report.final_dir)
    assert model_digest(dict(model.state_dict())) == report.rows[-1].trainer_digest
    assert report.greedy is not None
    # the daemon's own log says what it did, as JSON lines
    log = [json.loads(ln) for ln in report.daemon_log.read_text().splitlines() if ln.startswith("{")]
    assert any("engine took version" in ln["message"] for ln in log)


@pytest.mark.slow
@pytest.mark.integration
def test_a_single_flipped_bit_in_the_engine_fails_the_demo_with_a_cross(tmp_path, capsys):
    # From version 2 on, the engine hashes its weights after flipping one bit (a test hook). If
    # the verification compared anything but digests of the weights the engine serves, this
    # would still pass.
    parser = argparse.ArgumentParser(prog="xcluster")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["demo", "--steps", "4", "--checkpoint-every", "3", "--model", "tiny",
                              "--out", str(tmp_path / "out"), "--tamper-version", "2"])
    assert args.func(args) == 1

    out = capsys.readouterr().out
    table = out[out.index("step  version"):]
    body = table_rows(table.split("\n\n")[0])
    loaded = [(int(c[1]), c[-1]) for c in body if "skipped" not in " ".join(c)]
    assert loaded and loaded[-1][1] == "✗"
    assert all(mark == ("✓" if v < 2 else "✗") for v, mark in loaded)
    assert "digest mismatch" in out and "FAILED" in out


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
    # Every process finds the endpoint and credentials the standard AWS way, from the environment.
    monkeypatch.setenv("AWS_PROFILE", moto_s3.profile)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    url = f"s3://{moto_s3.bucket}/demo-{tmp_path.name}"
    report = run_demo(short_demo(tmp_path, store=url, steps=3, checkpoint_every=2, background=False),
                      echo=io.StringIO().write)
    assert report.ok, report.failures
    assert [r.kind for r in report.rows] == ["keyframe", "delta", "delta"]
    keys = [o["Key"] for o in moto_s3.client().list_objects_v2(
        Bucket=moto_s3.bucket, Prefix=f"demo-{tmp_path.name}/").get("Contents", [])]
    assert f"demo-{tmp_path.name}/HEAD" in keys
    assert f"demo-{tmp_path.name}/checkpoints/{3:012d}/" in {k[:k.rindex("/") + 1] for k in keys}  # for joiners
    assert any(k.startswith(f"demo-{tmp_path.name}/files/") for k in keys)  # config + tokenizer travel
    assert any(k.startswith(f"demo-{tmp_path.name}/leases/demo-rollout") for k in keys)


def test_training_is_seeded_and_ships_bf16():
    import torch

    from xcluster.demo.hfmodel import PRESETS, build_model
    from xcluster.demo.train import PolicyGradientTrainer, TrainConfig, bf16_state_dict
    from xcluster.codec.digest import model_digest

    def train(seed: int) -> dict:
        model, _ = build_model(PRESETS["tiny"], seed=seed)
        trainer = PolicyGradientTrainer(model.float().train(), TrainConfig(steps=2, seed=seed, lr=1e-4))
        before = bf16_state_dict(trainer.model)
        trainer.step(), trainer.step()
        after = bf16_state_dict(trainer.model)
        assert model_digest(after) != model_digest(before)  # the steps moved some bf16 weights
        return after

    a, b, c = train(0), train(0), train(1)
    assert model_digest(a) == model_digest(b) != model_digest(c)
    assert all(t.dtype == torch.bfloat16 for t in a.values())
