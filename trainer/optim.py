"""Optimizer, learning-rate schedule and the small decisions around them, as pure functions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from hpsearch.config import Hyperparams
from torch import nn

PLATEAU_FACTOR = 0.2  # lr multiplier after `PLATEAU_PATIENCE` evals without a better val loss
PLATEAU_PATIENCE = 2
PLATEAU_MIN_SCALE = 1e-3


def scaled_lr(lr: float, batch_size: int, base_batch_size: int, rule: str) -> float:
    """Effective learning rate: lr * f(batch_size / base_batch_size), f = 1 | x | sqrt(x)."""
    ratio = batch_size / base_batch_size
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    if rule == "none":
        return lr
    raise ValueError(f"unknown lr_scaling {rule!r}")


def micro_batches(batch_size: int, max_micro_batch: int | None) -> tuple[int, int]:
    """(micro_batch_size, accumulation_steps) for one optimizer step of `batch_size` images.

    The batch is cut into `steps` nearly equal chunks (sizes differ by at most 1), none larger
    than max_micro_batch; each chunk's loss is weighted by its share, so the accumulated
    gradient equals the full batch's.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if max_micro_batch is None or batch_size <= max_micro_batch:
        return batch_size, 1
    steps = math.ceil(batch_size / max_micro_batch)
    return math.ceil(batch_size / steps), steps


ONECYCLE_DEFAULT_WARMUP = 0.25  # fraction of all steps when warmup_epochs is 0


def warmup_steps(warmup_epochs: float, steps_per_epoch: int) -> int:
    """Optimizer steps of a warm-up of `warmup_epochs` (fractions allowed): none for 0, else
    at least one (0.1 epoch of 3 steps rounded to none, which onecycle takes for its
    default quarter of the trial: a search over 0.1..1 saw two schedules)."""
    if warmup_epochs <= 0:
        return 0
    return max(1, round(warmup_epochs * steps_per_epoch))


def lr_factor(schedule: str, step: int, total_steps: int, warmup_steps: int) -> float:
    """Multiplier of the peak lr before optimizer step `step` (0-based), per step.

    cosine: linear warmup then half-cosine to 0; onecycle: linear up then linear down to 0
    (warmup 0 -> 25% of steps up, as a one-cycle schedule always warms up: PyTorch's
    OneCycleLR takes 30%); constant and plateau: linear warmup then 1 (plateau's
    reductions are applied on top, see `Schedule`).
    """
    total_steps = max(total_steps, 1)
    if schedule == "onecycle" and warmup_steps == 0:
        warmup_steps = max(1, round(ONECYCLE_DEFAULT_WARMUP * total_steps))
    warmup_steps = min(warmup_steps, total_steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule in ("constant", "plateau"):
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "onecycle":
        return 1.0 - progress
    raise ValueError(f"unknown schedule {schedule!r}")


@dataclass
class Schedule:
    """Per-step lr with the plateau state that must survive a checkpoint."""

    kind: str
    peak_lr: float
    total_steps: int
    warmup_steps: int
    plateau_scale: float = 1.0
    plateau_best: float = math.inf
    plateau_bad: int = 0
    last_lr: float = field(default=0.0)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = (
            self.peak_lr
            * self.plateau_scale
            * lr_factor(self.kind, step, self.total_steps, self.warmup_steps)
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        self.last_lr = lr
        return lr

    def observe(self, val_loss: float) -> None:
        """After each validation (plateau only): shrink the lr when val loss stalls."""
        if self.kind != "plateau":
            return
        if val_loss < self.plateau_best * (1 - 1e-4):
            self.plateau_best, self.plateau_bad = val_loss, 0
            return
        self.plateau_bad += 1
        if self.plateau_bad >= PLATEAU_PATIENCE:
            self.plateau_scale = max(self.plateau_scale * PLATEAU_FACTOR, PLATEAU_MIN_SCALE)
            self.plateau_bad = 0

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on weight matrices and conv kernels only, not on biases, norm scales or
    ConvNeXt's per-channel `layer_scale` (shaped (C, 1, 1), so not told apart by rank)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            kernel = p.ndim > 1 and not name.endswith("layer_scale")
            (decay if kernel else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, hp: Hyperparams, lr: float) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum, or AdamW (default betas; `momentum` is SGD's only)."""
    groups = param_groups(model, hp.weight_decay)
    if hp.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=hp.momentum, nesterov=hp.momentum > 0)
