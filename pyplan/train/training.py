"""What `pyplan run` trains with, the same in the pipelined run and in --check's single-process
reference: a torch.optim optimizer (SGD or AdamW, its betas and eps; weight decay on the
parameters of two or more dimensions only), a learning-rate schedule of
torch.optim.lr_scheduler's (linear warm-up, then constant, linear or cosine decay down to a
minimum), optional gradient clipping by the global norm and gradient accumulation over several
plan iterations per optimizer step.

A run resumed from a checkpoint may change these settings (not the optimizer): `switch` gives
the optimizer the new ones and rebuilds the schedule at the step where the run resumes, the
same call in the pipelined run and in the reference, which replays the checkpoint's history.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, fields

import torch
from torch.optim import lr_scheduler

__all__ = ["OPTIMIZERS", "SCHEDULES", "Training", "changes"]

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Training:
    optimizer: str = "sgd"
    lr: float = 0.01
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None
    """Largest global gradient norm (None: no clipping)."""
    lr_warmup: int = 0
    """Steps of linear warm-up from lr / (lr_warmup + 1) to lr."""
    lr_schedule: str = "constant"
    """After the warm-up: constant, or linear or cosine decay to lr_min at the run's last step."""
    lr_min: float = 0.0
    accumulate: int = 1
    """Plan iterations (global batches) whose gradients add up to one optimizer step."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW's eps."""

    def build(self, params: list[torch.Tensor], steps: int):
        """(optimizer, learning-rate scheduler) over `params`, for a run of `steps` optimizer
        steps counted from step 0. Weight decay applies to the parameters of two or more
        dimensions (not biases, not norms' weights, as the Hugging Face Trainer, nanoGPT and
        torchtitan have it); the others are a group of their own, marked no_decay."""
        decayed = {id(p) for p in params if p.dim() >= 2}
        groups = [{"params": [p for p in params if id(p) in decayed]},
                  {"params": [p for p in params if id(p) not in decayed], "no_decay": True}]
        groups = [g for g in groups if g["params"]]
        if self.optimizer == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=tuple(self.betas),
                                          eps=self.eps)
        else:
            optimizer = torch.optim.SGD(groups, lr=self.lr)
        return optimizer, self.switch(optimizer, steps, 0)

    def switch(self, optimizer, steps: int, at: int):
        """Give `optimizer` this learning rate and weight decay (its state stays) and return
        the schedule of a run of `steps` steps, advanced to step `at`."""
        for group in optimizer.param_groups:
            group["lr"] = self.lr
            group["weight_decay"] = 0.0 if group.get("no_decay") else self.weight_decay
            if "betas" in group:
                group["betas"], group["eps"] = tuple(self.betas), self.eps
            group.pop("initial_lr", None)  # else the scheduler would keep the old base lr
        parts, warmup = [], self.lr_warmup
        if warmup:
            parts.append(lr_scheduler.LinearLR(optimizer, start_factor=1 / (warmup + 1),
                                               end_factor=1.0, total_iters=warmup))
        decay = max(steps - warmup, 1)
        if self.lr_schedule == "linear":
            parts.append(lr_scheduler.LinearLR(optimizer, start_factor=1.0,
                                               end_factor=self.lr_min / self.lr,
                                               total_iters=decay))
        elif self.lr_schedule == "cosine":
            parts.append(lr_scheduler.CosineAnnealingLR(optimizer, T_max=decay,
                                                        eta_min=self.lr_min))
        elif not parts:
            parts.append(lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0))
        scheduler = parts[0] if len(parts) == 1 else \
            lr_scheduler.SequentialLR(optimizer, parts, milestones=[warmup])
        with warnings.catch_warnings():  # "step() before optimizer.step()": a replay
            warnings.simplefilter("ignore")
            for _ in range(at):
                scheduler.step()
        return scheduler

    def clip(self, params: list[torch.Tensor]) -> None:
        """Clip in one process (the reference); the pipeline clips with
        Pipeline.clip_grad_norm_, which computes the same norm over all ranks."""
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)

    def record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> "Training":
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in record.items() if k in names}
        if "betas" in values:  # a list in JSON
            values["betas"] = tuple(values["betas"])
        return cls(**values)

    def describe(self) -> str:
        """The header's words for these settings."""
        text = f"{self.optimizer} lr {self.lr:g}"
        if self.optimizer == "adamw" and (tuple(self.betas), self.eps) != ((0.9, 0.999), 1e-8):
            text += f" betas {self.betas[0]:g},{self.betas[1]:g} eps {self.eps:g}"
        if self.weight_decay:
            text += f" weight decay {self.weight_decay:g} (not on biases and norms)"
        if self.clip_grad_norm is not None:
            text += f", clip {self.clip_grad_norm:g}"
        if self.lr_warmup:
            text += f", warmup {self.lr_warmup}"
        if self.lr_schedule != "constant":
            text += f", {self.lr_schedule} decay to {self.lr_min:g}"
        if self.accumulate > 1:
            text += f", {self.accumulate} batches per step"
        return text


_FLAGS = {"lr": "lr", "betas": "adam betas", "eps": "adam eps", "weight_decay": "weight decay",
          "clip_grad_norm": "clip grad norm",
          "lr_warmup": "lr warmup", "lr_schedule": "lr schedule", "lr_min": "lr min",
          "accumulate": "accumulate", "steps": "schedule length (steps)", "dtype": "dtype",
          "params": "params", "compile": "compile"}


def changes(now: dict, saved: dict) -> list[str]:
    """What differs between this run's settings and the checkpoint's, in words:
    "lr 0.01 (was 0.001 in the checkpoint)". Both are Training records with "steps"."""
    out = []
    decays = {now.get("lr_schedule"), saved.get("lr_schedule")} != {"constant"}
    for key, words in _FLAGS.items():
        if key == "steps" and not decays:
            continue  # the length of a constant schedule does not matter
        if key in saved and _plain(now.get(key)) != _plain(saved[key]):
            out.append(f"{words} {_text(now.get(key))} (was {_text(saved[key])} in the "
                       "checkpoint)")
    return out


def _plain(value):
    """A record's value as JSON gives it back (a tuple as a list)."""
    return list(value) if isinstance(value, tuple) else value


def _text(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(_text(v) for v in value)
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
