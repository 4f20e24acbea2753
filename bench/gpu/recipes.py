"""Fixed configurations of a study trained side by side on one GPU, each in its own process
(as packed workers train), then each one's best model evaluated on val and test with every
eval variant: the trial's size or the stored one (`trainer.eval_scale`), with or without
the mirror (`trainer.eval_flip`).

What it answers: how far one configuration of the flowers102 study gets with 150, 300 or
600 epochs, a larger batch, the stored 144 px, CutMix or ResNet-34, and what each eval variant adds.
The study's 200 s search can only find what its configurations reach; these figures set
its epoch budget, batch sizes and eval defaults. Not a search: no Optuna, no pruning.

Every recipe starts from BASE (the best trial of the second H200 lease's study, 59.1% val)
and changes one thing. Each child stops at --trial-timeout s (the trainer's own time limit,
which keeps the best model), so a recipe that cannot finish says so ("time_limit").

Example (on the GPU machine, from the repo root; bench/gpu/run.sh's `recipes` step):
    python bench/gpu/recipes.py --data-dir /tmp/benchdata --workdir /tmp/rw --json recipes.json
CPU rehearsal (tiny):
    python bench/gpu/recipes.py --device cpu --epochs-scale 0.01 --only e150 e300 \\
        --set dataset.cache_size=36 --size 32 --workdir /tmp/rw --json /tmp/recipes.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (
    BenchError,
    GpuWatch,
    default_data_dir,
    environment,
    load_study_config,
    resolve_device,
    share_cache,
    warm_cache,
)
from hpsearch.errors import HpsearchError

BASE: dict[str, Any] = {
    "arch": "resnet18",
    "image_size": 128,
    "batch_size": 128,
    "lr": 0.1,  # at trainer.base_batch_size (256), scaled linearly to the batch
    "weight_decay": 2.7e-3,
    "loss": "label_smoothing",
    "label_smoothing": 0.08,
    "augment": "trivial",
    "augment_strength": 0.9,
    "mixup_alpha": 0.2,
    "cutmix_alpha": 0.0,
}
# name, epochs, changes to BASE
RECIPES: list[tuple[str, int, dict[str, Any]]] = [
    ("e150", 150, {}),
    ("e300", 300, {}),
    ("e300-b256", 300, {"batch_size": 256}),
    ("e600-b256", 600, {"batch_size": 256}),
    ("e300-144px", 300, {"image_size": 144}),
    ("e300-cutmix", 300, {"cutmix_alpha": 1.0}),
    ("e300-r34", 300, {"arch": "resnet34"}),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--study", default="flowers102")
    p.add_argument("--data-dir", default=default_data_dir())
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hpsearch-recipes"))
    p.add_argument("--device", default="auto")
    p.add_argument("--set", dest="sets", action="append", default=[], help="study override")
    p.add_argument("--only", nargs="+", default=None, help="recipe names to run")
    p.add_argument("--epochs-scale", type=float, default=1.0, help="x each recipe's epochs")
    p.add_argument("--size", type=int, default=None, help="px for every recipe (rehearsal)")
    p.add_argument("--eval-every", type=int, default=10, help="epochs between validations")
    p.add_argument("--trial-timeout", type=float, default=230.0, help="s each recipe may train")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [r[0] for r in RECIPES]
    for name in args.only or []:
        if name not in names:
            p.error(f"--only: {name}: not a recipe ({', '.join(names)})")
    if args.epochs_scale <= 0:
        p.error(f"--epochs-scale: {args.epochs_scale}: must be > 0")
    if args.only:
        args.only = list(dict.fromkeys(args.only))  # one child (and folder) per recipe
    if args.size is not None:  # the study's checks (cache_size, archs) then see this size
        # (the children get --size, not this: they add it again)
        args.load_sets = [
            "enqueue_trials=[]",  # each recipe is one fixed configuration
            *args.sets,
            f"search_space.image_size={{type: categorical, choices: [{args.size}]}}",
        ]
    else:
        args.load_sets = ["enqueue_trials=[]", *args.sets]
    return args


def recipe(name: str, args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    for n, epochs, change in RECIPES:
        if n == name:
            params = {**BASE, **change}
            if args.size is not None:
                params["image_size"] = args.size
            return max(1, round(epochs * args.epochs_scale)), params
    raise BenchError(f"{name}: not a recipe")


def child(args: argparse.Namespace, device: str) -> int:
    """Train one recipe, then evaluate its best model with each eval variant."""
    from hpsearch.trainer import TrainOptions, load_trained_model, train
    from hpsearch.trainer.trial import cache_size, evaluate_model

    name = args.child
    epochs, params = recipe(name, args)
    sets = [
        *args.load_sets,
        f"budget.max_epochs={epochs}",
        f"budget.trial_timeout_s={args.trial_timeout}",
        f"trainer.eval_every={args.eval_every}",
        "trainer.evaluate_test=false",  # every variant's test below
        "trainer.eval_scale=1.0",
        "trainer.eval_flip=false",
    ]
    cfg = load_study_config(args.study, sets, args.data_dir)
    work = args.workdir / name
    for old in work.glob("run*.pt*"):  # an earlier run's: it would resume, not train
        old.unlink()
    curve: list[tuple[int, float, float]] = []
    t0 = time.perf_counter()

    def on_epoch(r: Any) -> None:
        if r.val_acc is not None:
            curve.append((r.epoch, r.val_acc, round(time.perf_counter() - t0, 2)))

    opts = TrainOptions(device=device, workdir=work, checkpoint_path=work / "run.pt",
                        on_epoch=on_epoch)  # fmt: skip
    result = train(cfg, params, lambda epoch, value: False, opts)
    wall = time.perf_counter() - t0
    hp = cfg.resolve_params(params)
    stored = cache_size(cfg, hp)  # px this trial's cache holds
    out: dict[str, Any] = {
        "name": name,
        "epochs": epochs,
        "params": params,
        "epochs_run": result.epochs_run,
        "stop_reason": str(result.stop_reason),
        "message": result.message,
        "train_wall_s": round(wall, 1),
        "best_val_acc": result.best_val_acc,
        # training images/s, mean over epochs (each epoch's own figure, eval excluded)
        "train_images_per_s": round(
            sum(r.images_per_second for r in result.history) / max(1, len(result.history)), 1
        ),
        "curve": curve,
        "variants": {},
    }
    if result.best_model_path is not None:
        size = cfg.trial_sizes(hp)[0]
        model = load_trained_model(cfg, params, result.best_model_path, device=device)
        for scale_name, scale in (("own", 1.0), ("stored", stored / size)):
            for flip in (False, True):
                if scale_name == "stored" and stored == size and flip is False:
                    continue
                v = cfg.model_copy(
                    update={
                        "trainer": cfg.trainer.model_copy(
                            update={"eval_scale": scale, "eval_flip": flip}
                        )
                    }
                )
                key = f"{scale_name}{'+flip' if flip else ''}"
                out["variants"][key] = {
                    split: evaluate_model(v, params, model, split, work, device)[0]
                    for split in ("val", "test")
                }
    (args.workdir / f"{name}.json").write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
        if args.child is not None:
            return child(args, device)
        cfg = load_study_config(args.study, args.load_sets, args.data_dir)
    except (BenchError, HpsearchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = args.only or [r[0] for r in RECIPES]
    shared = args.workdir / "shared"
    t_cache = warm_cache(cfg, shared)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}
    t0 = time.perf_counter()
    with GpuWatch(device, os.environ.get("BENCH_GPU")) as watch:
        for name in names:
            share_cache(shared, args.workdir / name)
            logs[name] = args.workdir / f"{name}.log"
            cmd = [sys.executable, __file__, "--child", name, "--study", args.study,
                   "--data-dir", args.data_dir, "--workdir", str(args.workdir),
                   "--device", device, "--epochs-scale", str(args.epochs_scale),
                   "--eval-every", str(args.eval_every),
                   "--trial-timeout", str(args.trial_timeout)]  # fmt: skip
            cmd += [f"--set={s}" for s in args.sets]
            if args.size is not None:
                cmd += ["--size", str(args.size)]
            with open(logs[name], "wb") as fh:
                procs[name] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        codes = {name: p.wait() for name, p in procs.items()}
    wall = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    for name in names:
        f = args.workdir / f"{name}.json"
        if codes[name] == 0 and f.is_file():
            rows.append(json.loads(f.read_text()))
        else:
            tail = logs[name].read_text(errors="replace").strip().splitlines()[-3:]
            rows.append({"name": name, "failed": codes[name], "log_tail": tail})
    variants = ["own", "own+flip", "stored", "stored+flip"]
    print(f"{'recipe':<13} {'epochs':>9} {'stop':<11} {'train s':>7}  " + "  ".join(
        f"{v:>17}" for v in variants))  # fmt: skip
    heads = "  ".join(f"{'val / test':>17}" for _ in variants)
    print(f"{'':<13} {'':>9} {'':<11} {'':>7}  {heads}")
    for r in rows:
        if "failed" in r:
            print(f"{r['name']:<13} failed (exit {r['failed']}): {' | '.join(r['log_tail'])}")
            continue
        cells = []
        for v in variants:
            got = r["variants"].get(v)
            cells.append(f"{got['val']:>8.4f}/{got['test']:.4f}" if got else f"{'-':>17}")
        print(f"{r['name']:<13} {r['epochs_run']:>4}/{r['epochs']:<4} {r['stop_reason']:<11} "
              f"{r['train_wall_s']:>7.1f}  " + "  ".join(cells))  # fmt: skip
    util = watch.utilization
    print(f"{len(names)} processes side by side, {wall:.1f} s; cache {t_cache:.1f} s; "
          f"GPU utilization {util:.1f}%" if util is not None else
          f"{len(names)} processes side by side, {wall:.1f} s; cache {t_cache:.1f} s")  # fmt: skip
    if args.json is not None:
        doc = {
            "bench": "recipes",
            "environment": environment(device, os.environ.get("BENCH_GPU")),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "base": BASE,
            "wall_s": round(wall, 1),
            "cache_warm_s": round(t_cache, 1),
            "gpu": watch.summary,
            "recipes": rows,
        }
        args.json.write_text(json.dumps(doc, indent=1))
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
