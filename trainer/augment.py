"""Batched augmentation on the device, with per-sample randomness.

Input is a uint8 batch (B, 3, S, S) of cached center crops (S = cache size); output is a
normalized float batch (B, 3, R, R) at the trial's image size R.

torchvision.transforms.v2 draws ONE set of random parameters per call, so on a batch tensor
every image would get the same crop and the same op. The kernels here draw parameters per
sample and stay batched: every geometric change (random-resized crop, flip, rotate, shear,
translate) is folded into one affine matrix per sample and applied with a single
`grid_sample`; photometric ops are computed for the whole batch and selected per sample with
`torch.where` (no per-image Python, no host syncs, static shapes). The deterministic eval
resize uses torchvision.transforms.v2.functional.resize.

All randomness comes from one torch.Generator on the device (and, for the Beta draws of
MixUp/CutMix, which torch cannot take from a generator, one numpy Generator), both seeded
from the trial seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.transforms.v2 import functional as TF

MEAN = (0.485, 0.456, 0.406)  # ImageNet statistics, which the pretrained weights expect
STD = (0.229, 0.224, 0.225)

# Policy ops (TrivialAugment / RandAugment families). Magnitudes at augment_strength=1:
# factors 1 +/- 0.9, rotate 30 degrees, shear 0.3, translate 30% of the side, posterize to
# 4 bits, solarize threshold down to 0.
COLOR_OPS = (
    "identity",
    "brightness",
    "contrast",
    "color",
    "sharpness",
    "posterize",
    "solarize",
    "autocontrast",
    "equalize",
)
GEOMETRIC_OPS = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
POLICY_OPS = COLOR_OPS + GEOMETRIC_OPS
MAX_ROTATE_DEG = 30.0
MAX_SHEAR = 0.3
MAX_TRANSLATE = 0.3  # fraction of the image side
MAX_FACTOR = 0.9
RANDAUGMENT_N = 2  # ops per sample


@dataclass(frozen=True)
class AugmentSpec:
    kind: str  # none|flip|crop_flip|trivial|randaugment
    strength: float  # 0..1 of each op's max magnitude
    size: int  # output px
    num_classes: int
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    @property
    def min_crop_area(self) -> float:
        # strength 1 -> 0.08 (the usual RandomResizedCrop), 0.5 -> 0.54, 0 -> no crop.
        return 1.0 - 0.92 * self.strength


# --- deterministic parts ---------------------------------------------------------------


def eval_resize(x: Tensor, size: int) -> Tensor:
    """Cached center crops (B, 3, S, S) uint8 -> (B, 3, size, size) uint8, antialiased.

    Used by both data paths for evaluation, and for training with augment=none/flip.
    """
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    return TF.resize(x, [size, size], antialias=True)


def normalize(x: Tensor) -> Tensor:
    """uint8 (or float in [0, 1]) -> float32 normalized by ImageNet mean/std."""
    if x.dtype == torch.uint8:
        x = x.float().div_(255.0)
    mean = torch.tensor(MEAN, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    return (x - mean) / std


def eval_batch(x: Tensor, size: int) -> Tensor:
    """The whole eval transform: resize then normalize."""
    return normalize(eval_resize(x, size))


# --- random draws ----------------------------------------------------------------------


def _uniform(n: int, low: float, high: float, gen: torch.Generator, device: torch.device) -> Tensor:
    return torch.rand(n, generator=gen, device=device) * (high - low) + low


def _sign(n: int, gen: torch.Generator, device: torch.device) -> Tensor:
    return torch.randint(0, 2, (n,), generator=gen, device=device).float() * 2 - 1


# --- geometry: one affine matrix per sample --------------------------------------------


def crop_matrices(
    n: int, min_area: float, gen: torch.Generator, device: torch.device, flip: bool
) -> Tensor:
    """(n, 3, 3) maps from output coords to input coords, both in [-1, 1]: a random-resized
    crop (area fraction in [min_area, 1], aspect in [3/4, 4/3]) and a horizontal flip (p=0.5).
    """
    area = _uniform(n, min_area, 1.0, gen, device)
    log_ratio = _uniform(n, math.log(3 / 4), math.log(4 / 3), gen, device)
    # An aspect within [area, 1/area] keeps both sides inside the image: clamping a side
    # instead shrank the crop below its drawn area, and area 1 (strength 0) still cropped.
    ratio = torch.minimum(torch.maximum(torch.exp(log_ratio), area), 1.0 / area)
    w = torch.sqrt(area * ratio).clamp(max=1.0)  # crop width as a fraction of the side
    h = torch.sqrt(area / ratio).clamp(max=1.0)
    cx = _uniform(n, -1.0, 1.0, gen, device) * (1 - w)  # keep the crop inside the image
    cy = _uniform(n, -1.0, 1.0, gen, device) * (1 - h)
    sx = w * _sign(n, gen, device) if flip else w
    m = torch.zeros(n, 3, 3, device=device)
    m[:, 0, 0] = sx
    m[:, 0, 2] = cx
    m[:, 1, 1] = h
    m[:, 1, 2] = cy
    m[:, 2, 2] = 1.0
    return m


def policy_geometry(op: Tensor, mag: Tensor, sign: Tensor) -> Tensor:
    """(n, 3, 3) for the geometric policy op chosen per sample (identity for color ops)."""
    n = op.shape[0]
    base = len(COLOR_OPS)
    s = mag * sign
    angle = torch.where(op == base, s * math.radians(MAX_ROTATE_DEG), torch.zeros_like(s))
    shx = torch.where(op == base + 1, s * MAX_SHEAR, torch.zeros_like(s))
    shy = torch.where(op == base + 2, s * MAX_SHEAR, torch.zeros_like(s))
    tx = torch.where(op == base + 3, s * MAX_TRANSLATE * 2, torch.zeros_like(s))  # [-1,1] = 2
    ty = torch.where(op == base + 4, s * MAX_TRANSLATE * 2, torch.zeros_like(s))
    cos, sin = torch.cos(angle), torch.sin(angle)
    m = torch.zeros(n, 3, 3, device=op.device)
    # rotation @ shear, then translation
    m[:, 0, 0] = cos - sin * shy
    m[:, 0, 1] = cos * shx - sin
    m[:, 1, 0] = sin + cos * shy
    m[:, 1, 1] = sin * shx + cos
    m[:, 0, 2] = tx
    m[:, 1, 2] = ty
    m[:, 2, 2] = 1.0
    return m


def warp(x: Tensor, m: Tensor, size: int) -> Tensor:
    """Resample float images (B, 3, H, W) through per-sample matrices to (B, 3, size, size).
    Outside the source image is black (0), like torchvision's default fill."""
    grid = F.affine_grid(m[:, :2, :], [x.shape[0], 3, size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


# --- photometric kernels: per-sample factors, batched --------------------------------


def _gray(x: Tensor) -> Tensor:
    return (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]).expand_as(x)


def _blend(a: Tensor, b: Tensor, factor: Tensor) -> Tensor:
    """factor * a + (1 - factor) * b per sample, clamped to [0, 1]."""
    f = factor.view(-1, 1, 1, 1)
    return (b + f * (a - b)).clamp_(0.0, 1.0)


def brightness(x: Tensor, factor: Tensor) -> Tensor:
    return _blend(x, torch.zeros_like(x), factor)


def contrast(x: Tensor, factor: Tensor) -> Tensor:
    mean = _gray(x).mean(dim=(1, 2, 3), keepdim=True).expand_as(x)
    return _blend(x, mean, factor)


def saturation(x: Tensor, factor: Tensor) -> Tensor:
    return _blend(x, _gray(x), factor)


def sharpness(x: Tensor, factor: Tensor) -> Tensor:
    k = torch.tensor([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]], device=x.device) / 13
    blurred = F.conv2d(x, k.expand(3, 1, 3, 3).to(x.dtype), padding=1, groups=3)
    blurred[..., 0, :], blurred[..., -1, :] = x[..., 0, :], x[..., -1, :]  # PIL keeps borders
    blurred[..., :, 0], blurred[..., :, -1] = x[..., :, 0], x[..., :, -1]
    return _blend(x, blurred, factor)


