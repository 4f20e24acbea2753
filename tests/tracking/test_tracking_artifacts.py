"""Artifacts: PNGs decode, CSVs are right, ONNX runs in onnxruntime and matches PyTorch, Optuna
study plots are written (in-memory Optuna is fine here: this is plotting, not storage)."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

import numpy as np
import optuna
import pytest
import torch
import torchvision
from hpsearch.errors import TrackingError
from hpsearch.tracking.artifacts import (
    confusion_matrix_png,
    learning_curve_png,
    per_class_accuracy,
    per_class_accuracy_csv,
    study_plots,
    trials_csv,
)
from hpsearch.tracking.onnx_export import export_onnx
from PIL import Image

optuna.logging.set_verbosity(optuna.logging.WARNING)


def assert_png(path: Path, min_size: int = 100) -> None:
    assert path.exists()
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.load()
        assert im.width >= min_size and im.height >= min_size


def test_learning_curve_png(tmp_path: Path) -> None:
    history = [
        {
            "epoch": e,
            "train_loss": 2.0 / (e + 1),
            "val_loss": 2.2 / (e + 1),
            "train_acc": 0.1 * e,
            "val_acc": 0.09 * e,
            "lr": 0.1 * (0.5**e),
        }
        for e in range(6)
    ]
    history[3]["val_loss"] = math.nan  # gaps are fine
    out = learning_curve_png(history, tmp_path / "curves" / "learning_curve.png", title="t3")
    assert_png(out)
    with Image.open(out) as im:
        assert im.width > im.height  # three panels side by side
    assert_png(learning_curve_png([], tmp_path / "empty.png"))
    assert_png(learning_curve_png([{"val_acc": 0.5}], tmp_path / "one.png"))


CM = [[5, 1, 0], [2, 3, 0], [0, 0, 0]]
NAMES = ["cat", "dog", "eel"]


def test_per_class_accuracy_and_csv(tmp_path: Path) -> None:
    rows = per_class_accuracy(CM, NAMES)
    assert rows[:2] == [("cat", 6, 5, 5 / 6), ("dog", 5, 3, 0.6)]
    assert rows[2][:3] == ("eel", 0, 0) and math.isnan(rows[2][3])
    out = per_class_accuracy_csv(CM, NAMES, tmp_path / "per_class_accuracy.csv")
    with open(out, newline="") as f:
        table = list(csv.DictReader(f))
    assert table == [
        {"class": "cat", "support": "6", "correct": "5", "accuracy": "0.833333"},
        {"class": "dog", "support": "5", "correct": "3", "accuracy": "0.600000"},
        {"class": "eel", "support": "0", "correct": "0", "accuracy": ""},
    ]


def test_confusion_matrix_png(tmp_path: Path) -> None:
    assert_png(confusion_matrix_png(CM, NAMES, tmp_path / "cm.png"))
    assert_png(confusion_matrix_png(CM, NAMES, tmp_path / "cm_raw.png", normalize=False))
    n = 102  # flowers102: no cell text, no tick labels
    big = [[10 if i == j else (1 if j == (i + 1) % n else 0) for j in range(n)] for i in range(n)]
    assert_png(confusion_matrix_png(big, [f"c{i}" for i in range(n)], tmp_path / "big.png"))
    with pytest.raises(ValueError, match="3x3"):
        confusion_matrix_png([[1, 2], [3, 4]], NAMES, tmp_path / "bad.png")


@pytest.mark.slow
def test_export_onnx_resnet18_matches_pytorch(tmp_path: Path) -> None:
    import onnxruntime as ort

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    model.train()  # export must not depend on (or change) the caller's mode
    x = torch.randn(2, 3, 32, 32)
    out = export_onnx(model, x, tmp_path / "model.onnx", verify_batch=4)
    assert out == tmp_path / "model.onnx" and out.stat().st_size > 1_000_000
    assert model.training
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["input"]
    xb = torch.randn(5, 3, 32, 32)  # dynamic batch
    got = sess.run(None, {"input": xb.numpy()})[0]
    with torch.no_grad():
        ref = model.eval()(xb).numpy()
    assert got.shape == (5, 10)
    assert np.abs(got - ref).max() < 1e-3


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_export_onnx_mismatch_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime as ort

    real = ort.InferenceSession

    class Skewed:
        def __init__(self, *a: object, **k: object) -> None:
            self.sess = real(*a, **k)

        def get_inputs(self) -> list[object]:
            return list(self.sess.get_inputs())

        def run(self, *a: object, **k: object) -> list[np.ndarray]:
            return [o + 0.5 for o in self.sess.run(*a, **k)]

    monkeypatch.setattr(ort, "InferenceSession", Skewed)  # onnxruntime answers 0.5 off
    with pytest.raises(TrackingError, match=r"differs from PyTorch: max abs diff 0\.5"):
        export_onnx(Tiny(), torch.randn(2, 4), tmp_path / "n.onnx")


def _study(n_trials: int, *, directions: list[str] | None = None) -> optuna.Study:
    dirs = [optuna.study.StudyDirection[d.upper()] for d in directions or ["maximize"]]
    study = optuna.create_study(directions=dirs, sampler=optuna.samplers.RandomSampler(seed=0))

    def objective(trial: optuna.Trial) -> float | tuple[float, float]:
        lr = trial.suggest_float("lr", 1e-4, 1.0, log=True)
        bs = trial.suggest_categorical("batch_size", [32, 64, 128])
        wd = trial.suggest_float("weight_decay", 0.0, 1e-3)
        trial.set_user_attr("mlflow_run_id", f"run{trial.number}")
        acc = 1.0 - abs(math.log10(lr) + 2) / 4 - wd * 10 + bs / 1e4
        return (acc, float(bs)) if directions and len(directions) > 1 else acc

    study.optimize(objective, n_trials=n_trials)
    return study


HAS_PLOTLY = importlib.util.find_spec("plotly") is not None
HTML = ("html",) if HAS_PLOTLY else ()  # without plotly the HTML plots are skipped (warned)


def test_study_plots_html_and_png(tmp_path: Path) -> None:
    written = study_plots(_study(8), tmp_path / "plots", plotlyjs="cdn")
    names = sorted(p.name for p in written)
    assert names == sorted(
        f"{n}.{ext}"
        for n in ("optimization_history", "param_importances", "parallel_coordinate")
        for ext in ("png", *HTML)
    )
    for p in written:
        if p.suffix == ".png":
            assert_png(p)
        else:
            assert "plotly" in p.read_text()[:5000].lower()


def test_study_plots_skip_what_needs_two_completed_trials(tmp_path: Path) -> None:
    written = study_plots(_study(1), tmp_path / "one", plotlyjs="cdn")
    assert sorted(p.name for p in written) == sorted(
        f"optimization_history.{ext}" for ext in ("png", *HTML)
    )
    empty = optuna.create_study()
    assert study_plots(empty, tmp_path / "none") == []


def test_study_plots_multi_objective(tmp_path: Path) -> None:
    study = _study(6, directions=["maximize", "minimize"])
    written = study_plots(study, tmp_path / "mo", html=False)
    assert len(written) == 3 and all(p.suffix == ".png" for p in written)


def test_trials_csv(tmp_path: Path) -> None:
    out = trials_csv(_study(3), tmp_path / "trials.csv")
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    assert {"number", "value", "params_lr", "params_batch_size", "state"} <= set(rows[0])
    assert [r["user_attrs_mlflow_run_id"] for r in rows] == ["run0", "run1", "run2"]


class Broken(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no forward")


class Noisy(Tiny):
    """Random output: ONNX Runtime draws other numbers than PyTorch, so it never verifies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.rand(x.shape[0], 3)


