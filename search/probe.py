"""Measure what `--workers auto` packs by: a few training steps of the study's trial shapes.

For each architecture the study may pick, at its largest image size, the probe trains a
few steps on synthetic data at the smallest and largest batch sizes of the search space
and records `max_memory_reserved` (what the caching allocator really holds) and step time.
For the first architecture it also times the median batch and a reference batch four times
the largest (`packing.reference_batch`): how busy one worker keeps the GPU is the median
batch's images/s over the fastest rate seen (`packing.busy_from_step_times`).
It runs in its own process (`python -m hpsearch.probe`), so the launcher never holds a
CUDA context, and prints one JSON object.

Example:
    CUDA_VISIBLE_DEVICES=0 python -m hpsearch.probe --study flowers102 --out probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpsearch.config import CategoricalParam, FloatParam, IntParam, StudyConfig, load_config
from hpsearch.packing import MemoryModel, busy_from_step_times, fit_memory, reference_batch
from hpsearch.trainer.types import RESOURCE_ERROR_MARKERS, is_resource_error

CONTEXT_FALLBACK = 512 << 20  # bytes: CUDA context + cuBLAS/cuDNN workspaces, when NVML can't tell


def choices(cfg: StudyConfig, name: str) -> list[Any]:
    """The values a study may give a hyperparameter: its choices, its range's ends, or
    the default when it is not searched."""
    spec = cfg.search_space.get(name)
    if isinstance(spec, CategoricalParam):
        return [c for c in spec.choices if c is not None]
    if isinstance(spec, IntParam | FloatParam):
        return [spec.low, spec.high]
    value = getattr(cfg.trainer.defaults, name)
    return [value] if value is not None else []


def probe_shapes(cfg: StudyConfig) -> tuple[list[str], int, int, int, int]:
    """(archs, largest image size px, smallest, median and largest micro-batch).

    The median, at which the probe judges how busy one trial keeps the GPU, is a batch
    trials use: the lower middle of the choices (of [32, 64] it is 32: the upper one was
    the largest, the most saturating, which packed small-batch studies too little), and
    of a searched range its geometric middle (log-scaled ranges sample around it)."""
    archs = [str(a) for a in choices(cfg, "arch")]
    sizes = image_sizes(cfg)
    batches = sorted(int(b) for b in choices(cfg, "batch_size"))
    spec = cfg.search_space.get("batch_size")
    if isinstance(spec, IntParam | FloatParam):
        batches.append(round(math.sqrt(max(spec.low, 1) * max(spec.high, 1))))
    cap = cfg.trainer.max_micro_batch
    micro = sorted({min(b, cap) if cap else b for b in batches})
    return archs, max(sizes), micro[0], micro[(len(micro) - 1) // 2], micro[-1]


def train_steps(
    cfg: StudyConfig, arch: str, batch: int, size: int, steps: int, device_name: str = "cuda"
) -> tuple[int, float]:
    """(peak reserved bytes, median step seconds) of `steps` training steps on synthetic
    data (peak 0 off CUDA)."""
    import torch
    from hpsearch.trainer.models import build_model
    from hpsearch.trainer.optim import make_optimizer
    from hpsearch.trainer.trial import _autocast, resolve_precision

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    hp = cfg.resolve_params({"arch": arch, "batch_size": batch})
    num_classes = cfg.dataset.num_classes or 1000
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    fmt = torch.channels_last if cfg.trainer.channels_last else torch.contiguous_format
    model = build_model(cfg, hp, num_classes).to(device, memory_format=fmt)
    opt = make_optimizer(model, hp, 0.01)
    amp = resolve_precision(cfg.trainer.precision, device)
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=fmt)
    y = torch.randint(0, num_classes, (batch,), device=device)
    times = []
    for _ in range(steps + 1):  # the first step pays cuDNN autotuning: not timed
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with _autocast(device, amp):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = int(torch.cuda.max_memory_reserved(device)) if cuda else 0
    del model, opt, x, y, loss
    if cuda:
        torch.cuda.empty_cache()
    return peak, statistics.median(times[1:])


def time_speed_batches(
    cfg: StudyConfig,
    model: MemoryModel,
    mid: int,
    ref: int,
    largest: int,
    steps: int,
    known: dict[int, float],
    device_name: str = "cuda",
) -> dict[int, float]:
    """Median step seconds at the worker's batch `mid` and at the reference batch `ref` (of
    `model`'s arch and size) that `known` does not hold yet. A reference that fails (out of
    memory, or a cuDNN/cuBLAS workspace error, which torch raises as RuntimeError) is halved
    and tried again while it stays above `largest`; the busy estimate then compares
    against the batches it has. Any other error is the probe's own and is raised."""
    import torch

    out: dict[int, float] = {}
    if mid not in known:
        out[mid] = train_steps(cfg, model.arch, mid, model.image_size, steps, device_name)[1]
    while ref > largest and ref not in known:
        try:
            out[ref] = train_steps(cfg, model.arch, ref, model.image_size, steps, device_name)[1]
            break
        except RuntimeError as exc:  # torch.OutOfMemoryError included
            if not is_resource_error(exc, PROBE_RESOURCE_MARKERS):
                raise
        if torch.cuda.is_available():  # after the except: the traceback no longer holds memory
            torch.cuda.empty_cache()
        ref //= 2
    return out


