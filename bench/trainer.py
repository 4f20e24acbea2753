"""Training throughput of three input pipelines, same model and step:

  synthetic  random normalized tensors already on the device (the model's ceiling)
  fast       real Flowers-102 through the trainer's fast path: uint8 cache on the device,
             batched augmentation there (random-resized crop + flip)
  classic    torchvision Flowers102 + PIL transforms (RandomResizedCrop, flip, ToTensor,
             Normalize) in a DataLoader with worker processes

Example (CPU):
    python bench/trainer.py --arch resnet18 --resolution 64 --batch 64 --steps 20 \\
        --device cpu --json bench-trainer.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from common import BenchError, check_output_path, nonnegative_int, positive_int, run_main
from hpsearch.config import Hyperparams, validate_config
from hpsearch.trainer import augment, data
from hpsearch.trainer.losses import make_loss
from hpsearch.trainer.models import build_model
from hpsearch.trainer.optim import make_optimizer
from hpsearch.trainer.trial import _autocast, resolve_device, resolve_precision
from torch import Tensor
from torchvision import transforms as T

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--resolution", type=positive_int, default=64, help="train image size, px")
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps per pipeline")
    p.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed steps first")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    p.add_argument("--no-channels-last", action="store_true")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the model (warm-up pays compiling)"
    )
    p.add_argument(
        "--workers",
        type=nonnegative_int,
        default=min(4, os.cpu_count() or 1),
        help="DataLoader workers for the classic pipeline",
    )
    p.add_argument(
        "--data-dir",
        default=os.environ.get("HPSEARCH_DATA_DIR", str(REPO.parent / "shared" / "datasets")),
    )
    p.add_argument("--workdir", default=".hpsearch", help="the fast path's cache lives here")
    p.add_argument("--modes", default="synthetic,fast,classic")
    p.add_argument("--json", dest="json_path", default=None, help="write results here")
    return p.parse_args(argv)


def make_step(args: argparse.Namespace, device: torch.device) -> Callable[[Tensor, Tensor], Tensor]:
    """One SGD step of the trainer's model/optimizer/loss on a normalized float batch."""
    hp = Hyperparams(arch=args.arch, batch_size=args.batch, lr=0.01)
    cfg = validate_config({"name": "bench", "dataset": {"name": "synthetic"}})
    model = build_model(cfg, hp, 102)
    fmt = torch.contiguous_format if args.no_channels_last else torch.channels_last
    model = model.to(device, memory_format=fmt).train()
    opt = make_optimizer(model, hp, hp.lr)
    loss_fn = make_loss(hp)
    amp = resolve_precision(args.precision, device)
    fwd = torch.compile(model) if args.compile else model

    def step(x: Tensor, y: Tensor) -> Tensor:
        x = x.contiguous(memory_format=fmt)
        with _autocast(device, amp):
            logits = fwd(x)
        loss = loss_fn(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(
    batches: Iterator[tuple[Tensor, Tensor]],
    step: Callable[[Tensor, Tensor], Tensor],
    n: int,
    device: torch.device,
) -> list[tuple[int, float]]:
    """(images, seconds) of each of n steps, input pipeline included."""
    out = []
    for _ in range(n):
        sync(device)
        start = time.perf_counter()
        x, y = next(batches)
        step(x, y)
        sync(device)
        out.append((x.shape[0], time.perf_counter() - start))
    return out


def synthetic_batches(
    args: argparse.Namespace, device: torch.device
) -> Iterator[tuple[Tensor, Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)
    r = args.resolution
    x = torch.randn(args.batch, 3, r, r, device=device, generator=g)
    y = torch.randint(0, 102, (args.batch,), device=device, generator=g)
    while True:
        yield x, y


def fast_batches(
    args: argparse.Namespace, device: torch.device, info: dict[str, Any]
) -> Iterator[tuple[Tensor, Tensor]]:
    cfg = validate_config(
        {
            "name": "bench",
            "dataset": {"name": "flowers102", "root": args.data_dir, "image_size": args.resolution},
        }
    )
    src = data.get_source(cfg, "train")
    assert src is not None
    size = cfg.dataset.effective_cache_size
    t0 = time.perf_counter()
    dec = data.load_or_build_cache(src, size, Path(args.workdir))
    info["cache_seconds"] = time.perf_counter() - t0
    info["cache_built"] = dec.built
    check_batch(args.batch, len(dec.labels))
    images = torch.from_numpy(dec.images).permute(0, 3, 1, 2).to(device)
    labels = torch.from_numpy(dec.labels).to(device)
    spec = augment.AugmentSpec("crop_flip", 0.5, args.resolution, 102)
    gen = torch.Generator(device=device).manual_seed(0)
    np_rng = np.random.default_rng(0)
    while True:
        perm = torch.randperm(len(labels), generator=gen, device=device)
        for i in range(len(labels) // args.batch):
            idx = perm[i * args.batch : (i + 1) * args.batch]
            yield augment.train_batch(images[idx], labels[idx], spec, gen, np_rng)


def classic_batches(
    args: argparse.Namespace, device: torch.device
) -> Iterator[tuple[Tensor, Tensor]]:
    tf = T.Compose(
        [
            T.RandomResizedCrop(args.resolution, scale=(0.54, 1.0), antialias=True),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(augment.MEAN, augment.STD),
        ]
    )
    try:
        ds = torchvision.datasets.Flowers102(args.data_dir, split="train", transform=tf)
    except RuntimeError as exc:  # torchvision's "Dataset not found or corrupted"
        raise BenchError(f"--data-dir: {args.data_dir}: {exc}") from None
    check_batch(args.batch, len(ds))
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=args.batch,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=args.workers > 0,
    )
    while True:
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def check_batch(batch: int, n_train: int) -> None:
    """Both real pipelines take whole batches only (the trainer drops the rest): a batch
    larger than the training split would yield none, and the step loop would wait forever."""
    if batch > n_train:
        raise BenchError(
            f"--batch: {batch}: larger than the training split ({n_train} images); "
            f"give at most {n_train}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main("trainer.py", lambda: bench(args))


def bench(args: argparse.Namespace) -> int:
    check_output_path(args.json_path)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in ("synthetic", "fast", "classic")]:
        raise BenchError(f"--modes: {unknown[0]!r}: must be synthetic, fast or classic")
    device = resolve_device(args.device)
    torch.manual_seed(0)
    results: dict[str, dict[str, Any]] = {}

    def pipeline(mode: str, info: dict[str, Any]) -> Pipe:
        if mode == "synthetic":
            batches = synthetic_batches(args, device)
        elif mode == "fast":
            batches = fast_batches(args, device, info)
        else:
            batches = classic_batches(args, device)
        pipe = (batches, make_step(args, device))  # a fresh model per pipeline
        run_steps(*pipe, args.warmup, device)
        return pipe

    # synthetic and fast alternate step by step, so that load from other processes hits both
    # alike; their throughput uses the median step time, which ignores bursts of foreign load.
    # classic runs alone after them (its workers would prefetch during other steps), and its
    # throughput is images over the summed step times: its DataLoader hands batches over in
    # bursts (workers decode ahead), so most steps find a batch ready, and the median step is
    # the GPU's alone, several times the rate the loader sustains.
    in_process = [m for m in modes if m != "classic"]
    infos: dict[str, dict[str, Any]] = {m: {} for m in modes}
    pipes = {m: pipeline(m, infos[m]) for m in in_process}
    steps: dict[str, list[tuple[int, float]]] = {m: [] for m in modes}
    for _ in range(args.steps):
        for mode in in_process:
            steps[mode] += run_steps(*pipes[mode], 1, device)
    for mode in in_process:
        results[mode] = summarize(args, infos[mode], steps[mode], median=True)
    compare(results)
    write_json(args, device, results)  # a later pipeline cut short by a time limit keeps these
    if "classic" in modes:
        pipes["classic"] = pipeline("classic", infos["classic"])
        # The loader decodes ahead (each worker holds prefetch_factor=2 batches) during the
        # warm-up: drain those first, or the timed steps take them ready-made (with 16 workers
        # at batch 32 that is 32 batches, a whole Flowers-102 epoch) and overstate its rate.
        run_steps(*pipes["classic"], 2 * args.workers, device)
        steps["classic"] = run_steps(*pipes["classic"], args.steps, device)
        results["classic"] = summarize(args, infos["classic"], steps["classic"], median=False)
    results = {m: results[m] for m in modes}
    compare(results)

    print(
        f"{args.arch} {args.resolution}px batch {args.batch} on {device}"
        f"{' compiled' if args.compile else ''} "
        f"({torch.get_num_threads()} threads), {args.steps} timed steps"
    )
    print(
        f"{'pipeline':<10} {'images/s':>10} {'ms/step':>9} {'vs synthetic':>13} {'mean img/s':>11}"
    )
    for mode, r in results.items():
        over = r.get("overhead_vs_synthetic")
        rel = f"{100 * over:+.1f}%" if over is not None else "-"
        print(
            f"{mode:<10} {r['images_per_second']:>10.1f} {r['ms_per_step']:>9.1f} {rel:>13} "
            f"{r['mean_images_per_second']:>11.1f}"
        )
    if "fast" in results:
        f = results["fast"]
        print(
            f"fast-path cache: {'built' if f['cache_built'] else 'loaded'} in "
            f"{f['cache_seconds']:.1f}s (one time per dataset/size)"
        )
    write_json(args, device, results)
    return 0


Pipe = tuple[Iterator[tuple[Tensor, Tensor]], Callable[[Tensor, Tensor], Tensor]]


def compare(results: dict[str, dict[str, Any]]) -> None:
    """`overhead_vs_synthetic` of each pipeline: against synthetic's rate of the same kind
    (median step, or images over summed step time for classic), so that the mean's share of
    foreign load is not put on the DataLoader."""
    synthetic = results.get("synthetic")
    if synthetic is None:
        return
    for r in results.values():
        median = r["images_per_second_from"] == "median step"
        base = synthetic["images_per_second" if median else "mean_images_per_second"]
        r["overhead_vs_synthetic"] = base / r["images_per_second"] - 1


def summarize(
    args: argparse.Namespace,
    info: dict[str, Any],
    steps: list[tuple[int, float]],
    median: bool,
) -> dict[str, Any]:
    """A pipeline's figures: images/s from the median step (`median`) or from all images
    over all step time; ms/step likewise."""
    times = [t for _, t in steps]
    images = sum(n for n, _ in steps)
    mean_rate = images / sum(times)
    rate = args.batch / float(np.median(times)) if median else mean_rate
    return {
        **info,
        "images_per_second": rate,
        "images_per_second_from": "median step" if median else "images / summed step time",
        "ms_per_step": 1000 * args.batch / rate,
        "mean_images_per_second": mean_rate,
        "median_images_per_second": args.batch / float(np.median(times)),
        "step_seconds": times,
    }


def write_json(args: argparse.Namespace, device: torch.device, results: dict[str, Any]) -> None:
    if not args.json_path:
        return
    out = {
        "args": vars(args),
        "device": str(device),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "results": results,
    }
    Path(args.json_path).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
