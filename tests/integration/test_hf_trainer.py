"""The transformers TrainerCallback: a real Trainer on a tiny Llama, a subscriber rebuilds the last weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def test_trainer_callback_publishes_every_step(tmp_path):
    from transformers import Trainer, TrainingArguments

    from hf_trainer_callback import RandomTokens
    from xcluster import Subscriber, model_digest
    from xcluster.demo.hfmodel import PRESETS, build_model, non_weight_files
    from xcluster.integrations.hf import XclusterCallback

    cfg = PRESETS["tiny"]
    model, tok = build_model(cfg, seed=0)
    model = model.float()
    url = str(tmp_path / "store")
    cb = XclusterCallback(url, files=non_weight_files(tok, cfg))
    trainer = Trainer(model=model, train_dataset=RandomTokens(32, 16, cfg.vocab_size), callbacks=[cb],
                      args=TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=4,
                                             per_device_train_batch_size=4, learning_rate=1e-3, report_to=[],
                                             save_strategy="no", use_cpu=True))
    trainer.train()
    assert len(cb.tickets) == 4
    last = cb.tickets[-1].result(timeout=60)
    want = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert last.model_digest == model_digest(want)
    sub = Subscriber(url)
    assert sub.sync() == last.version
    assert sub.model_digest == model_digest(want)
    assert [f.name for f in sub.manifest.files][:1] == ["config.json"]
    cb.publisher.close()
