"""torchvision classifiers by name, optionally with pretrained weights, with a head for the
dataset's classes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torchvision
from hpsearch.config import Hyperparams, StudyConfig
from hpsearch.errors import ConfigError, DataError
from torch import nn


def head(model: nn.Module) -> tuple[nn.Module, str]:
    """The final Linear layer's parent and attribute name, for every supported arch."""
    if isinstance(getattr(model, "fc", None), nn.Linear):  # resnet
        return model, "fc"
    classifier = getattr(model, "classifier", None)
    if isinstance(classifier, nn.Sequential) and isinstance(classifier[-1], nn.Linear):
        return classifier, str(len(classifier) - 1)  # mobilenet_v3, efficientnet, convnext
    raise ConfigError(f"model {type(model).__name__}: cannot find its classifier head")


def replace_head(model: nn.Module, num_classes: int) -> None:
    parent, name = head(model)
    old = getattr(parent, name)
    if old.out_features != num_classes:
        setattr(parent, name, nn.Linear(old.in_features, num_classes))


def _state_dict_from_file(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ConfigError(f"model.weights: {path}: file not found")
    try:
        obj: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle errors, truncated files, ...
        raise ConfigError(f"model.weights: {path}: not a PyTorch weights file ({exc})") from exc
    for key in ("model", "state_dict"):  # our best-model files and common checkpoints
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise ConfigError(f"model.weights: {path}: expected a state_dict")
    return {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in obj.items()}


def load_weights_file(model: nn.Module, path: Path) -> None:
    """Load a state_dict into `model`; a head of another size (e.g. 1000 ImageNet classes)
    is left freshly initialized, any other mismatch is a ConfigError."""
    state = _state_dict_from_file(path)
    parent, name = head(model)
    head_prefix = next(k for k, m in model.named_modules() if m is getattr(parent, name))
    own = model.state_dict()
    keep = {}
    for k, v in state.items():
        if k in own and own[k].shape != v.shape:
            if k.startswith(head_prefix + "."):
                continue
            raise ConfigError(
                f"model.weights: {path}: {k} has shape {tuple(v.shape)}, the model wants "
                f"{tuple(own[k].shape)}; is it another architecture?"
            )
        keep[k] = v
    missing, unexpected = model.load_state_dict(keep, strict=False)
    missing = [k for k in missing if not k.startswith(head_prefix + ".")]
    if missing or unexpected:
        bad = (missing or unexpected)[0]
        raise ConfigError(
            f"model.weights: {path}: does not match the model "
            f"({len(missing)} missing keys, {len(unexpected)} unexpected, e.g. {bad})"
        )


def _torchvision_pretrained(arch: str) -> nn.Module:
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)
    try:
        return torchvision.models.get_model(arch, weights=weights)
    except (OSError, RuntimeError) as exc:  # URLError is an OSError
        if cached.is_file():  # torch.hub never downloads over a file already there
            raise DataError(
                f"model {arch}: pretrained weights {cached} do not load "
                f"({' '.join(str(exc).split())[:120]}); delete the file to download it again, "
                "or set model.weights to a local file"
            ) from exc
        raise DataError(
            f"model {arch}: pretrained weights {weights} not in {cached} and the download "
            f"failed ({' '.join(str(exc).split())[:120]}); go online once, set TORCH_HOME, or "
            "set model.weights to a local file"
        ) from exc


def build_model(config: StudyConfig, hp: Hyperparams, num_classes: int) -> nn.Module:
    """A torchvision classifier `hp.arch` with `num_classes` outputs (train mode, CPU).

    model.weights (a local file) wins over model.pretrained (torchvision's weights API, which
    downloads into TORCH_HOME once). Pretrained heads are replaced for num_classes.
    """
    if config.model.weights:
        model = torchvision.models.get_model(hp.arch, weights=None, num_classes=num_classes)
        load_weights_file(model, Path(config.model.weights).expanduser())
        return model
    if config.model.pretrained:
        model = _torchvision_pretrained(hp.arch)
        replace_head(model, num_classes)
        return model
    return torchvision.models.get_model(hp.arch, weights=None, num_classes=num_classes)