def posterize(x: Tensor, bits: Tensor) -> Tensor:
    """Keep `bits` (per sample, 1..8) most significant bits of each 8-bit value."""
    step = torch.pow(2.0, 8 - bits).view(-1, 1, 1, 1)
    return torch.floor(torch.round(x * 255) / step) * step / 255


def solarize(x: Tensor, threshold: Tensor) -> Tensor:
    t = threshold.view(-1, 1, 1, 1)
    return torch.where(x >= t, 1.0 - x, x)


def autocontrast(x: Tensor) -> Tensor:
    lo = x.amin(dim=(2, 3), keepdim=True)
    hi = x.amax(dim=(2, 3), keepdim=True)
    scale = torch.where(hi > lo, 1.0 / (hi - lo).clamp(min=1e-6), torch.ones_like(hi))
    lo = torch.where(hi > lo, lo, torch.zeros_like(lo))
    return ((x - lo) * scale).clamp_(0.0, 1.0)


def equalize(x: Tensor) -> Tensor:
    """Histogram equalization per sample and channel (256 bins), via scatter_add + gather."""
    b, c, h, w = x.shape
    v = torch.round(x * 255).long().clamp_(0, 255).view(b * c, h * w)
    hist = torch.zeros(b * c, 256, device=x.device).scatter_add_(
        1, v, torch.ones_like(v, dtype=torch.float32)
    )
    cdf = hist.cumsum(1)
    cdf_min = torch.where(hist > 0, cdf, torch.full_like(cdf, float(h * w))).amin(1, keepdim=True)
    denom = (h * w - cdf_min).clamp(min=1.0)
    lut = ((cdf - cdf_min) / denom).clamp_(0.0, 1.0)
    out = torch.gather(lut, 1, v).view(b, c, h, w).to(x.dtype)
    flat = (h * w - cdf_min).view(b, c, 1, 1) <= 0  # single-valued channel: unchanged
    return torch.where(flat, x, out)


