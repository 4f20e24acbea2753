"""Device-side augmentation: shapes, ranges, per-sample randomness, determinism."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hpsearch.trainer import augment as A


def images(n: int = 8, size: int = 37) -> torch.Tensor:
    """uint8 (n, 3, size, size): a gradient with a bright square, all samples identical."""
    ramp = torch.linspace(0, 255, size)
    img = torch.stack(
        [
            ramp.view(1, -1).expand(size, size),
            ramp.view(-1, 1).expand(size, size),
            torch.full((size, size), 60.0),
        ]
    )
    img[:, 5:15, 20:30] = 250
    return img.round().to(torch.uint8).unsqueeze(0).repeat(n, 1, 1, 1)


def rngs(seed: int = 0) -> tuple[torch.Generator, np.random.Generator]:
    return torch.Generator().manual_seed(seed), np.random.default_rng(seed)


MEAN = torch.tensor(A.MEAN).view(1, 3, 1, 1)
STD = torch.tensor(A.STD).view(1, 3, 1, 1)


@pytest.mark.parametrize("kind", ["none", "flip", "crop_flip", "trivial", "randaugment"])
def test_shapes_dtype_range(kind: str) -> None:
    spec = A.AugmentSpec(kind, 1.0, size=32, num_classes=10)
    x, y = images(16), torch.arange(16) % 10
    out, target = A.train_batch(x, y, spec, *rngs())
    assert out.shape == (16, 3, 32, 32) and out.dtype == torch.float32
    pixels = out * STD + MEAN  # back to [0, 1]
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5
    assert torch.equal(target, y)


def test_per_sample_randomness_and_seeding() -> None:
    spec = A.AugmentSpec("crop_flip", 0.5, size=32, num_classes=10)
    x, y = images(8), torch.zeros(8, dtype=torch.long)
    out, _ = A.train_batch(x, y, spec, *rngs(1))
    # identical inputs, different crops per sample
    assert not torch.allclose(out[0], out[1])
    assert len({tuple(o.flatten()[:50].tolist()) for o in out}) == 8
    again, _ = A.train_batch(x, y, spec, *rngs(1))
    assert torch.equal(out, again)
    other, _ = A.train_batch(x, y, spec, *rngs(2))
    assert not torch.equal(out, other)


def test_policy_picks_ops_per_sample() -> None:
    spec = A.AugmentSpec("trivial", 1.0, size=37, num_classes=10)
    x = images(64)
    gen = torch.Generator().manual_seed(0)
    op = torch.randint(0, len(A.POLICY_OPS), (64,), generator=gen)
    mag = torch.full((64,), 0.8)
    sign = torch.ones(64)
    base = x.float() / 255
    out = A.apply_color_ops(base, op, mag, sign)
    changed = (out - base).abs().flatten(1).amax(1) > 1e-4
    is_color = (op > 0) & (op < len(A.COLOR_OPS))
    assert not changed[~is_color].any()  # identity and geometric ops leave colors alone
    assert changed[is_color].float().mean() > 0.8
    out2, _ = A.train_batch(x, torch.zeros(64, dtype=torch.long), spec, *rngs(3))
    assert out2.shape == (64, 3, 37, 37)


def test_color_kernels() -> None:
    x = images(4).float() / 255
    one = torch.ones(4)
    torch.testing.assert_close(A.brightness(x, one), x)
    torch.testing.assert_close(A.contrast(x, one), x)
    torch.testing.assert_close(A.saturation(x, one), x)
    assert torch.equal(A.brightness(x, torch.zeros(4)), torch.zeros_like(x))
    post = A.posterize(x, torch.full((4,), 2.0))
    assert len(torch.unique(torch.round(post * 255))) <= 4
    sol = A.solarize(x, torch.zeros(4))
    torch.testing.assert_close(sol, 1 - x)
    eq = A.equalize(x)
    assert eq.min() >= 0 and eq.max() <= 1 and eq.shape == x.shape
    ac = A.autocontrast(x * 0.5 + 0.2)
    assert ac.amax(dim=(2, 3)).min() > 0.99


def test_eval_is_deterministic_and_matches_torchvision_resize() -> None:
    from torchvision.transforms.v2 import functional as TF

    x = images(4)
    a = A.eval_batch(x, 32)
    b = A.eval_batch(x, 32)
    assert torch.equal(a, b)
    ref = TF.normalize(TF.resize(x, [32, 32], antialias=True).float() / 255, A.MEAN, A.STD)
    torch.testing.assert_close(a, ref)
    spec = A.AugmentSpec("none", 0.5, size=32, num_classes=10)
    out, _ = A.train_batch(x, torch.zeros(4, dtype=torch.long), spec, *rngs())
    torch.testing.assert_close(out, a)


def test_mixup_cutmix_soft_targets() -> None:
    x, y = images(16), torch.arange(16) % 4
    for mixup, cutmix in ((0.4, 0.0), (0.0, 1.0), (0.4, 1.0)):
        spec = A.AugmentSpec(
            "crop_flip", 0.5, 32, num_classes=4, mixup_alpha=mixup, cutmix_alpha=cutmix
        )
        out, target = A.train_batch(x, y, spec, *rngs(5))
        assert out.shape == (16, 3, 32, 32)
        assert target.shape == (16, 4) and target.dtype == torch.float32
        torch.testing.assert_close(target.sum(1), torch.ones(16))
        assert (target >= 0).all()
        lam = target[torch.arange(16), y]
        assert lam.min() < 0.999  # some samples really mixed (partner has another label)


def test_mix_blends_each_sample_with_its_partner_in_place() -> None:
    """MixUp samples are lam * x + (1 - lam) * partner, CutMix samples take the partner's
    pixels inside their box and their own outside, and no batch-sized copy is made beyond
    the partners': the products and wheres held five batches (500 MiB at 512 images of
    128 px on an H200), which max_micro_batch is there to fit."""
    n = 64
    x = torch.rand(n, 3, 16, 16)
    y = torch.arange(n) % 8
    spec = A.AugmentSpec("crop_flip", 0.5, 16, num_classes=8, mixup_alpha=0.4, cutmix_alpha=1.0)
    partner = x.roll(1, 0)
    before = x.clone()
    mixed, target = A.mix(x, y, spec, *rngs(3))
    assert mixed.data_ptr() == x.data_ptr()  # written over the caller's fresh batch
    lam = target[torch.arange(n), y]
    own = (mixed == before).flatten(1).float().mean(1)
    theirs = (mixed == partner).flatten(1).float().mean(1)
    cut = (own + theirs) > 0.999  # every pixel either its own or its partner's
    assert 0 < int(cut.sum()) < n  # both kinds drawn
    torch.testing.assert_close(own[cut], lam[cut])  # the kept area is the label's weight
    w = lam[~cut].view(-1, 1, 1, 1)
    torch.testing.assert_close(mixed[~cut], w * before[~cut] + (1 - w) * partner[~cut])

    # Peak memory of a batch of 308 MB (512 x 3 x 224 x 224 float32), in a child process
    # so that its peak RSS is the call's: the batch, the partners' copy and small change.
    code = """
