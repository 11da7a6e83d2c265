"""What `pyplan run` trains with, the same in the pipelined run and in --check's single-process
reference: a torch.optim optimizer (SGD or AdamW), an optional linear learning-rate warmup
(then constant) and optional gradient clipping by the global norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OPTIMIZERS", "Training"]

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class Training:
    optimizer: str = "sgd"
    lr: float = 0.01
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None
    """Largest global gradient norm (None: no clipping)."""
    lr_warmup: int = 0
    """Steps of linear warmup from lr / (lr_warmup + 1) to lr."""

    def build(self, params: list[torch.Tensor]):
        """(optimizer, learning-rate scheduler) over `params`."""
        if self.optimizer == "adamw":
            optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        else:
            optimizer = torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
        warmup = self.lr_warmup
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return optimizer, scheduler

    def clip(self, params: list[torch.Tensor]) -> None:
        """Clip in one process (the reference); the pipeline clips with
        Pipeline.clip_grad_norm_, which computes the same norm over all ranks."""
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
