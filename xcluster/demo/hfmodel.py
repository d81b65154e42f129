"""A tiny random Hugging Face Llama and a locally trained tokenizer: a model directory vLLM serves.

Everything is built in code, nothing is downloaded: :func:`build_model` initialises a
``LlamaForCausalLM`` from a seed and trains a byte-level BPE tokenizer on a corpus generated here;
:func:`write_model_dir` writes the directory ``from_pretrained`` and vLLM load (sharded bf16
safetensors with their index, ``config.json``, ``generation_config.json``, tokenizer files).
:func:`non_weight_files` returns exactly the non-weight files as bytes, so a publisher can attach
them and a follower can write them next to the weights it reconstructs.

The tokenizer does not depend on the seed (only the weights do), so every version of a model shares
the same non-weight files. Torch and transformers are imported when a function runs, not on import.
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ModelDirError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["HFModelConfig", "PRESETS", "build_model", "build_tokenizer", "write_model_dir",
           "non_weight_files", "weight_shapes", "shard_name", "INDEX_NAME"]

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
INDEX_NAME = "model.safetensors.index.json"
TIED_HEAD = "lm_head.weight"
"""The head of a tied model: the input embedding under another name, not written to the directory."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True, kw_only=True)
class HFModelConfig:
    """Shape of the random Llama; :data:`PRESETS` names the useful ones."""

    vocab_size: int = 512
    """Token ids, shared by the tokenizer (byte-level BPE: ≥ 256 bytes + 3 specials) and the model."""
    hidden_size: int = 256
    """Width of the residual stream."""
    intermediate_size: int = 512
    """Hidden width of each gated MLP."""
    num_hidden_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads; must divide ``hidden_size``. The head size (hidden / heads) must be one vLLM's
    CPU attention supports: 32, 64, 80, 96, 112, 128, 256."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_attention_heads``."""
    max_position_embeddings: int = 512
    """Longest context the rotary embedding is configured for."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output head: the directory then holds no ``lm_head.weight``
    (as transformers saves a tied model)."""
    initializer_range: float = 0.02
    """Std of the normal init of every matrix (norms start at one)."""
    max_shard_bytes: int = 4 * 1024 * 1024
    """Weights go into ``model-0000i-of-0000N.safetensors`` shards of at most about this size
    (a tensor larger than this gets a shard of its own)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "max_shard_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"HFModelConfig.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.vocab_size < 256 + 3:
            raise ConfigError(f"HFModelConfig.vocab_size must be ≥ 259 (256 byte tokens and "
                              f"{BOS}, {EOS}, {PAD}), got {self.vocab_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"HFModelConfig.num_attention_heads ({self.num_attention_heads}) must "
                              f"divide hidden_size ({self.hidden_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"HFModelConfig.num_key_value_heads ({self.num_key_value_heads}) must "
                              f"divide num_attention_heads ({self.num_attention_heads})")
        if not self.initializer_range > 0 or not self.rope_theta > 0:
            raise ConfigError("HFModelConfig.initializer_range and rope_theta must be > 0")

    def llama_config(self) -> LlamaConfig:
        """The transformers config: bf16, the head untied unless asked (then every weight is its own
        tensor), bos/eos/pad ids."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta, initializer_range=self.initializer_range,
            tie_word_embeddings=self.tie_word_embeddings, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1,
            pad_token_id=2)


PRESETS: dict[str, HFModelConfig] = {
    # ~1.4M parameters, 2.9 MB of bf16: for tests, where only the mechanics matter.
    "tiny": HFModelConfig(),
    # ~14M parameters, 28 MB of bf16 in 9 shards: for the demo.
    "demo": HFModelConfig(vocab_size=2048, hidden_size=512, intermediate_size=1408,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                          max_position_embeddings=1024),
}


# --- tokenizer --------------------------------------------------------------------------------------------

_WORDS = (
    "the a an of to in and or is was are be been trainer engine weights version delta store bucket "
    "object shard tensor model policy reward rollout gradient step update publish follow reload "
    "token prompt answer question number sum product two three four five six seven eight nine ten "
    "zero one red green blue small large fast slow cat dog bird fish tree river mountain city "
    "learns writes reads sends waits checks adds counts moves runs holds keeps says knows"
).split()