def apply_color_ops(x: Tensor, op: Tensor, mag: Tensor, sign: Tensor) -> Tensor:
    """Apply the color op chosen per sample; samples with geometric/identity ops unchanged."""
    factor = 1.0 + sign * mag * MAX_FACTOR

    out = x
    for k, fn in (
        ("brightness", lambda: brightness(x, factor)),
        ("contrast", lambda: contrast(x, factor)),
        ("color", lambda: saturation(x, factor)),
        ("sharpness", lambda: sharpness(x, factor)),
        ("posterize", lambda: posterize(x, 8 - torch.round(mag * 4))),
        ("solarize", lambda: solarize(x, 1.0 - mag + 1 / 512)),
        ("autocontrast", lambda: autocontrast(x)),
        ("equalize", lambda: equalize(x)),
    ):
        mask = (op == COLOR_OPS.index(k)).view(-1, 1, 1, 1)
        out = torch.where(mask, fn(), out)
    return out


# --- mixing ----------------------------------------------------------------------------


def mix(
    x: Tensor,
    y: Tensor,
    spec: AugmentSpec,
    gen: torch.Generator,
    np_rng: np.random.Generator,
) -> tuple[Tensor, Tensor]:
    """Per-sample MixUp / CutMix with the next sample of the (already shuffled) batch.
    Returns mixed images, written over `x`, and soft targets (B, num_classes). With both
    alphas > 0 each sample uses one of the two with probability 1/2."""
    b, _, hgt, wid = x.shape
    dev = x.device
    use_mixup = spec.mixup_alpha > 0
    use_cutmix = spec.cutmix_alpha > 0
    lam_mix = (
        torch.from_numpy(
            np_rng.beta(spec.mixup_alpha, spec.mixup_alpha, b) if use_mixup else np.ones(b)
        )
        .float()
        .to(dev)
    )
    lam_cut = (
        torch.from_numpy(
            np_rng.beta(spec.cutmix_alpha, spec.cutmix_alpha, b) if use_cutmix else np.ones(b)
        )
        .float()
        .to(dev)
    )
    if use_mixup and use_cutmix:
        cut = torch.rand(b, generator=gen, device=dev) < 0.5
    else:
        cut = torch.full((b,), use_cutmix, device=dev, dtype=torch.bool)
    partner = torch.roll(torch.arange(b, device=dev), 1)
    xp = x[partner]

    # CutMix box per sample, area (1 - lam) of the image, clipped at the borders.
    r = torch.sqrt(1.0 - lam_cut)
    ch, cw = r * hgt, r * wid
    cy = torch.rand(b, generator=gen, device=dev) * hgt
    cx = torch.rand(b, generator=gen, device=dev) * wid
    y0, y1 = (cy - ch / 2).clamp(0, hgt).round(), (cy + ch / 2).clamp(0, hgt).round()
    x0, x1 = (cx - cw / 2).clamp(0, wid).round(), (cx + cw / 2).clamp(0, wid).round()
    ys = torch.arange(hgt, device=dev).view(1, hgt, 1)
    xs = torch.arange(wid, device=dev).view(1, 1, wid)
    box = (
        (ys >= y0.view(-1, 1, 1))
        & (ys < y1.view(-1, 1, 1))
        & (xs >= x0.view(-1, 1, 1))
        & (xs < x1.view(-1, 1, 1))
    )
    box = box & cut.view(-1, 1, 1)
    lam_box = 1.0 - (y1 - y0) * (x1 - x0) / (hgt * wid)  # the area actually kept
    lam = torch.where(cut, lam_box, lam_mix)

    # In place on x (the caller's fresh batch): the batch and its partners' copy are the only
    # batch-sized tensors, where products and wheres took five (500 MiB at 512 x 128 px).
    keep = torch.where(cut, torch.ones_like(lam), lam).view(-1, 1, 1, 1)  # x's own weight
    mixed = x.lerp_(xp, 1.0 - keep)
    torch.where(box.unsqueeze(1), xp, mixed, out=mixed)
    onehot = F.one_hot(y, spec.num_classes).float()
    target = lam.view(-1, 1) * onehot + (1 - lam.view(-1, 1)) * onehot[partner]
    return mixed, target


