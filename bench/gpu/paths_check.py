"""GPU code paths of the trainer that no CPU test reaches, each a real `train()` call on
Flowers-102 in this one process (as in a warm worker):

  fp16     precision fp16 (autocast + GradScaler) for 2 epochs: finite training losses that
           fall
  oom      a real CUDA out-of-memory: the caching allocator is capped with
           torch.cuda.set_per_process_memory_fraction (the card has 141 GB and the train split
           1020 images, so no batch of it fills the whole card), then a ResNet-50 batch larger
           than the cap. The trial must end with stop_reason out_of_memory and a message, the
           memory must be released, and a small trial must then run under the same cap
  compile  compile reuse in a warm worker: two 1-epoch trials with the same (arch, size,
           batch) share a WarmCache; the second's first epoch should not compile again
  chunks   augment.train_batch on the GPU, whole batch against `chunks` pieces (what a
           micro-batched step does): the same images and targets, and the peak memory of each
           (a batch of 512 uint8 images at 144 px cropped to 128 px, trivial and randaugment
           with MixUp and CutMix)

The JSON is rewritten after each check, so a check cut off by a timeout leaves the others.
Exit status 1 when a check fails. `--device cpu` rehearses the plumbing (fp16 falls back to
fp32 there, and the oom check is skipped).

Example (on a GPU machine):
    python bench/gpu/paths_check.py --data-dir /tmp/benchdata --workdir /tmp/w --json paths.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common

from common import default_data_dir, load_study_config, warm_cache

OOM_CAP_GIB = 3.0  # allocator cap of the oom check
PARAMS: dict[str, Any] = {
    "arch": "resnet18",
    "image_size": 96,
    "batch_size": 64,
    "lr": 0.2,
    "weight_decay": 5e-4,
    "loss": "ce",
    "augment": "crop_flip",
    "augment_strength": 0.5,
    "mixup_alpha": 0.0,
    "cutmix_alpha": 0.0,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data-dir", default=default_data_dir())
    p.add_argument("--workdir", default="/tmp/paths-check", help="data cache and checkpoints")
    p.add_argument(
        "--checks", nargs="+", default=["fp16", "oom", "compile", "chunks"], choices=CHECKS
    )
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a rehearsal")
    p.add_argument("--json", dest="json_path", default=None, help="write results here")
    return p.parse_args(argv)


def run_trial(args: argparse.Namespace, workdir: Path, sets: list[str], params: dict[str, Any],
              warm: Any = None) -> tuple[Any, float]:  # fmt: skip
    from hpsearch.trainer.trial import train
    from hpsearch.trainer.types import TrainOptions

    cfg = load_study_config(
        "flowers102",
        ["trainer.evaluate_test=false", "trainer.eval_every=1", "enqueue_trials=[]", *sets],
        args.data_dir,
    )
    warm_cache(cfg, workdir)
    t0 = time.perf_counter()
    options = TrainOptions(device=args.device, workdir=workdir, warm=warm)
    result = train(cfg, params, options=options)
    return result, time.perf_counter() - t0


def check_fp16(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    result, seconds = run_trial(
        args, workdir, ["trainer.precision=fp16", "budget.max_epochs=2"], PARAMS
    )
    losses = [r.train_loss for r in result.history]
    ok = (
        result.stop_reason == "finished"
        and len(losses) == 2
        and all(math.isfinite(x) for x in losses)
        and losses[1] < losses[0]  # the scaled fp16 gradients train
    )
    return {
        "ok": ok,
        "stop_reason": result.stop_reason,
        "train_loss": losses,
        "train_acc": [r.train_acc for r in result.history],
        "val_acc": [r.val_acc for r in result.history],
        "images_per_second": [r.images_per_second for r in result.history],
        "seconds": seconds,
        "message": result.message,
    }


def check_oom(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch

    if args.device == "cpu":
        return {"ok": True, "skipped": "needs CUDA"}
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(OOM_CAP_GIB * 2**30 / total, 0)
    out: dict[str, Any] = {"cap_gib": OOM_CAP_GIB, "card_gib": total / 2**30}
    try:
        big = {**PARAMS, "arch": "resnet50", "image_size": 128, "batch_size": 512}
        result, seconds = run_trial(args, workdir, ["budget.max_epochs=1"], big)
        out["big"] = {
            "stop_reason": result.stop_reason,
            "message": result.message,
            "seconds": seconds,
            "allocated_after_gib": torch.cuda.memory_allocated() / 2**30,
            "reserved_after_gib": torch.cuda.memory_reserved() / 2**30,
        }
        # The small trial's own peak, not the failed one's (which pressed the cap).
        torch.cuda.reset_peak_memory_stats(0)
        small, seconds = run_trial(args, workdir, ["budget.max_epochs=1"], PARAMS)
        out["small_after"] = {
            "stop_reason": small.stop_reason,
            "seconds": seconds,
            "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    out["ok"] = (
        out["big"]["stop_reason"] == "out_of_memory"
        and "out of memory" in out["big"]["message"]
        and out["big"]["allocated_after_gib"] < 1.0  # the data cache stays, the batch does not
        and out["small_after"]["stop_reason"] == "finished"
    )
    return out


def check_compile(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from hpsearch.trainer.types import WarmCache

    warm = WarmCache()
    sets = ["trainer.compile=true", "budget.max_epochs=1"]
    params = {**PARAMS, "image_size": 112, "batch_size": 128}
    out: dict[str, Any] = {}
    for label in ("first", "second"):
        result, seconds = run_trial(args, workdir, sets, params, warm=warm)
        out[label] = {
            "stop_reason": result.stop_reason,
            "seconds": seconds,
            "setup_seconds": result.setup_seconds,
            "epoch_seconds": result.history[0].epoch_seconds if result.history else None,
            "images_per_second": result.history[0].images_per_second if result.history else None,
        }
    first, second = out["first"]["epoch_seconds"], out["second"]["epoch_seconds"]
    out["models_cached"] = len(warm.models)
    out["ok"] = (
        out["first"]["stop_reason"] == out["second"]["stop_reason"] == "finished"
        and out["models_cached"] == 1
        and first is not None
        and second is not None
        and second < first / 2  # compiling dominates the first trial's first epoch
    )
    return out


def check_chunks(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import numpy as np
    import torch
    from hpsearch.trainer import augment

    dev = torch.device(args.device)
    n, cache, size, chunks = 512, 144, 128, 8
    x = torch.randint(0, 256, (n, 3, cache, cache), dtype=torch.uint8, device=dev)
    y = torch.randint(0, 102, (n,), device=dev)
    out: dict[str, Any] = {"batch": n, "cache_px": cache, "px": size, "chunks": chunks}
    ok = True
    for kind in ("trivial", "randaugment"):
        spec = augment.AugmentSpec(
            kind, 0.8, size=size, num_classes=102, mixup_alpha=0.2, cutmix_alpha=1.0
        )
        row: dict[str, Any] = {}
        results = []
        for pieces in (1, chunks):
            if dev.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            gen = torch.Generator(device=dev).manual_seed(1)
            images, target = augment.train_batch(
                x, y, spec, gen, np.random.default_rng(1), chunks=pieces
            )
            if dev.type == "cuda":
                torch.cuda.synchronize()
                row[f"peak_extra_mib_chunks_{pieces}"] = (
                    torch.cuda.max_memory_allocated(dev) - base
                ) / 2**20
            results.append((images, target))
        (a, ta), (b, tb) = results
        row["max_abs_diff"] = float((a - b).abs().max())
        row["target_max_abs_diff"] = float((ta.float() - tb.float()).abs().max())
        row["equal"] = bool(torch.equal(a, b) and torch.equal(ta, tb))
        ok = ok and row["max_abs_diff"] <= 1e-5 and row["target_max_abs_diff"] <= 1e-6
        if dev.type == "cuda":  # pieces of an eighth should need well under the whole's copies
            ok = ok and row["peak_extra_mib_chunks_8"] < row["peak_extra_mib_chunks_1"]
        out[kind] = row
    out["ok"] = ok
    return out


CHECKS = {
    "fp16": check_fp16,
    "oom": check_oom,
    "compile": check_compile,
    "chunks": check_chunks,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        print("error: no CUDA device visible", file=sys.stderr)
        return 2
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu"
    results: dict[str, Any] = {"device": device_name, "torch": torch.__version__}
    failed = False
    for name in args.checks:
        t0 = time.perf_counter()
        try:
            results[name] = CHECKS[name](args, workdir)
        except Exception as exc:  # a check that crashes is a failed check; go on to the next
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        results[name]["check_seconds"] = time.perf_counter() - t0
        failed = failed or not results[name]["ok"]
        print(f"{name}: {json.dumps(results[name], default=str)}", flush=True)
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(results, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
