"""A ``transformers`` ``TrainerCallback`` that publishes the model after every optimizer step.

    from xcluster.integrations.hf import XclusterCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[XclusterCallback("s3://weights/run-42", files=tokenizer_dir)])

Publishing runs in the background (a :class:`~xcluster.write.background.BackgroundPublisher`:
``publish()`` only snapshots the weights; pass ``publisher=Publisher(...)`` to publish synchronously),
floating-point weights are shipped as bf16 by default, and training end flushes: the last version is
committed before ``trainer.train()`` returns. Only the main process publishes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from ..write.background import BackgroundConfig, BackgroundPublisher
from ..write.publisher import Publisher, PublisherConfig


class XclusterCallback(TrainerCallback):
    def __init__(self, url: str | None = None, *, publisher: Publisher | BackgroundPublisher | None = None,
                 config: PublisherConfig | None = None, background: BackgroundConfig | None = None,
                 dtype: torch.dtype | None = torch.bfloat16,
                 files: str | os.PathLike | Mapping[str, bytes] | None = None, every: int = 1) -> None:
        if publisher is None:
            publisher = BackgroundPublisher(url, files=files, config=config, background=background)
        self.publisher = publisher
        self.dtype = dtype
        self.every = every
        self.tickets: list[Any] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None or not state.is_world_process_zero or state.global_step % self.every:
            return control
        self.tickets.append(self.publisher.publish(model.state_dict(), step=state.global_step, dtype=self.dtype))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.publisher.flush()
        return control
