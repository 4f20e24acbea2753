"""Models by name, heads, and weights from a local file (no network)."""

from __future__ import annotations

import urllib.error
from pathlib import Path

import pytest
import torch
import torchvision
from hpsearch.config import Hyperparams
from hpsearch.errors import ConfigError, DataError
from hpsearch.trainer import build_model
from trainer_helpers import synthetic


@pytest.mark.parametrize(
    "arch",
    [
        "resnet18",
        "resnet34",
        "resnet50",
        "mobilenet_v3_small",
        "mobilenet_v3_large",
        "efficientnet_b0",
        "convnext_tiny",
    ],
)
def test_every_arch_builds_with_num_classes(arch: str) -> None:
    model = build_model(synthetic(), Hyperparams(arch=arch), 7).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_each_arch_trains_at_the_smallest_image_size_a_study_file_allows() -> None:
    """config.MIN_IMAGE_SIZE (else 8 px, image_size's floor) is what each arch takes: a
    study file with less is refused at load, and a trial drawing it never fails on it."""
    from hpsearch.config import ARCHS, MIN_IMAGE_SIZE

    for arch in ARCHS:
        px = MIN_IMAGE_SIZE.get(arch, 8)
        model = build_model(synthetic(), Hyperparams(arch=arch), 3).train()
        model(torch.randn(2, 3, px, px)).sum().backward()
        if arch in MIN_IMAGE_SIZE:
            with pytest.raises(RuntimeError):
                model(torch.randn(2, 3, px // 2, px // 2))


def test_weights_from_local_file(tmp_path: Path) -> None:
    torch.manual_seed(1)
    source = torchvision.models.resnet18(num_classes=5)
    path = tmp_path / "r18.pt"
    torch.save(source.state_dict(), path)
    cfg = synthetic(model={"weights": str(path)})
    torch.manual_seed(2)  # another init: equality below comes from the file
    model = build_model(cfg, Hyperparams(arch="resnet18"), 5)
    for (k, a), b in zip(source.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_weights_with_other_head_keep_backbone(tmp_path: Path) -> None:
    imagenet = torchvision.models.resnet18()  # 1000 classes, like a torchvision checkpoint
    path = tmp_path / "imagenet.pt"
    torch.save({"state_dict": imagenet.state_dict()}, path)
    model = build_model(synthetic(model={"weights": str(path)}), Hyperparams(), 10)
    assert model.fc.out_features == 10
    assert torch.equal(model.conv1.weight, imagenet.conv1.weight)
    assert torch.equal(model.layer4[1].bn2.running_var, imagenet.layer4[1].bn2.running_var)


def test_weights_of_another_arch_is_config_error(tmp_path: Path) -> None:
    path = tmp_path / "mnv3.pt"
    torch.save(torchvision.models.mobilenet_v3_small(num_classes=10).state_dict(), path)
    with pytest.raises(ConfigError, match=r"does not match|shape"):
        build_model(synthetic(model={"weights": str(path)}), Hyperparams(), 10)
    with pytest.raises(ConfigError, match="not found"):
        build_model(synthetic(model={"weights": str(tmp_path / "nope.pt")}), Hyperparams(), 10)


def test_pretrained_offline_is_one_line_data_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # empty weights cache

    def offline(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(DataError) as info:
        build_model(synthetic(model={"pretrained": True}), Hyperparams(), 10)
    msg = str(info.value)
    assert "\n" not in msg and "resnet18" in msg and str(tmp_path) in msg


def test_pretrained_from_torch_home_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weights file already in TORCH_HOME is used without network; the head is replaced."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    weights = torchvision.models.ResNet18_Weights.DEFAULT
    ckpt = tmp_path / "hub" / "checkpoints" / Path(weights.url).name
    ckpt.parent.mkdir(parents=True)
    imagenet = torchvision.models.resnet18()
    torch.save(imagenet.state_dict(), ckpt)
    model = build_model(synthetic(model={"pretrained": True}), Hyperparams(), 4)
    assert model.fc.out_features == 4
    assert torch.equal(model.conv1.weight, imagenet.conv1.weight)


def test_a_damaged_weights_file_in_torch_home_says_to_delete_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.hub does not download over a file already there: "go online" would not help."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    name = Path(torchvision.models.ResNet18_Weights.DEFAULT.url).name
    ckpt = tmp_path / "hub" / "checkpoints" / name
    ckpt.parent.mkdir(parents=True)
    torch.save(torchvision.models.resnet18().state_dict(), ckpt)
    ckpt.write_bytes(ckpt.read_bytes()[:4096])  # an interrupted download
    with pytest.raises(DataError) as info:
        build_model(synthetic(model={"pretrained": True}), Hyperparams(), 10)
    msg = str(info.value)
    assert "\n" not in msg and str(ckpt) in msg and "delete the file" in msg