# The probe also halves its reference batch on cuDNN's INTERNAL_ERROR, which cuDNN reports
# for some large-batch convolutions it cannot fit; a trial does not take it for a lack of
# memory (a device-side assert can surface as it).
PROBE_RESOURCE_MARKERS = (*RESOURCE_ERROR_MARKERS, "CUDNN_STATUS_INTERNAL_ERROR")


def _context_bytes() -> int:
    """Device memory this process holds beyond what PyTorch's allocator reserved."""
    import os

    import torch

    try:
        import pynvml
        from hpsearch.tracking.gpu import nvml_handle, nvml_uuids, refs_by_uuid

        pynvml.nvmlInit()
        try:
            # NVML ignores CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER: a UUID there names the
            # probed GPU to both; an index counts in CUDA's order, so find it by the UUID
            # CUDA gives it.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            if visible.isdigit():
                uuids = nvml_uuids(pynvml)
                found = refs_by_uuid([str(torch.cuda.get_device_properties(0).uuid)], uuids)
                if not found:
                    return CONTEXT_FALLBACK
                handle = nvml_handle(pynvml, found[0])
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == os.getpid() and p.usedGpuMemory:
                    return max(0, int(p.usedGpuMemory) - int(torch.cuda.memory_reserved()))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or PIDs hidden (containers): use the typical figure
        pass
    return CONTEXT_FALLBACK


def free_bytes_of_visible_gpus() -> list[int | None]:
    """Free memory (bytes) of each GPU CUDA shows this process, in CUDA's order, read through
    NVML by the UUID CUDA gives it: NVML needs no CUDA context on a GPU (making one fails on a
    full GPU, or one another process holds in exclusive mode, and takes its own few hundred
    MiB off the figure). None for a GPU NVML cannot tell (under a MIG mask CUDA shows only the
    first instance), and for all without NVML: those are planned like the first GPU."""
    import torch

    n = torch.cuda.device_count()
    out: list[int | None] = [None] * n
    try:
        import pynvml
        from hpsearch.tracking.gpu import nvml_handle, nvml_uuids, refs_by_uuid

        pynvml.nvmlInit()
    except Exception:  # no NVML: the plan takes every GPU for the first
        return out
    try:
        cuda = [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]
        for i, ref in enumerate(refs_by_uuid(cuda, nvml_uuids(pynvml))):
            try:
                out[i] = int(pynvml.nvmlDeviceGetMemoryInfo(nvml_handle(pynvml, ref)).free)
            except Exception:  # this GPU's figure unknown: planned like the first
                continue
    except Exception:  # NVML answered nothing usable
        pass
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return out


def warm_data_bytes(
    items: Mapping[str, int],
    cache_size: int | None,
    image_sizes: Sequence[int],
    max_entries: int,
    fast: Callable[[int], bool] = lambda stored: True,
    eval_scale: float = 1.0,
) -> int:
    """Device bytes a warm worker may keep across trials (`trainer.trial.load_split` into its
    `WarmCache`): each split's uint8 RGB cache and int64 labels at a stored size (the study's
    `cache_size`, else 8/7 of the trial's image size), and a resized uint8 copy of each
    evaluated split (all but "train") at each image size times `eval_scale` (the eval size;
    a copy even at the stored size: torch.cat of its pieces). The cache holds at most
    `max_entries` of them, and a new one exists beside them until it is put there: the
    largest `max_entries + 1` count. Stored sizes on the streaming path (`fast` False) keep
    nothing on the device."""
    sizes = sorted(set(image_sizes))
    pairs = {(cache_size or round(r * 8 / 7), r) for r in sizes}  # (stored size, image size)
    evaluated = [n for split, n in items.items() if split != "train"]
    entries: list[int] = []
    for stored in sorted({st for st, _ in pairs}):
        if fast(stored):
            entries += [n * (3 * stored * stored + 8) for n in items.values()]
    for stored, r in sorted(pairs):
        if fast(stored):
            e = max(1, round(r * eval_scale))  # as StudyConfig.trial_sizes
            entries += [n * 3 * e * e for n in evaluated]
    return sum(sorted(entries, reverse=True)[: max_entries + 1])


def image_sizes(cfg: StudyConfig) -> list[int]:
    """Every image size a trial of the study may train at (each value of a range)."""
    spec = cfg.search_space.get("image_size")
    default = cfg.trainer.defaults.image_size or cfg.dataset.image_size
    if isinstance(spec, CategoricalParam):
        return sorted({int(c) for c in spec.choices})  # numbers: the config's rule
    if isinstance(spec, IntParam):
        return list(range(int(spec.low), int(spec.high) + 1, int(spec.step or 1)))
    if isinstance(spec, FloatParam):
        return list(range(math.ceil(spec.low), math.floor(spec.high) + 1))
    return [default]


