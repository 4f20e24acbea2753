"""Trial and study artifacts: learning curves, confusion matrices, per-class accuracy, Optuna
study plots (HTML + PNG) and the trials CSV. The ONNX export is in `onnx_export`.

Plots use matplotlib's Agg backend (no display needed). Heavy imports (optuna, plotly)
happen inside the functions that need them.
"""

from __future__ import annotations

import csv
import io
import math
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

if "matplotlib.pyplot" not in sys.modules:  # do not switch a backend someone already uses
    matplotlib.use("Agg")

from hpsearch.tracking import logger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

if TYPE_CHECKING:
    import optuna

CURVE_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("train_loss", "val_loss")),
    ("accuracy", ("train_acc", "val_acc")),
    ("learning rate", ("lr",)),
)


def _quiet_missing_glyphs() -> None:
    """A class name in a script DejaVu Sans lacks (CJK, emoji) draws as a box, which the
    per-class CSV spells out; matplotlib warned in two lines per missing glyph and plot.
    A filter of the process, put first again before each plot: not catch_warnings, which
    is not thread-safe (plots are drawn off the training thread)."""
    warnings.filterwarnings("ignore", r"Glyph \d+ .*missing from font", UserWarning)


def _save(fig: Figure, path: Path, dpi: int = 110) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    # No bbox_inches="tight": the figures are laid out already, and it would draw each
    # figure twice.
    fig.savefig(path, dpi=dpi)
    return path


def _fixed_margins(
    fig: Figure, left: float, right: float, bottom: float, top: float, wspace: float = 0.0
) -> None:
    """Lay the subplots out with margins in inches. `tight_layout` draws the whole figure
    once more to measure its labels: half of a learning curve's CPU (0.39 s against 0.19 s),
    on the cores that feed training. For figures whose labels have a known size."""
    w, h = fig.get_size_inches()
    cols = max(1, len(fig.axes))
    axes_w = (w - left - right - wspace * (cols - 1)) / cols
    fig.subplots_adjust(
        left=left / w, right=1 - right / w, bottom=bottom / h, top=1 - top / h,
        wspace=wspace / axes_w,
    )  # fmt: skip


