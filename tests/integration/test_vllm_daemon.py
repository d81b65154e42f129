"""The production loop against a real inference engine: trainer hook → store → ``xcluster
subscribe --engine vllm`` → a running vLLM (CPU build, its own venv and process).

After each hand-off the engine's greedy tokens and logprobs (``prompt_logprobs`` on short
prompts, and a prompt longer than one KV block sent *without* them, so a stale prefix cache would
show) must equal those of a vLLM started fresh on the trainer's own bf16 weights — exactly.
The engine venv is built on first use and cached (tests/support/vllm_engine.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.vllm_engine import engine_outputs, ensure_engine_venv, start_vllm
from xcluster import BackgroundPublisher, PublisherConfig, model_digest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = ["the trainer sends weights to the", "version delta store", [0, 5, 17, 99, 130, 200]]


def state(out: Path) -> dict:
    try:
        return json.loads((out / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_engine(out: Path, version: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if state(out).get("engine_version") == version:
            return
        assert proc.poll() is None, f"the daemon exited with {proc.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"the engine never confirmed version {version}: state {state(out)}")


def weight_version(url: str) -> str | None:
    import requests

    return requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"]


def test_daemon_hands_each_version_to_a_real_vllm_bit_exactly(tmp_path):
    from xcluster.demo.hfmodel import PRESETS, build_model, non_weight_files, write_model_dir

    ensure_engine_venv()
    cfg = PRESETS["tiny"]
    model, tok = build_model(cfg, seed=0)
    master = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(5)

    def bf16() -> dict[str, torch.Tensor]:
        return {k: v.to(torch.bfloat16) for k, v in master.items()}

    def train_step() -> None:  # an update large enough to change greedy output
        for k, v in master.items():
            if v.dim() == 2:
                v.add_(torch.randn(v.shape, generator=gen) * 0.02)

    store = str(tmp_path / "store")
    out = tmp_path / "rollout"
    pub = BackgroundPublisher(store, files=non_weight_files(tok, cfg), config=PublisherConfig(keyframe_every=10))
    published: dict[int, dict[str, torch.Tensor]] = {}
    w = bf16()
    pub.publish(w, step=0).result(timeout=60)
    published[1] = w
    # as a Kubernetes sidecar does before the engine starts: lay down the first version
    first = subprocess.run([sys.executable, "-m", "xcluster.cli", "subscribe", store, "--out", str(out), "--once",
                            "--lease-interval", "0"], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    served: dict[int, dict] = {}
    log_path = tmp_path / "daemon.log"
    with start_vllm(out / "current", log_dir=tmp_path) as engine:
        with open(log_path, "w") as log:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "xcluster.cli", "subscribe", store, "--out", str(out), "--engine", "vllm",
                 "--engine-url", engine.url, "--poll", "0.2", "--lease-interval", "1", "--log-format", "json"],
                stderr=log, stdout=subprocess.DEVNULL)
        try:
            wait_engine(out, 1, daemon)
            served[1] = engine_outputs(engine.url, PROMPTS)
            assert weight_version(engine.url) == "1"  # the engine reports the version it serves
            for step in (1, 2):
                train_step()
                w = bf16()
                res = pub.publish(w, step=step).result(timeout=60)
                published[res.version] = w
                wait_engine(out, res.version, daemon)
                served[res.version] = engine_outputs(engine.url, PROMPTS)
                assert weight_version(engine.url) == str(res.version)
        finally:
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=60) == 0
    pub.close()
    assert sorted(served) == [1, 2, 3]
    # the daemon's directory holds exactly the trainer's weights
    from tests.support.slots import read_current

    version, state, _ = read_current(out)
    assert version == 3 and model_digest(state) == model_digest(published[3])
    # the outputs moved with the weights (so equality below is not vacuous)
    greedy = {v: [o["tokens"] for o in s["short"] + s["long"]] for v, s in served.items()}
    assert greedy[1] != greedy[2] != greedy[3]
    # a fresh vLLM on the trainer's own bf16 weights answers exactly the same, logprobs included
    for v in (2, 3):
        ref = write_model_dir(tmp_path / f"ref-{v}", published[v], tok, cfg)
        with start_vllm(ref, log_dir=tmp_path) as fresh:
            assert engine_outputs(fresh.url, PROMPTS) == served[v], f"version {v} differs from a fresh engine"
    lines = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln.startswith("{")]
    took = [ln["message"] for ln in lines if ln["message"].startswith("engine took version")]
    assert len(took) >= 3 and all("engine paused" in m for m in took)
    # an engine without xcluster's worker extension is reloaded each version (test_vllm_inplace: with it)
    assert all(m.endswith("(reload)") for m in took)
    print("\n".join(took))
