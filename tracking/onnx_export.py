"""The best model in ONNX, verified with onnxruntime.

Its own module, without matplotlib: a worker exports the study best it holds as it stops,
in the training process (importing matplotlib there cost 0.3 s of CPU for nothing).
Torch, onnxruntime and onnx are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hpsearch.errors import TrackingError
from hpsearch.tracking import logger

if TYPE_CHECKING:
    import torch


def export_onnx(
    model: torch.nn.Module,
    example_input: torch.Tensor,
    path: Path,
    *,
    atol: float = 1e-4,
    rtol: float = 1e-3,
    dynamic_batch: bool = True,
    verify_batch: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Export ``model`` (a copy, on CPU, in eval mode) to ONNX at ``path`` and verify it: run
    onnxruntime and PyTorch on a batch (``example_input``, or ``verify_batch`` random samples of
    its shape when a dynamic batch is exported) and require
    ``|ort - torch| <= atol + rtol * |torch|`` everywhere. Input ``input``, output ``logits``.

    Uses the TorchScript exporter first (a ResNet in a third of a second, where the
    torch.export-based one takes seconds at the end of every launch) and falls back to the
    torch.export-based exporter (needs onnxscript, works offline) where it fails or is gone.
    `metadata`: the model's metadata_props (ONNX's key-value strings: its class names and
    preprocessing, which a server reading the file has no other way to know).
    Raises TrackingError when both exporters fail or the outputs do not match."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Exported and verified beside `path`, then renamed over it: a failure leaves a good
    # file already there as it was, and never an unverified one at `path`.
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}",
                                dir=path.parent)  # fmt: skip
    os.close(fd)
    tmp = Path(name)
    try:
        _export_and_verify(model, example_input, tmp, atol, rtol, dynamic_batch, verify_batch)
        if metadata:
            _set_metadata(tmp, metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _set_metadata(path: Path, metadata: Mapping[str, str]) -> None:
    import onnx

    proto = onnx.load(str(path))
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, {str(k): str(v) for k, v in metadata.items()})
    onnx.save(proto, str(path))


def _export_and_verify(
    model: torch.nn.Module,
    example_input: torch.Tensor,
    path: Path,
    atol: float,
    rtol: float,
    dynamic_batch: bool,
    verify_batch: int | None,
) -> None:
    import numpy as np
    import onnxruntime as ort
    import torch

    net = copy.deepcopy(model).to("cpu").eval()
    x = example_input.detach().to("cpu")
    errors: list[str] = []
    for dynamo in (False, True):
        try:
            _export(net, x, path, dynamo=dynamo, dynamic_batch=dynamic_batch)
            logger.debug("ONNX export with the %s exporter", "dynamo" if dynamo else "torchscript")
            break
        except Exception as exc:  # exporter internals raise anything; try the other one
            errors.append(f"{'dynamo' if dynamo else 'torchscript'}: {type(exc).__name__}: {exc}")
            path.unlink(missing_ok=True)
    else:
        raise TrackingError(f"ONNX export of {type(model).__name__} failed: {'; '.join(errors)}")

    if dynamic_batch and verify_batch:
        gen = torch.Generator().manual_seed(0)
        xv = torch.randn((verify_batch, *x.shape[1:]), generator=gen, dtype=x.dtype)
    else:
        xv = x
    with torch.no_grad():
        ref = net(xv)
    ref_np = (ref[0] if isinstance(ref, tuple | list) else ref).detach().numpy()
    try:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        out = sess.run(None, {sess.get_inputs()[0].name: xv.numpy()})[0]
    except Exception as exc:  # onnxruntime errors are not one type
        raise TrackingError(f"onnxruntime cannot run {path}: {type(exc).__name__}: {exc}") from exc
    if out.shape != ref_np.shape:
        raise TrackingError(f"ONNX output shape {out.shape} != PyTorch output {ref_np.shape}")
    diff = np.abs(out - ref_np)
    bound = atol + rtol * np.abs(ref_np)
    if not np.all(diff <= bound):
        raise TrackingError(
            f"ONNX output differs from PyTorch: max abs diff {float(diff.max()):.3g} "
            f"(atol {atol:g}, rtol {rtol:g}) for {path}"
        )


def _export(
    net: torch.nn.Module, x: torch.Tensor, path: Path, *, dynamo: bool, dynamic_batch: bool
) -> None:
    import torch

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if dynamo:
            shapes = ({0: torch.export.Dim("batch", min=1, max=65536)},) if dynamic_batch else None
            torch.onnx.export(
                net,
                (x,),
                str(path),
                dynamo=True,
                input_names=["input"],
                output_names=["logits"],
                dynamic_shapes=shapes,
                external_data=False,
                verbose=False,
                optimize=True,
            )
        else:
            axes = {"input": {0: "batch"}, "logits": {0: "batch"}} if dynamic_batch else None
            torch.onnx.export(
                net,
                (x,),
                str(path),
                dynamo=False,
                input_names=["input"],
                output_names=["logits"],
                dynamic_axes=axes,
            )
