"""The metric network: a small CNN trained on the Fashion-MNIST train split.

It scores what the embedded model generates: its class predictions give class accuracy and its
penultimate features give FD-FMNIST (see ``metrics.py``). It takes images as sdkiln pipelines
return them, ``[N, H, W, 1]`` in [0, 1], on the 32x32 canvas or cropped to 28x28. Shipped as
``weights/classifier.safetensors`` (weights plus the real test images' feature statistics) and
``weights/classifier.json`` (its config).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from sdkiln.model_zoo.fmnist.data import CANVAS_SIZE, IMAGE_SIZE, PAD

WEIGHTS_DIR = Path(__file__).parent / "weights"
CLASSIFIER_WEIGHTS = WEIGHTS_DIR / "classifier.safetensors"
CLASSIFIER_CONFIG = WEIGHTS_DIR / "classifier.json"


@dataclass(frozen=True)
class ClassifierConfig:
    channels: tuple[int, int, int] = (16, 32, 64)
    convs_per_stage: int = 2
    feature_dim: int = 64
    num_classes: int = 10
    version: int = 2

    @classmethod
    def from_dict(cls, d: dict) -> ClassifierConfig:
        d = dict(d)
        if d.get("version") != cls.version:
            raise ValueError(f"classifier config version {d.get('version')}, expected {cls.version}")
        d["channels"] = tuple(d["channels"])
        return cls(**d)


class FmnistClassifier(nn.Module):
    """Three stages (canvas 32 -> 16 -> 8 -> 4) of ``convs_per_stage`` conv-BN-ReLU then a max-pool,
    and a two-layer head; the first head layer's ReLU output is the feature vector used for
    FD-FMNIST."""

    def __init__(self, config: ClassifierConfig = ClassifierConfig()):
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        c_in = 1
        for c in config.channels:
            for _ in range(config.convs_per_stage):
                layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()]
                c_in = c
            layers.append(nn.MaxPool2d(2))
        self.trunk = nn.Sequential(*layers)
        side = CANVAS_SIZE // 2 ** len(config.channels)
        self.feature = nn.Sequential(
            nn.Flatten(), nn.Dropout(0.3), nn.Linear(c_in * side * side, config.feature_dim), nn.ReLU()
        )
        self.head = nn.Linear(config.feature_dim, config.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``[N,1,32,32]`` in [-1, 1] -> penultimate features ``[N, feature_dim]``."""
        return self.feature(self.trunk(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def images_to_input(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``[N,H,W,1]`` in [0,1] with H=W in {28, 32} -> float32 ``[N,1,32,32]`` in [-1, 1]."""
    x = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
    if (
        x.ndim != 4
        or x.shape[-1] != 1
        or x.shape[1] != x.shape[2]
        or x.shape[1] not in (IMAGE_SIZE, CANVAS_SIZE)
    ):
        raise ValueError(
            f"expected grayscale images [N,H,W,1] with H=W of {IMAGE_SIZE} or {CANVAS_SIZE}, got {tuple(x.shape)}"
        )
    x = x.float().permute(0, 3, 1, 2).clamp(0.0, 1.0) * 2.0 - 1.0
    if x.shape[-1] == IMAGE_SIZE:
        x = nn.functional.pad(x, (PAD, PAD, PAD, PAD), value=-1.0)
    return x


def save_classifier(model: FmnistClassifier, feature_mean: torch.Tensor, feature_cov: torch.Tensor) -> None:
    """Weights (fp32, they are small) plus the real test split's feature mean and covariance."""
    WEIGHTS_DIR.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().float().contiguous() for k, v in model.state_dict().items() if v.is_floating_point()
    }
    tensors["stats.test_feature_mean"] = feature_mean.double().contiguous()
    tensors["stats.test_feature_cov"] = feature_cov.double().contiguous()
    save_file(tensors, str(CLASSIFIER_WEIGHTS))
    CLASSIFIER_CONFIG.write_text(json.dumps(asdict(model.config), indent=2) + "\n")


_CACHE: dict[str, tuple[FmnistClassifier, torch.Tensor, torch.Tensor]] = {}


def load_classifier() -> tuple[FmnistClassifier, torch.Tensor, torch.Tensor]:
    """``(model in eval mode, test feature mean, test feature covariance)`` from the shipped files."""
    if "shipped" in _CACHE:
        return _CACHE["shipped"]
    if not CLASSIFIER_WEIGHTS.is_file() or not CLASSIFIER_CONFIG.is_file():
        raise FileNotFoundError(
            f"classifier weights missing under {WEIGHTS_DIR}; "
            "train them with `python tools/fmnist/train_classifier.py` (in the source tree)"
        )
    config = ClassifierConfig.from_dict(json.loads(CLASSIFIER_CONFIG.read_text()))
    tensors = load_file(str(CLASSIFIER_WEIGHTS))
    mean = tensors.pop("stats.test_feature_mean")
    cov = tensors.pop("stats.test_feature_cov")
    model = FmnistClassifier(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise ValueError(f"{CLASSIFIER_WEIGHTS}: missing {missing}, unexpected {unexpected}")
    model.eval()
    _CACHE["shipped"] = (model, mean, cov)
    return _CACHE["shipped"]


@torch.no_grad()
def classify(images: np.ndarray | torch.Tensor, batch_size: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """``(predicted class [N], penultimate features [N, D] float64)`` for images ``[N,H,W,1]`` in [0,1]."""
    model, _, _ = load_classifier()
    x = images_to_input(images)
    preds, feats = [], []
    for chunk in x.split(batch_size):
        f = model.features(chunk)
        preds.append(model.head(f).argmax(-1))
        feats.append(f.double())
    return torch.cat(preds).numpy(), torch.cat(feats).numpy()


def predict_classes(images: np.ndarray | torch.Tensor) -> np.ndarray:
    return classify(images)[0]


def penultimate_features(images: np.ndarray | torch.Tensor) -> np.ndarray:
    return classify(images)[1]
