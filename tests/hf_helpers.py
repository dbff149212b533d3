"""Helpers shared by the Hugging Face test files (test_hf_export, test_hf_callbacks,
test_hf_trainer_route): test files import them from here, never from each other.

- the tiny depthdiag checkpoint they export, train on and diagnose (write_checkpoint),
  its sequence length and vocabulary (SEQ, VOCAB).
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.checkpoint import save_checkpoint
from trainer.config import RunConfig
from trainer.model import LoopedTransformer
from trainer.optim import build_optimizer

SEQ, VOCAB = 12, 200


def write_checkpoint(path: Path, *, schedule: str = "uniform:1-16", data: dict | None = None, **model) -> Path:
    """A checkpoint of a model whose weights are its own and whose output depends on the depth:
    the core's matrices are drawn wide, so every iteration moves the state far."""
    config = RunConfig.from_dict(
        {
            "model": {"vocab_size": VOCAB, "max_seq_len": SEQ, "d_model": 32, "n_heads": 2, "init_std": 0.2, **model},
            "data": data or {"bios_people": 20, "eval_sequences": 2},
            "train": {"schedule": schedule, "updates": 8, "batch_size": 2, "seq_len": SEQ, "device": "cpu"},
        }
    )
    torch.manual_seed(len(model))
    net = LoopedTransformer(config.model)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for weight in net.core.parameters():
            if weight.ndim == 2:
                weight.normal_(0.0, 0.5)
    return save_checkpoint(
        path,
        config=config,
        step=7,
        uniform_updates=0,
        model=net,
        optimizer=build_optimizer(net, config.optim),
        lr=1e-3,
        eval_tokens=torch.zeros((2, SEQ + 1), dtype=torch.long),
        progress={},
    )
