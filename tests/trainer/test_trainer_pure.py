"""The small decision functions: lr scaling, micro-batches, schedules, param groups."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torchvision
from hpsearch.trainer.optim import (
    Schedule,
    lr_factor,
    micro_batches,
    param_groups,
    scaled_lr,
    warmup_steps,
)


def test_scaled_lr() -> None:
    assert scaled_lr(0.1, 512, 256, "none") == 0.1
    assert scaled_lr(0.1, 512, 256, "linear") == pytest.approx(0.2)
    assert scaled_lr(0.1, 64, 256, "linear") == pytest.approx(0.025)
    assert scaled_lr(0.1, 1024, 256, "sqrt") == pytest.approx(0.2)
    with pytest.raises(ValueError):
        scaled_lr(0.1, 1, 1, "cubic")


@pytest.mark.parametrize(
    ("batch", "limit", "expected"),
    [
        (128, None, (128, 1)),
        (128, 128, (128, 1)),
        (256, 128, (128, 2)),
        (300, 128, (100, 3)),
        (257, 128, (86, 3)),  # chunks 86, 86, 85: never above the limit
        (5, 1, (1, 5)),
    ],
)
def test_micro_batches(batch: int, limit: int | None, expected: tuple[int, int]) -> None:
    micro, steps = micro_batches(batch, limit)
    assert (micro, steps) == expected
    assert limit is None or micro <= limit
    sizes = [len(c) for c in torch.arange(batch).tensor_split(steps)]
    assert sum(sizes) == batch and max(sizes) == micro


def test_lr_factor_warmup_and_shapes() -> None:
    total, warm = 100, 10
    assert lr_factor("cosine", 0, total, warm) == pytest.approx(0.1)
    assert lr_factor("cosine", 9, total, warm) == pytest.approx(1.0)
    assert lr_factor("cosine", 10, total, warm) == pytest.approx(1.0)
    assert lr_factor("cosine", 55, total, warm) == pytest.approx(0.5)
    assert lr_factor("cosine", 100, total, warm) == pytest.approx(0.0, abs=1e-9)
    assert lr_factor("onecycle", 55, total, warm) == pytest.approx(0.5)
    assert lr_factor("onecycle", 12, total, 0) == pytest.approx(0.52)  # 25 warmup steps
    # A fraction of an epoch too short to round to a step is one step, not none (which
    # onecycle took for its quarter of the trial: review).
    assert [warmup_steps(w, 3) for w in (0.0, 0.1, 0.2, 0.5, 1.0)] == [0, 1, 1, 2, 3]
    assert lr_factor("constant", 99, total, warm) == 1.0
    assert lr_factor("plateau", 5, total, warm) == pytest.approx(0.6)
    cos = [lr_factor("cosine", s, total, 0) for s in range(total)]
    assert all(a >= b for a, b in itertools.pairwise(cos))


def test_plateau_schedule_reduces_and_checkpoints() -> None:
    sched = Schedule("plateau", 0.1, total_steps=100, warmup_steps=0)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for loss in (1.0, 0.9, 0.95, 0.95):  # two evals without improvement -> x0.2
        sched.observe(loss)
    assert sched.apply(opt, 50) == pytest.approx(0.02)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)
    other = Schedule("plateau", 0.1, 100, 0)
    other.load_state_dict(sched.state_dict())
    assert other.apply(opt, 50) == pytest.approx(0.02)
    cosine = Schedule("cosine", 0.1, 100, 0)
    cosine.observe(5.0)
    cosine.observe(6.0)
    cosine.observe(7.0)
    assert cosine.plateau_scale == 1.0
    assert math.isclose(cosine.apply(opt, 0), 0.1)


def test_no_weight_decay_on_norms_and_biases() -> None:
    model = torchvision.models.resnet18(num_classes=3)
    decay, no_decay = param_groups(model, 5e-4)
    assert decay["weight_decay"] == 5e-4 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"])
    assert any(p is model.bn1.weight for p in no_decay["params"])
    assert any(p is model.fc.bias for p in no_decay["params"])
    n = sum(1 for _ in model.parameters())
    assert len(decay["params"]) + len(no_decay["params"]) == n


def test_no_weight_decay_on_convnexts_layer_scale() -> None:
    """torchvision's ConvNeXt keeps a per-channel scale of shape (C, 1, 1) in each block:
    a scale, not a kernel, though its rank is 3."""
    model = torchvision.models.convnext_tiny(num_classes=3)
    decay, no_decay = param_groups(model, 5e-4)
    scales = [p for name, p in model.named_parameters() if name.endswith("layer_scale")]
    assert len(scales) == 18 and all(p.ndim == 3 for p in scales)
    assert all(any(p is q for q in no_decay["params"]) for p in scales)
    assert not any(p is q for p in scales for q in decay["params"])


def test_warm_cache_keeps_the_most_recently_used_compiled_models() -> None:
    """Compiled models stay on the device outside any trial's reservation: a worker keeps
    only `max_models` of them, dropping the least recently used."""
    from hpsearch.trainer import WarmCache

    warm = WarmCache(max_models=2)
    entry = {k: (torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)) for k in "abc"}
    warm.put_model(("a",), entry["a"])
    warm.put_model(("b",), entry["b"])
    assert warm.get_model(("a",)) is entry["a"]  # "a" is now the most recent
    warm.put_model(("c",), entry["c"])
    assert list(warm.models) == [("a",), ("c",)]
    assert warm.get_model(("b",)) is None
