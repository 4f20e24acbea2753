"""One line of key numbers from a bench JSON, for bench/gpu/run.sh's step summaries.

Example:
    python bench/gpu/summarize.py packing bench-packing.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _f(value: Any, spec: str = ".0f") -> str:
    return "n/a" if value is None else format(value, spec)


def trainer(d: dict[str, Any]) -> str:
    a = d["args"]
    parts = [f"{m} {_f(r['images_per_second'])}" for m, r in d["results"].items()]
    return f"{a['arch']} {a['resolution']}px b{a['batch']}: img/s " + ", ".join(parts)


def packing(d: dict[str, Any]) -> str:
    parts = []
    for r in d["results"]:
        label = r["workers_arg"] if r["workers_arg"] != "auto" else f"auto={r['workers']}"
        if "complete" not in r:  # its launch made no study
            parts.append(f"W={r['workers_arg']} error: {str(r.get('error'))[:300]}")
            continue
        parts.append(
            f"W={label} {_f(r['trials_per_hour'])} trials/h x{_f(r.get('speedup'), '.2f')} "
            f"{_f(r.get('images_per_second_steady'))} img/s "
            f"util {_f(r.get('gpu_utilization_mean'))}%"
        )
    return "; ".join(parts)


def _stopped(failed: int, interrupted: int | None) -> str:
    """Which of the failed trials the bench's stop interrupted (each re-queued)."""
    if not interrupted:
        return ""
    return (
        " (all interrupted by the stop)"
        if interrupted == failed
        else f" ({interrupted} interrupted by the stop)"
    )


def study(d: dict[str, Any]) -> str:
    r = d["result"]
    s = r["states"]
    b = r.get("budget_states") or s  # (a JSON of the version before: all trials)
    return (
        f"best {r['metric']} {_f(r['best_value'], '.4f')} test {_f(r['test_acc'], '.4f')} "
        f"at {_f(r['time_to_best_s'])}s of {_f(d['args']['timeout'])}s"
        + (
            f" (enqueued; best drawn {_f(r.get('best_drawn_value'), '.4f')})"
            if r.get("best_enqueued")
            else ""
        )
        + "; by the time-out "
        f"complete {b['complete']} pruned {b['pruned']}; failed {s['fail']}"
        f"{_stopped(s['fail'], r.get('interrupted'))}; "
        f"{_f(r['images_per_second_e2e'])} img/s; "
        f"util {_f(r['gpu_utilization_mean'])}% "
        f"({_f(r.get('gpu_utilization_working'))}% from the 1st trial to the time-out)"
    )


def nvml(d: dict[str, Any]) -> str:
    failed = [k for k, ok in d["checks"].items() if not ok]
    busy = d["busy"]
    return (
        f"{'all checks ok' if not failed else 'FAILED: ' + ', '.join(failed)}; busy util "
        f"{_f(busy.get('system/gpu_utilization_mean'))}%, per-process "
        f"{'seen' if d['info']['process_utilization_seen'] else 'not seen'}"
    )


def paths(d: dict[str, Any]) -> str:
    parts = []
    for name in ("fp16", "oom", "compile"):
        if name in d:
            r = d[name]
            parts.append(f"{name} {'ok' if r.get('ok') else 'FAILED ' + str(r.get('error', ''))}")
    if "compile" in d and "first" in d["compile"]:
        c = d["compile"]
        parts.append(
            f"compiled 1st epoch {_f(c['first']['epoch_seconds'], '.1f')}s, "
            f"reused {_f(c['second']['epoch_seconds'], '.1f')}s"
        )
    return "; ".join(parts) or "no checks ran"


def recipes(d: dict[str, Any]) -> str:
    parts = []
    for r in d["recipes"]:
        if "failed" in r:
            parts.append(f"{r['name']} FAILED")
            continue
        own = r["variants"].get("own", {})
        best = max(r["variants"].values(), key=lambda v: v["val"], default={})
        parts.append(
            f"{r['name']} {r['epochs_run']}ep val {_f(own.get('val'), '.3f')} "
            f"test {_f(own.get('test'), '.3f')} (best eval {_f(best.get('test'), '.3f')})"
        )
    return "; ".join(parts) or "no recipes ran"


KINDS = {
    "trainer": trainer,
    "packing": packing,
    "study": study,
    "nvml": nvml,
    "paths": paths,
    "recipes": recipes,
}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in KINDS:
        print(f"usage: summarize.py {{{','.join(KINDS)}}} FILE.json", file=sys.stderr)
        return 2
    path = Path(argv[1])
    try:
        data = json.loads(path.read_text())
        print(KINDS[argv[0]](data))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"no summary ({path}: {type(exc).__name__}: {exc})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