@pytest.mark.parametrize(
    ("model", "error"),
    [(Broken(), "ONNX export of Broken failed"), (Noisy(), "differs from PyTorch")],
)
def test_a_failed_export_leaves_the_file_there_as_it_was(
    tmp_path: Path, model: torch.nn.Module, error: str
) -> None:
    """Neither a failed export nor a failed verification touches a good file at the path,
    nor leaves an unverified one anywhere."""
    path = tmp_path / "best_model.onnx"
    path.write_bytes(b"the good one")
    with pytest.raises(TrackingError, match=error):
        export_onnx(model, torch.randn(2, 4), path)
    assert path.read_bytes() == b"the good one"
    assert [p.name for p in tmp_path.iterdir()] == ["best_model.onnx"]
    export_onnx(Tiny(), torch.randn(2, 4), path)  # a verified export replaces it
    assert path.read_bytes() != b"the good one"
    assert [p.name for p in tmp_path.iterdir()] == ["best_model.onnx"]


def test_class_names_the_font_lacks_draw_without_warnings(tmp_path: Path) -> None:
    """QA: each class name in a script DejaVu Sans lacks (CJK, emoji) printed two lines of
    matplotlib's warning per glyph and plot on the console of `train`."""
    import warnings

    from hpsearch.tracking.artifacts import confusion_matrix_png

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        confusion_matrix_png([[1, 0], [0, 1]], ["桜", "Gänseblümchen 🌼"], tmp_path / "cm.png")
    assert [str(w.message) for w in caught] == []
    assert (tmp_path / "cm.png").stat().st_size > 0
