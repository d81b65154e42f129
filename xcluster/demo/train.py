"""A policy-gradient-shaped training loop that publishes bf16 weights after every step.

The loss has the shape of REINFORCE: the model samples continuations of random prompts from
its own distribution, each sequence gets a synthetic reward, and the loss is
``-(advantage * logprob).mean()``. Master weights stay fp32 under ``torch.optim.Adam``; what
is shipped is their bf16 cast, the way an RL trainer hands weights to its rollout engines.
With a tiny learning rate most bf16 values do not move from one step to the next, which is
what makes lossless deltas small.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How the demo trains."""

    steps: int = 20
    """Optimizer steps; one published version each."""
    lr: float = 1e-6
    """Adam learning rate."""
    seed: int = 0
    """Seeds prompts, sampling and rewards; the same seed gives bit-identical weights."""
    batch_size: int = 8
    """Sequences sampled per step."""
    prompt_len: int = 4
    """Random prompt tokens before sampling starts."""
    gen_len: int = 16
    """Tokens sampled per sequence; only these enter the loss."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"TrainConfig.steps must be ≥ 1, got {self.steps}")
        if not self.lr > 0:
            raise ConfigError(f"TrainConfig.lr must be > 0, got {self.lr}")
        for name in ("batch_size", "prompt_len", "gen_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"TrainConfig.{name} must be ≥ 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class StepStats:
    step: int
    loss: float
    mean_reward: float
    seconds: float
    """Wall time of sampling, loss, backward and the optimizer step."""


def bf16_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights to ship: floating tensors cast to bf16, other buffers (ints) as they are."""
    return {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()
            for k, v in model.state_dict().items()}


def reward(generated: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Synthetic per-sequence reward: the fraction of sampled tokens in the lower half of the vocabulary."""
    return (generated < vocab_size // 2).to(torch.float32).mean(dim=1)


FIRST_TOKEN = 3
"""Prompts are drawn from ids >= 3: 0-2 are the tokenizer's <s>, </s> and <pad>."""


class PolicyGradientTrainer:
    """Samples from a Hugging Face causal LM (fp32 master weights), scores the samples, takes
    one Adam step per :meth:`step`."""

    def __init__(self, model: torch.nn.Module, config: TrainConfig) -> None:
        cfg = model.config
        if config.prompt_len + config.gen_len > cfg.max_position_embeddings:
            raise ConfigError(
                f"prompt_len + gen_len ({config.prompt_len + config.gen_len}) exceeds the model's "
                f"max_position_embeddings ({cfg.max_position_embeddings}): shorten them or use a larger model")
        self.vocab_size = cfg.vocab_size
        self.model = model
        self.config = config
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.steps_done = 0

    @torch.no_grad()
    def sample(self) -> torch.Tensor:
        """``(batch, prompt_len + gen_len)`` tokens: random prompts continued by the model
        (incremental decoding with the model's KV cache)."""
        from transformers import DynamicCache

        c = self.config
        tokens = torch.randint(FIRST_TOKEN, self.vocab_size, (c.batch_size, c.prompt_len), generator=self.generator)
        cache = DynamicCache()
        step_in = tokens
        for _ in range(c.gen_len):
            with warnings.catch_warnings():  # transformers 5 renames past_key_values; 4.x knows only it
                warnings.simplefilter("ignore", FutureWarning)
                out = self.model(input_ids=step_in, past_key_values=cache, use_cache=True)
            probs = torch.softmax(out.logits[:, -1].float(), dim=-1)
            step_in = torch.multinomial(probs, 1, generator=self.generator)
            tokens = torch.cat([tokens, step_in], dim=1)
        return tokens

    def step(self) -> StepStats:
        t0 = time.perf_counter()
        c = self.config
        self.model.train()
        tokens = self.sample()
        generated = tokens[:, c.prompt_len:]
        r = reward(generated, self.vocab_size)
        advantage = (r - r.mean()) / (r.std() + 1e-6)

        logits = self.model(input_ids=tokens[:, :-1]).logits[:, c.prompt_len - 1:]
        token_logp = torch.log_softmax(logits, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        loss = -(advantage * token_logp.sum(dim=1)).mean()

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps_done += 1
        return StepStats(step=self.steps_done, loss=float(loss.detach()), mean_reward=float(r.mean()),
                         seconds=time.perf_counter() - t0)


@dataclass(frozen=True, slots=True)
class Published:
    """One step's training stats, what ``publish`` returned (a PublishResult from a Publisher, a
    PublishTicket from a BackgroundPublisher), how long it blocked the trainer, and the trainer's own digest."""

    stats: StepStats
    result: Any  # xcluster.PublishResult | xcluster.PublishTicket
    blocked_seconds: float
    trainer_digest: str


def train_and_publish(trainer: PolicyGradientTrainer, publisher: Any, *,
                      digest: Callable[[dict[str, torch.Tensor]], str]) -> Iterator[Published]:
    """Run ``trainer.config.steps`` steps, publishing the bf16 weights after each.

    ``digest`` is computed here, on the trainer's own copy, so a caller can check it against
    both the digest the publisher committed and the one the engine computes.
    """
    for _ in range(trainer.config.steps):
        stats = trainer.step()
        weights = bf16_state_dict(trainer.model)
        t0 = time.perf_counter()
        result = publisher.publish(weights, step=stats.step)
        blocked = time.perf_counter() - t0
        yield Published(stats=stats, result=result, blocked_seconds=blocked, trainer_digest=digest(weights))