def _corpus(lines: int = 4000) -> list[str]:
    """Text to train the tokenizer on: sentences, arithmetic and code-like lines from a fixed seed."""
    rng = random.Random(20240601)
    out = []
    for i in range(lines):
        kind = i % 4
        if kind == 0:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
            out.append(" ".join(words).capitalize() + rng.choice(".!?"))
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            out.append(f"Question: what is {a} + {b}? Answer: {a + b}.")
        elif kind == 2:
            name = "_".join(rng.choice(_WORDS) for _ in range(2))
            out.append(f"def {name}(x, y={rng.randint(0, 99)}):\n    return x * y + {rng.random():.3f}")
        else:
            out.append("".join(chr(rng.randint(33, 126)) for _ in range(rng.randint(8, 40))))
    return out


def build_tokenizer(config: HFModelConfig) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ``config.vocab_size`` ids (``<s>`` 0, ``</s>`` 1, ``<pad>`` 2), trained
    on :func:`_corpus`; it prepends ``<s>`` like Llama's. Same config → same tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size, special_tokens=[BOS, EOS, PAD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, model_max_length=config.max_position_embeddings)


# --- model ------------------------------------------------------------------------------------------------


def build_model(config: HFModelConfig, *, seed: int) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A randomly initialised bf16 ``LlamaForCausalLM`` (eval mode) and its tokenizer.

    The weights depend only on ``config`` and ``seed`` (initialised in fp32 under a forked RNG, then
    cast), so the same arguments give bit-identical weights and the caller's RNG is untouched.
    """
    import torch
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config.llama_config())
    return model.to(torch.bfloat16).eval(), build_tokenizer(config)


def weight_shapes(config: HFModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every weight the model directory holds (built on the meta device, no memory)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config.llama_config())
    return {name: tuple(t.shape) for name, t in model.state_dict().items()
            if not (config.tie_word_embeddings and name == TIED_HEAD)}


def _checked_bf16(config: HFModelConfig, weights: Any) -> dict[str, torch.Tensor]:
    """``weights`` (a model or a state dict) as contiguous bf16 CPU tensors, names and shapes checked."""
    import torch

    state = weights.state_dict() if hasattr(weights, "state_dict") else weights
    if not isinstance(state, Mapping):
        raise ConfigError(f"write_model_dir needs a model or a state dict, got {type(weights).__name__}")
    if config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != TIED_HEAD}  # the embedding's other name
    expected = weight_shapes(config)
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ModelDirError(f"weights do not match {config}: missing {missing[:5]}, unexpected "
                            f"{unexpected[:5]}; pass the state dict of build_model(config)'s model")
    out = {}
    for name in sorted(expected):
        tensor = state[name]
        if tuple(tensor.shape) != expected[name]:
            raise ModelDirError(f"weight {name} has shape {tuple(tensor.shape)}, the config says "
                                f"{expected[name]}; pass weights built for this config")
        out[name] = tensor.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return out


def _shards(config: HFModelConfig, tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Tensor names grouped into shards of at most ``max_shard_bytes`` each, in name order."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > config.max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_name(i: int, n: int) -> str:
    """``model-0000i-of-0000N.safetensors``, 1-based, as transformers names them."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def write_model_dir(path: str | Path, weights: Any, tokenizer: PreTrainedTokenizerFast,
                    config: HFModelConfig) -> Path:
    """Write a complete Hugging Face model directory at ``path`` (created if needed) and return it.

    ``weights`` is a model or its state dict; every tensor is written as bf16 into sharded safetensors
    with ``model.safetensors.index.json``, next to the files of :func:`non_weight_files`.
    """
    from safetensors.torch import save_file

    path = Path(path)
    tensors = _checked_bf16(config, weights)
    path.mkdir(parents=True, exist_ok=True)
    shards = _shards(config, tensors)
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file = shard_name(i, len(shards))
        save_file({n: tensors[n] for n in names}, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name, data in non_weight_files(tokenizer, config).items():
        (path / name).write_bytes(data)
    return path


def non_weight_files(tokenizer: PreTrainedTokenizerFast, config: HFModelConfig) -> dict[str, bytes]:
    """File name → bytes of everything in the model directory except weights and their index:
    ``config.json``, ``generation_config.json`` and the tokenizer's files, as transformers writes them."""
    from transformers import GenerationConfig

    llama = config.llama_config()
    with tempfile.TemporaryDirectory(prefix="xcluster-hf-") as tmp:
        out = Path(tmp)
        llama.save_pretrained(out)
        GenerationConfig.from_model_config(llama).save_pretrained(out)
        tokenizer.save_pretrained(out)
        files = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}
    unexpected = sorted(set(files) - {"config.json", "generation_config.json", *_TOKENIZER_FILES})
    if unexpected or any(n.endswith(".safetensors") for n in files):
        raise ModelDirError(f"transformers wrote unexpected files {unexpected} for the config and "
                            "tokenizer; update xcluster.demo.hfmodel for this transformers version")
    return files