def _number(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


# --------------------------------------------------------------------------- trial artifacts


def learning_curve_png(history: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Loss / accuracy / learning-rate panels from per-epoch dicts (keys as logged:
    ``train_loss``, ``val_loss``, ``train_acc``, ``val_acc``, ``lr``; x = ``epoch`` when present,
    else the position). Panels without data are left out; non-finite values are gaps."""
    _quiet_missing_glyphs()
    xs = [
        _number(row.get("epoch")) if row.get("epoch") is not None else float(i)
        for i, row in enumerate(history)
    ]
    panels = [
        (name, [k for k in keys if any(_number(r.get(k)) is not None for r in history)])
        for name, keys in CURVE_PANELS
    ]
    panels = [(name, keys) for name, keys in panels if keys]
    fig = Figure(figsize=(4.2 * max(1, len(panels)), 3.4))
    if not panels:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, "no epochs logged", ha="center", va="center")
        ax.set_axis_off()
    for i, (name, keys) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for key in keys:
            pts = [(x, _number(r.get(key))) for x, r in zip(xs, history, strict=True)]
            ax.plot(
                [x if x is not None else math.nan for x, _ in pts],
                [y if y is not None else math.nan for _, y in pts],
                marker="o",
                markersize=3,
                label=key,
            )
        ax.set_xlabel("epoch")
        ax.set_ylabel(name)
        if name == "learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-1, 3))  # short labels
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    # inches: room for 5-character tick labels, the axis label and the sci-notation offset
    _fixed_margins(fig, left=0.8, right=0.15, bottom=0.5, top=0.5 if title else 0.3, wspace=0.9)
    return _save(fig, path)


def trial_artifacts(
    history: Sequence[Mapping[str, Any]],
    confusion: Sequence[Sequence[float]],
    class_names: Sequence[str],
    number: int | str,
    folder: Path,
) -> list[Path]:
    """A finished trial's files in `folder`: the learning curve (when epochs were logged),
    and the confusion matrix with per-class accuracy (when there is one). `number`: the
    trial's, or a run's title (`hpsearch train`'s)."""
    out: list[Path] = []
    title = f"trial {number}" if isinstance(number, int) else number
    if history:
        out.append(learning_curve_png(history, folder / "learning_curve.png", title))
    if confusion:
        out.append(confusion_matrix_png(confusion, class_names, folder / "confusion_matrix.png"))
        out.append(
            per_class_accuracy_csv(confusion, class_names, folder / "per_class_accuracy.csv")
        )
    return out


def _check_matrix(cm: Sequence[Sequence[float]], class_names: Sequence[str]) -> int:
    n = len(class_names)
    if len(cm) != n or any(len(row) != n for row in cm):
        raise ValueError(
            f"confusion matrix must be {n}x{n} for {n} class names, got "
            f"{len(cm)}x{len(cm[0]) if cm else 0}"
        )
    return n


def per_class_accuracy(
    cm: Sequence[Sequence[float]], class_names: Sequence[str]
) -> list[tuple[str, int, int, float]]:
    """(class, support, correct, accuracy) per class; rows = true class, columns = predicted.
    Accuracy of a class with no samples is NaN."""
    _check_matrix(cm, class_names)
    rows: list[tuple[str, int, int, float]] = []
    for i, name in enumerate(class_names):
        support = int(sum(cm[i]))
        correct = int(cm[i][i])
        rows.append((name, support, correct, correct / support if support else math.nan))
    return rows


def per_class_accuracy_csv(
    cm: Sequence[Sequence[float]], class_names: Sequence[str], path: Path
) -> Path:
    """CSV with columns ``class,support,correct,accuracy`` (accuracy with 6 decimals)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["class", "support", "correct", "accuracy"])
    for name, support, correct, acc in per_class_accuracy(cm, class_names):
        writer.writerow([name, support, correct, "" if math.isnan(acc) else f"{acc:.6f}"])
    path.write_text(buf.getvalue(), encoding="utf-8")
    return path


def confusion_matrix_png(
    cm: Sequence[Sequence[float]],
    class_names: Sequence[str],
    path: Path,
    *,
    normalize: bool = True,
    title: str = "",
) -> Path:
    """Heat map of the confusion matrix (rows = true, columns = predicted), row-normalised by
    default; cell values are written for up to 20 classes, tick labels for up to 60."""
    _quiet_missing_glyphs()
    n = _check_matrix(cm, class_names)
    values = [[float(v) for v in row] for row in cm]
    if normalize:
        values = [[v / s if (s := sum(row)) else 0.0 for v in row] for row in values]
    # inches: room for the tick labels up to 60 classes; past that there are none, and a
    # larger canvas only costs rendering time (a second of CPU per trial at 102 classes)
    size = min(22.0, max(4.5, 0.28 * n + 2.5)) if n <= 60 else 9.0
    fig = Figure(figsize=(size, size * 0.9))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(values, cmap="Blues", vmin=0.0, vmax=1.0 if normalize else None)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if n <= 60:
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        fs = 8 if n <= 20 else 5
        ax.set_xticklabels(class_names, rotation=90, fontsize=fs)
        ax.set_yticklabels(class_names, fontsize=fs)
    if n <= 20:
        top = max((max(r) for r in values), default=0.0) or 1.0
        for i in range(n):
            for j in range(n):
                v = values[i][j]
                text = f"{v:.2f}" if normalize else f"{int(v)}"
                color = "white" if v > 0.6 * top else "black"
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color=color)
    ax.set_title(title or ("confusion matrix (row-normalised)" if normalize else "confusion"))
    if n <= 60:
        fig.tight_layout()  # class names of any length as tick labels
    else:  # tick labels of at most 3 digits; the colour bar sits beside the axes
        _fixed_margins(fig, left=0.6, right=0.5, bottom=0.55, top=0.4)
    return _save(fig, path)


# --------------------------------------------------------------------------- study level

STUDY_PLOTS = ("optimization_history", "param_importances", "parallel_coordinate")
_MIN_COMPLETE = {"optimization_history": 1, "param_importances": 2, "parallel_coordinate": 2}
# What one study plot may raise, caught per plot so the others are still written: Optuna's
# and the plotting libraries' errors, and OSError from write_html/savefig (a full disk, a
# file that cannot be written).
_PLOT_ERRORS = (
    ValueError, RuntimeError, ImportError, TypeError, ZeroDivisionError, KeyError, OSError,
)  # fmt: skip


def _completed(study: optuna.Study) -> int:
    import optuna

    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def study_plots(
    study: optuna.Study,
    out_dir: Path,
    *,
    html: bool = True,
    png: bool = True,
    plotlyjs: bool | str = True,
) -> list[Path]:
    """Write ``<plot>.html`` (plotly; ``plotlyjs=True`` embeds plotly.js so files open offline,
    ``"cdn"`` keeps them small) and ``<plot>.png`` (matplotlib) for the optimization history,
    parameter importances and parallel coordinates. Plots that need more completed trials than
    the study has (history: 1, the others: 2) are skipped, as are plots that fail (logged) and
    HTML when plotly is not installed. Multi-objective studies are plotted on objective 0.
    Returns the files written."""
    import optuna

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_complete = _completed(study)
    target: Callable[[optuna.trial.FrozenTrial], float] | None = None
    target_name = "Objective Value"
    if len(study.directions) > 1:

        def first_value(t: optuna.trial.FrozenTrial) -> float:
            return float(t.values[0])

        target = first_value
        # The study's name of its first metric (create_or_load names them), else Optuna's.
        names = study.metric_names
        target_name = names[0] if names else "objective 0"
    kwargs: dict[str, Any] = {"target": target, "target_name": target_name} if target else {}
    written: list[Path] = []
    plotly_ok = True
    if html:
        try:
            import plotly  # noqa: F401
        except ImportError:
            plotly_ok = False
            logger.warning("study plots: plotly is not installed, HTML plots skipped")
    for name in STUDY_PLOTS:
        if n_complete < _MIN_COMPLETE[name]:
            logger.info(
                "study plots: %s skipped (%d completed trials, needs %d)",
                name,
                n_complete,
                _MIN_COMPLETE[name],
            )
            continue
        if html and plotly_ok:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    fig = getattr(optuna.visualization, f"plot_{name}")(study, **kwargs)
                p = out_dir / f"{name}.html"
                fig.write_html(str(p), include_plotlyjs=plotlyjs)
                written.append(p)
            except _PLOT_ERRORS as exc:
                logger.warning("study plots: %s.html failed: %s", name, exc)
                _discard(out_dir / f"{name}.html")  # a half-written file is not logged
        if png:
            p = out_dir / f"{name}.png"
            if _matplotlib_plot(study, name, p, kwargs):
                written.append(p)
    return written


def _matplotlib_plot(study: optuna.Study, name: str, path: Path, kwargs: dict[str, Any]) -> bool:
    _quiet_missing_glyphs()
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ax = getattr(ovm, f"plot_{name}")(study, **kwargs)
        first = ax.flat[0] if hasattr(ax, "flat") else ax
        fig = first.figure
        fig.set_size_inches(max(fig.get_size_inches()[0], 8.0), max(fig.get_size_inches()[1], 5.0))
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        return True
    except _PLOT_ERRORS as exc:
        logger.warning("study plots: %s.png failed: %s", name, exc)
        plt.close("all")
        _discard(path)  # a half-written file is not logged
        return False


def _discard(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:  # a folder in its place, say: nothing was written there
        logger.debug("study plots: %s left: %s", path, exc)


def trials_csv(study: optuna.Study, path: Path) -> Path:
    """``study.trials_dataframe()`` (params, values, states, durations, user attrs such as
    ``mlflow_run_id``) as CSV."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df = study.trials_dataframe()
    df.to_csv(path, index=False)
    return path


__all__ = [
    "STUDY_PLOTS",
    "confusion_matrix_png",
    "learning_curve_png",
    "per_class_accuracy",
    "per_class_accuracy_csv",
    "study_plots",
    "trials_csv",
]