# --- the training transform ------------------------------------------------------------


def train_batch(
    x: Tensor,
    y: Tensor,
    spec: AugmentSpec,
    gen: torch.Generator,
    np_rng: np.random.Generator,
    chunks: int = 1,
) -> tuple[Tensor, Tensor]:
    """uint8 (B, 3, S, S) cached crops -> normalized float (B, 3, R, R) and targets: int64
    class ids, or soft targets (B, C) when MixUp/CutMix are on. The random draws are the
    whole batch's; the warp and colour ops, per image, run `chunks` pieces at a time (their
    float copies are then a piece's, not the batch's): the same output for any `chunks`."""
    n, dev = x.shape[0], x.device
    kind = spec.kind
    if kind in ("none", "flip"):
        out = eval_resize(x, spec.size).float().div_(255.0)
        if kind == "flip":
            flip = torch.rand(n, generator=gen, device=dev) < 0.5
            out = torch.where(flip.view(-1, 1, 1, 1), out.flip(3), out)
    else:
        m = crop_matrices(n, spec.min_crop_area, gen, dev, flip=True)
        slots = 0 if kind == "crop_flip" else (1 if kind == "trivial" else RANDAUGMENT_N)
        ops, mags, signs = [], [], []
        for _ in range(slots):
            op = torch.randint(0, len(POLICY_OPS), (n,), generator=gen, device=dev)
            if kind == "trivial":  # TrivialAugment: magnitude uniform in [0, strength]
                mag = torch.rand(n, generator=gen, device=dev) * spec.strength
            else:  # RandAugment: one fixed magnitude
                mag = torch.full((n,), spec.strength, device=dev)
            sign = _sign(n, gen, dev)
            m = m @ policy_geometry(op, mag, sign)
            ops.append(op)
            mags.append(mag)
            signs.append(sign)
        size = max(1, -(-n // max(1, chunks)))  # images a piece, rounded up
        for lo in range(0, max(n, 1), size):
            hi = min(n, lo + size)
            piece = warp(x[lo:hi].float().div_(255.0), m[lo:hi], spec.size)
            for op, mag, sign in zip(ops, mags, signs, strict=True):
                piece = apply_color_ops(piece, op[lo:hi], mag[lo:hi], sign[lo:hi])
            piece = normalize(piece)
            if lo == 0:
                out = piece if hi == n else piece.new_empty((n, *piece.shape[1:]))
            if hi < n or lo > 0:
                out[lo:hi] = piece
    if kind in ("none", "flip"):
        out = normalize(out)
    if spec.mixup_alpha > 0 or spec.cutmix_alpha > 0:
        return mix(out, y, spec, gen, np_rng)
    return out, y
