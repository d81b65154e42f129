"""A small decoder-only transformer, built in code and randomly initialised (no downloads).

It exists to give the demo real weights with realistic shapes and magnitudes: embeddings,
attention and MLP matrices, LayerNorm scales and biases. Nothing here is tuned for quality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of :class:`TinyTransformer`."""

    vocab_size: int = 4096
    """Number of token ids; the output head is tied to the input embedding."""
    d_model: int = 320
    """Width of the residual stream."""
    n_layers: int = 6
    """Number of transformer blocks."""
    n_heads: int = 5
    """Attention heads; must divide ``d_model``."""
    d_ff: int = 1280
    """Hidden width of each MLP."""
    max_seq_len: int = 64
    """Longest sequence the learned position embedding covers."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ModelConfig.{name} must be ≥ 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"ModelConfig.n_heads ({self.n_heads}) must divide d_model ({self.d_model})")


PRESETS: dict[str, ModelConfig] = {
    # ~8.8M parameters: big enough that bytes and ratios mean something, small enough for CPU.
    "demo": ModelConfig(),
    # ~0.2M parameters: for tests, where only the mechanics matter.
    "tiny": ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, d_ff=256,
                        max_seq_len=32),
}


class Block(nn.Module):
    """Pre-LayerNorm block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``cache`` (sampling only) holds this block's keys and values so far and is extended
        in place; with a cache, ``x`` is either the whole prompt or one new position."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        if cache is not None:
            if cache:
                if t != 1:
                    raise ConfigError("with a non-empty KV cache, feed one position at a time")
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            cache[:] = [k, v]
        # one new query attends to every cached key; otherwise causal over the sequence
        att = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] == k.shape[2])
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    """Token + position embeddings, ``n_layers`` blocks, final LayerNorm, tied output head.

    ``position_ids`` is a registered integer buffer, so the state dict also carries a
    non-float tensor, as real checkpoints often do.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.register_buffer("position_ids", torch.arange(cfg.max_seq_len, dtype=torch.int64))
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual projections scaled down by depth.
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02
                if name.endswith(("proj.weight", "fc2.weight")):
                    std /= math.sqrt(2 * self.cfg.n_layers)
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, *, last_only: bool = False,
                cache: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for int64 ``tokens`` of shape ``(batch, seq)``.

        ``last_only=True`` returns only the last position's logits, ``(batch, vocab)``: all
        that sampling needs, and it skips most of the output-head work. ``cache`` (from
        :meth:`new_cache`) keeps keys and values between calls, so sampling feeds the prompt
        once and then one token per call.
        """
        t = tokens.shape[1]
        start = cache[0][0].shape[2] if cache and cache[0] else 0
        if start + t > self.cfg.max_seq_len:
            raise ConfigError(f"sequence length {start + t} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.tok(tokens) + self.pos(self.position_ids[start:start + t])
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[i])
        if last_only:
            x = x[:, -1]
        return self.ln_f(x) @ self.tok.weight.T

    def new_cache(self) -> list[list[torch.Tensor]]:
        """An empty KV cache: one ``[keys, values]`` slot per block."""
        return [[] for _ in self.blocks]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: ModelConfig, *, seed: int) -> TinyTransformer:
    """A freshly initialised fp32 model; the same ``seed`` gives bit-identical weights."""
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return TinyTransformer(cfg)
    finally:
        torch.random.set_rng_state(gen_state)
