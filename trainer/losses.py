"""Training losses. Each takes logits (B, C) and targets that are either class ids (B,) or
soft targets (B, C) from MixUp/CutMix, and returns the batch mean (float32)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from hpsearch.config import Hyperparams
from torch import Tensor

LossFn = Callable[[Tensor, Tensor], Tensor]


def _soft(target: Tensor, num_classes: int) -> Tensor:
    return target if target.dim() == 2 else F.one_hot(target, num_classes).float()


def cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    logits = logits.float()
    if target.dim() == 1:
        return F.cross_entropy(logits, target)
    return -(target * F.log_softmax(logits, dim=1)).sum(1).mean()


def label_smoothing_ce(logits: Tensor, target: Tensor, smoothing: float) -> Tensor:
    """CE against (1 - eps) * target + eps / C: the same as F.cross_entropy(label_smoothing)."""
    logits = logits.float()
    if target.dim() == 1:
        return F.cross_entropy(logits, target, label_smoothing=smoothing)
    c = logits.shape[1]
    return cross_entropy(logits, target * (1 - smoothing) + smoothing / c)


def focal(logits: Tensor, target: Tensor, gamma: float) -> Tensor:
    """Multi-class focal loss: -sum_c t_c (1 - p_c)^gamma log p_c. gamma=0 is cross-entropy."""
    logits = logits.float()
    logp = F.log_softmax(logits, dim=1)
    t = _soft(target, logits.shape[1])
    weight = (1 - logp.exp()).clamp(min=0).pow(gamma) if gamma > 0 else torch.ones_like(logp)
    return -(t * weight * logp).sum(1).mean()


def make_loss(hp: Hyperparams) -> LossFn:
    if hp.loss == "label_smoothing":
        eps = hp.label_smoothing
        return lambda logits, target: label_smoothing_ce(logits, target, eps)
    if hp.loss == "focal":
        gamma = hp.focal_gamma
        return lambda logits, target: focal(logits, target, gamma)
    return cross_entropy
