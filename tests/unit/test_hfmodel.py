"""The tiny random Llama and its tokenizer: a model directory transformers loads back, bit-exact."""

import json
from dataclasses import replace

import pytest
import torch

from xcluster.demo.hfmodel import (INDEX_NAME, PRESETS, HFModelConfig, build_model, non_weight_files,
                                   shard_name, write_model_dir)
from xcluster.errors import ConfigError, ModelDirError

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny():
    return build_model(TINY, seed=0)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_model_shape_and_dtype(tiny):
    model, tok = tiny
    state = model.state_dict()
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert state["model.embed_tokens.weight"].shape == (TINY.vocab_size, TINY.hidden_size)
    # untied: the head is a tensor of its own, not a view of the embedding
    assert state["lm_head.weight"].data_ptr() != state["model.embed_tokens.weight"].data_ptr()
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert len(tok) == TINY.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)


def test_tokenizer_round_trips_text_and_prepends_bos(tiny):
    _, tok = tiny
    text = "Question: what is 417 + 25? Answer: 442. Ünïcode ✓ too"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert len(ids) < len(text.encode())  # merges learned, not just bytes
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_dir_loads_back_bit_identical(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = tiny
    path = write_model_dir(tmp_path / "m", model, tok, TINY)
    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert loaded.dtype == torch.bfloat16
    assert type(loaded).__name__ == "LlamaForCausalLM"
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name].view(torch.int16), got[name].view(torch.int16)), name
    tok2 = AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = "def reload_weights(x, y=3):\n    return x * y"
    assert tok2(text).input_ids == tok(text).input_ids
    assert tok2.eos_token_id == tok.eos_token_id == loaded.generation_config.eos_token_id


def test_dir_holds_sharded_weights_and_exactly_the_non_weight_files(tiny, tmp_path):
    from safetensors import safe_open

    model, tok = tiny
    config = replace(TINY, max_shard_bytes=300_000)
    path = write_model_dir(tmp_path / "m", model.state_dict(), tok, config)
    index = json.loads((path / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n > 2 and shards == [shard_name(i, n) for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(model.state_dict())
    for shard in shards:
        with safe_open(path / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert all(index["weight_map"][k] == shard for k in f.keys())
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in model.state_dict().values())
    extra = non_weight_files(tok, config)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(extra)
    on_disk = {p.name for p in path.iterdir()}
    assert on_disk == set(extra) | set(shards) | {INDEX_NAME}
    for name, data in extra.items():
        assert (path / name).read_bytes() == data, name
    cfg = json.loads(extra["config.json"])
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False
    assert cfg["num_hidden_layers"] == TINY.num_hidden_layers


def test_deterministic_per_seed(tiny, tmp_path):
    model, tok = tiny
    again, tok_again = build_model(TINY, seed=0)
    other, tok_other = build_model(TINY, seed=1)
    a = write_model_dir(tmp_path / "a", model, tok, TINY)
    b = write_model_dir(tmp_path / "b", again, tok_again, TINY)
    c = write_model_dir(tmp_path / "c", other, tok_other, TINY)
    files = sorted(p.name for p in a.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    shards = [n for n in files if n.endswith(".safetensors")]
    assert all((a / n).read_bytes() != (c / n).read_bytes() for n in shards)
    # the seed changes weights only: every version of a model shares its non-weight files
    assert non_weight_files(tok, TINY) == non_weight_files(tok_other, TINY)


def test_build_does_not_touch_the_callers_rng():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_model(replace(TINY, num_hidden_layers=1), seed=7)
    assert torch.equal(torch.rand(4), expected)


def test_wrong_weights_are_refused_by_name(tiny, tmp_path):
    model, tok = tiny
    state = dict(model.state_dict())
    state["model.norm.weight"] = torch.ones(TINY.hidden_size + 1, dtype=torch.bfloat16)
    with pytest.raises(ModelDirError, match="model.norm.weight"):
        write_model_dir(tmp_path / "x", state, tok, TINY)
    del state["lm_head.weight"]
    with pytest.raises(ModelDirError, match="lm_head.weight"):
        write_model_dir(tmp_path / "x", state, tok, TINY)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("kw, needle", [
    (dict(vocab_size=100), "vocab_size"),
    (dict(hidden_size=250), "num_attention_heads"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(num_hidden_layers=0), "num_hidden_layers"),
])
def test_config_checks_explain_themselves(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        HFModelConfig(**kw)
