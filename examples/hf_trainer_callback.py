"""A Hugging Face ``Trainer`` that ships its weights after every optimizer step.

    python examples/hf_trainer_callback.py --store /tmp/xc-hf --steps 8

The model is a tiny random Llama built in code (no downloads); in real use pass your model and
its directory (``files=``: config.json and tokenizer files travel with the weights).
"""

from __future__ import annotations

import argparse

import torch
from transformers import Trainer, TrainingArguments

from xcluster.demo.hfmodel import PRESETS, build_model, non_weight_files
from xcluster.integrations.hf import XclusterCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="/tmp/xc-hf-trainer")
    args = ap.parse_args()
    cfg = PRESETS["tiny"]
    model, tok = build_model(cfg, seed=0)
    model = model.float()
    callback = XclusterCallback(args.store, files=non_weight_files(tok, cfg))
    trainer = Trainer(model=model, train_dataset=RandomTokens(64, 16, cfg.vocab_size), callbacks=[callback],
                      args=TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4,
                                             learning_rate=1e-4, report_to=[], save_strategy="no", logging_steps=100,
                                             use_cpu=True, dataloader_num_workers=0))
    trainer.train()  # the callback flushed: the last version is committed
    print(f"published up to version {callback.publisher.version}")


if __name__ == "__main__":
    main()
