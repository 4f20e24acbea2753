"""Losses against references on small tensors, with hard and soft targets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hpsearch.trainer.losses import cross_entropy, focal, label_smoothing_ce


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=g) * 3
    hard = torch.randint(0, 5, (6,), generator=g)
    soft = torch.softmax(torch.randn(6, 5, generator=g), dim=1)
    return logits, hard, soft


def focal_reference(logits: torch.Tensor, target: torch.Tensor, gamma: float) -> torch.Tensor:
    """Loop form of -sum_c t_c (1 - p_c)^gamma log p_c, averaged over the batch."""
    total = 0.0
    for i in range(logits.shape[0]):
        p = torch.softmax(logits[i].double(), 0)
        for c in range(logits.shape[1]):
            total += -target[i, c].double() * (1 - p[c]) ** gamma * torch.log(p[c])
    return torch.as_tensor(total / logits.shape[0])


def test_cross_entropy(batch: tuple[torch.Tensor, ...]) -> None:
    logits, hard, soft = batch
    torch.testing.assert_close(cross_entropy(logits, hard), F.cross_entropy(logits, hard))
    torch.testing.assert_close(
        cross_entropy(logits, F.one_hot(hard, 5).float()), F.cross_entropy(logits, hard)
    )
    torch.testing.assert_close(cross_entropy(logits, soft), F.cross_entropy(logits, soft))


def test_label_smoothing(batch: tuple[torch.Tensor, ...]) -> None:
    logits, hard, soft = batch
    ref = F.cross_entropy(logits, hard, label_smoothing=0.1)
    torch.testing.assert_close(label_smoothing_ce(logits, hard, 0.1), ref)
    torch.testing.assert_close(label_smoothing_ce(logits, F.one_hot(hard, 5).float(), 0.1), ref)
    ref_soft = F.cross_entropy(logits, soft, label_smoothing=0.2)
    torch.testing.assert_close(label_smoothing_ce(logits, soft, 0.2), ref_soft)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_focal_matches_reference(batch: tuple[torch.Tensor, ...], gamma: float) -> None:
    logits, hard, soft = batch
    onehot = F.one_hot(hard, 5).float()
    torch.testing.assert_close(
        focal(logits, hard, gamma).double(), focal_reference(logits, onehot, gamma)
    )
    torch.testing.assert_close(
        focal(logits, soft, gamma).double(), focal_reference(logits, soft, gamma)
    )


def test_focal_gamma_zero_is_cross_entropy(batch: tuple[torch.Tensor, ...]) -> None:
    logits, hard, soft = batch
    torch.testing.assert_close(focal(logits, hard, 0.0), F.cross_entropy(logits, hard))
    torch.testing.assert_close(focal(logits, soft, 0.0), F.cross_entropy(logits, soft))
    assert focal(logits, hard, 2.0) < F.cross_entropy(logits, hard)  # easy examples shrink


def test_losses_backprop_in_float32_from_bf16() -> None:
    logits = torch.randn(4, 3).bfloat16().requires_grad_()
    loss = focal(logits, torch.tensor([0, 1, 2, 0]), 2.0)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()