import resource, numpy as np, torch
from hpsearch.trainer import augment as A
x = torch.rand(512, 3, 224, 224); y = torch.arange(512) % 10
spec = A.AugmentSpec('crop_flip', 0.5, 224, num_classes=10, mixup_alpha=0.4, cutmix_alpha=1.0)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
A.mix(x, y, spec, torch.Generator().manual_seed(0), np.random.default_rng(0))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024 / x.nbytes)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    extra_batches = float(out.stdout.split()[-1])
    assert extra_batches < 1.6, extra_batches


@pytest.mark.parametrize("strength", [0.0, 0.3, 1.0])
def test_crops_keep_their_drawn_area_and_strength_0_keeps_the_whole_image(
    strength: float,
) -> None:
    """A side that did not fit was clamped, which shrank the crop below its drawn area:
    at strength 0 (area 1) 93% of crops still cut the image."""
    spec = A.AugmentSpec("crop_flip", strength, 16, 10)
    gen = torch.Generator().manual_seed(0)
    m = A.crop_matrices(4000, spec.min_crop_area, gen, torch.device("cpu"), flip=False)
    w, h = m[:, 0, 0], m[:, 1, 1]
    assert bool((w <= 1).all() and (h <= 1).all())
    area = w * h
    assert float(area.min()) >= spec.min_crop_area - 1e-5
    # Uniform in [min_area, 1]: the mean is the midpoint (it was 0.839 for 0.860 at 0.3).
    assert float(area.mean()) == pytest.approx((1 + spec.min_crop_area) / 2, abs=0.01)
    if strength == 0.0:
        assert bool(torch.allclose(area, torch.ones_like(area)))
        assert bool(torch.allclose(m[:, 0, 2], torch.zeros(4000)))  # centred, no shift


@pytest.mark.parametrize("kind", ["crop_flip", "trivial", "randaugment"])
def test_a_micro_batched_step_augments_a_chunk_at_a_time_with_the_same_output(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policies' float copies (about 12 batches' worth for trivial) scaled with the
    whole batch, which max_micro_batch is there to fit: now with a chunk, and the images
    and targets come out the same, MixUp/CutMix included."""
    spec = A.AugmentSpec(kind, 1.0, size=24, num_classes=10, mixup_alpha=0.2, cutmix_alpha=1.0)
    x = torch.randint(0, 256, (10, 3, 28, 28), dtype=torch.uint8)
    y = torch.randint(0, 10, (10,))
    whole = A.train_batch(x, y, spec, torch.Generator().manual_seed(1), np.random.default_rng(1))
    seen: list[int] = []
    real = A.warp

    def warp(batch: torch.Tensor, m: torch.Tensor, size: int) -> torch.Tensor:
        seen.append(batch.shape[0])
        return real(batch, m, size)

    monkeypatch.setattr(A, "warp", warp)
    chunked = A.train_batch(
        x, y, spec, torch.Generator().manual_seed(1), np.random.default_rng(1), chunks=3
    )
    assert seen == [4, 4, 2]
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