def data_bytes(cfg: StudyConfig) -> int:
    """Device bytes of the decoded dataset a worker keeps on the GPU (`warm_data_bytes`),
    which no training step shows; 0 if unknown."""
    from hpsearch.trainer import data
    from hpsearch.trainer.types import WarmCache

    splits = ["train", "val"] + (["test"] if cfg.trainer.evaluate_test else [])
    try:
        sources = [src for s in splits if (src := data.get_source(cfg, s)) is not None]
    except Exception:  # no data here: the workers' own checks will say so
        return 0
    items = {src.split: len(src) for src in sources}
    return warm_data_bytes(
        items,
        cfg.dataset.cache_size,
        image_sizes(cfg),
        WarmCache().max_data_entries,
        lambda stored: data.use_fast_path(cfg, sources, stored),
        cfg.trainer.eval_scale,
    )


def probe_memory(
    cfg: StudyConfig,
    arch: str,
    size: int,
    small: int,
    large: int,
    steps: int,
    device_name: str = "cuda",
) -> tuple[MemoryModel, float, float]:
    """`arch`'s memory model at `size` px, from its peaks at the study's smallest and
    largest batch, and the median step seconds there. A study of one batch size is probed at
    half of it too: a line through the origin and one point would make the weights, optimizer
    state and workspaces per-image memory, and under-reserve the smaller images' trials."""
    low = small if large > small else max(1, small // 2)
    peak_low, t_low = train_steps(cfg, arch, low, size, steps, device_name)
    peak_large, t_large = (peak_low, t_low)  # batch 1: no smaller one to probe
    if large > low:
        peak_large, t_large = train_steps(cfg, arch, large, size, steps, device_name)
    context = _context_bytes() if device_name == "cuda" else 0
    if large > low:
        model = fit_memory(arch, size, (low, peak_low), (large, peak_large), context)
    else:  # a batch of 1: no smaller one to probe
        model = fit_memory(arch, size, (0, 0), (large, peak_large), context)
    return model, (t_low if low == small else t_large), t_large


def run_probe(cfg: StudyConfig, steps: int = 3) -> dict[str, Any]:
    """Probe the current CUDA device. Returns the measurements as plain JSON values."""
    import torch
    from hpsearch.errors import DeviceError

    if not torch.cuda.is_available():
        raise DeviceError("--workers auto: the probe needs a CUDA GPU; none is visible")
    torch.backends.cudnn.benchmark = True
    archs, size, small, mid, large = probe_shapes(cfg)
    total = int(torch.cuda.get_device_properties(0).total_memory)
    # Before any training step: every GPU of the launch's mask, in its order (other jobs'
    # memory and unlike sizes shrink what may be packed there).
    free = free_bytes_of_visible_gpus()
    models: list[MemoryModel] = []
    step_s: dict[int, float] = {}  # batch -> median step seconds, the first arch's
    for i, arch in enumerate(archs):
        try:
            model, t_small, t_large = probe_memory(cfg, arch, size, small, large, steps)
        except RuntimeError as exc:  # torch.OutOfMemoryError included
            if not is_resource_error(exc, PROBE_RESOURCE_MARKERS):
                raise
            # Packing needs the largest trial's memory; with none left to pack into, a fixed
            # --workers N still runs, and records such trials as out of memory.
            raise DeviceError(
                f"{arch} at batch {large}, {size} px, or less, ran out of GPU memory alone on "
                "the GPU (is another job using it?); give --workers N"
            ) from exc
        models.append(model)
        if i == 0:  # the first arch stands for the study's speed (its cheapest, as a rule)
            step_s = {small: t_small, large: t_large}
            ref = reference_batch(large, model, total)
            step_s |= time_speed_batches(cfg, model, mid, ref, large, steps, step_s)
    busy = busy_from_step_times(step_s, mid)
    worst = max(m.trial_bytes(large, size) for m in models)
    return {
        "device": torch.cuda.get_device_name(0),
        "total_bytes": total,
        "free_bytes": free,
        "image_size": size,
        "batches": [small, mid, large],
        "busy": busy,
        "step_seconds": {str(b): t for b, t in sorted(step_s.items())},
        "worst_trial_bytes": worst,
        "data_bytes": data_bytes(cfg),
        "models": [m.__dict__ for m in models],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--study", required=True, help="study name or file")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = p.parse_args(argv)
    from hpsearch.errors import HpsearchError

    try:
        # The launch's resolved file, which it checked (`lenient`: as its workers load it).
        result = run_probe(load_config(args.study, lenient=True), args.steps)
    except HpsearchError as exc:
        sys.stderr.write(f"probe: {exc}\n")
        return 1
    text = json.dumps(result)
    if args.out is not None:
        args.out.write_text(text)
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
