"""NVML sanity check of `hpsearch.tracking.gpu` on a real GPU: does the sampler that trials
log (and the input-bound rule uses) read what the GPU does?

  busy     4 s of bf16 matrix products in this process: device utilization should be high,
           memory and power non-zero, energy growing, the input-bound rule silent
  idle     4 s with a CUDA context but no work: utilization near 0, the rule fires
  process  whether NVML listed this PID (per-process utilization and memory), which it does
           not in containers without the host PID namespace
  uuid     CUDA_VISIBLE_DEVICES given as a `GPU-<uuid>` prefix resolves to the same device,
           and the UUID torch gives CUDA's device 0 is NVML's (how the sampler finds the
           trial's GPU under a CUDA_DEVICE_ORDER other than PCI_BUS_ID)

Example (on a GPU machine):
    python bench/gpu/nvml_check.py --json nvml.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=4.0, help="length of each phase")
    p.add_argument("--interval", type=float, default=0.2, help="sampling period, s")
    p.add_argument("--size", type=int, default=8192, help="matrix size of the busy phase")
    p.add_argument("--json", dest="json_path", default=None, help="write results here")
    return p.parse_args(argv)


def phase(args: argparse.Namespace, busy: bool) -> dict[str, Any]:
    import torch
    from hpsearch.tracking.gpu import GpuSampler

    sampler = GpuSampler(
        None,
        interval_s=args.interval,
        window_s=args.seconds / 2,
        warmup_s=0.5,
        threshold_pct=50.0,
        visible_devices="0",
    )
    if not sampler.start():
        return {"available": False}
    a = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    products = 0
    t0 = time.perf_counter()
    end = t0 + args.seconds
    while time.perf_counter() < end:
        if busy:
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
            products += 20
        else:
            time.sleep(0.05)
    seconds = time.perf_counter() - t0
    summary = sampler.stop()
    del a
    torch.cuda.empty_cache()
    out: dict[str, Any] = {"available": True, "samples": sampler.samples_taken, **summary}
    out["input_bound"] = sampler.input_bound
    if busy:
        out["tflops"] = 2 * args.size**3 * products / seconds / 1e12
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import pynvml
    import torch
    from hpsearch.tracking.gpu import (
        GpuSampler,
        nvml_uuids,
        refs_by_uuid,
        resolve_visible_devices,
        torch_cuda_uuids,
    )

    if not torch.cuda.is_available():
        print("error: no CUDA device visible", file=sys.stderr)
        return 2
    torch.cuda.init()
    pynvml.nvmlInit()
    all_uuids = nvml_uuids(pynvml)
    uuid = all_uuids[0]
    driver = pynvml.nvmlSystemGetDriverVersion()
    pynvml.nvmlShutdown()

    busy = phase(args, busy=True)
    idle = phase(args, busy=False)
    by_uuid = GpuSampler(None, visible_devices=uuid[:12])
    by_uuid.open()
    refs = by_uuid.device_refs
    by_uuid.stop()
    cuda_uuids = torch_cuda_uuids() or []
    # CUDA's device 0, found in NVML by its UUID, is the GPU the mask names in NVML's order
    # when CUDA counts in that order too (or there is one GPU to count).
    cuda0 = refs_by_uuid(cuda_uuids[:1], all_uuids)
    same_order = len(all_uuids) == 1 or os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    masked = resolve_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), all_uuids)[:1]

    util = "system/gpu_utilization_mean"
    checks = {
        "sampler_available": busy.get("available", False),
        "busy_utilization_high": busy.get(util, 0.0) >= 50.0,
        "busy_not_input_bound": not busy.get("input_bound", True),
        "busy_memory_seen": busy.get("system/gpu_memory_peak_mib", 0.0) > 0.0,
        "busy_energy_seen": busy.get("system/gpu_energy_j", 0.0) > 0.0,
        "idle_utilization_low": idle.get(util, 100.0) < 20.0,
        "idle_input_bound": bool(idle.get("input_bound", False)),
        "uuid_prefix_resolves": refs == [0],
        "cuda_uuid_is_nvmls": bool(cuda0) and (cuda0 == masked or not same_order),
    }
    info = {
        "cuda_uuid": cuda_uuids[0] if cuda_uuids else None,
        "process_utilization_seen": "system/gpu_process_utilization_mean" in busy,
        "process_memory_seen": "system/gpu_process_memory_peak_mib" in busy,
    }
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    for name, seen in info.items():
        print(f"info {name}: {seen}")
    peak = busy.get("system/gpu_memory_peak_mib", 0.0)
    print(
        f"busy: util {busy.get(util, float('nan')):.0f}% {busy.get('tflops', 0.0):.0f} TFLOP/s, "
        f"peak {peak:.0f} MiB, {busy.get('system/gpu_energy_j', 0.0):.0f} J; idle: util "
        f"{idle.get(util, float('nan')):.0f}%"
    )
    if args.json_path:
        out = {
            "bench": "nvml_check",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0),
            "driver": driver.decode() if isinstance(driver, bytes) else str(driver),
            "checks": checks,
            "info": info,
            "busy": busy,
            "idle": idle,
        }
        Path(args.json_path).write_text(json.dumps(out, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
