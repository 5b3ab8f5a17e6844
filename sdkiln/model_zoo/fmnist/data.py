"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (gzipped IDX files).

The embedded model is trained and measured on this data set; nothing is downloaded. Images are
returned as uint8 ``[N, 28, 28]`` and labels as int64 ``[N]``; :func:`to_canvas` turns them into
the 32x32 canvas in [-1, 1] that the transformer denoises.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
DEBIAN_PACKAGE = "dataset-fashion-mnist"
CLASS_NAMES = (
    "t-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)
IMAGE_SIZE = 28
CANVAS_SIZE = 32
PAD = (CANVAS_SIZE - IMAGE_SIZE) // 2

_IDX_IMAGES = 2051
_IDX_LABELS = 2049


def dataset_available(data_dir: Path = DATA_DIR) -> bool:
    return all((data_dir / name).is_file() for split in ("train", "t10k") for name in _file_names(split))


def _file_names(split: str) -> tuple[str, str]:
    return f"{split}-images-idx3-ubyte.gz", f"{split}-labels-idx1-ubyte.gz"


def _read_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    if not path.is_file():
        raise FileNotFoundError(
            f"Fashion-MNIST file {path} not found; install the Debian package "
            f"'{DEBIAN_PACKAGE}' (apt-get install {DEBIAN_PACKAGE})"
        )
    with gzip.open(path, "rb") as f:
        raw = f.read()
    header = np.frombuffer(raw, dtype=">u4", count=1 + ndim)
    if int(header[0]) != magic:
        raise ValueError(f"{path}: IDX magic {int(header[0])}, expected {magic}")
    shape = tuple(int(d) for d in header[1:])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 * (1 + ndim))
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {data.size} bytes of data for shape {shape}")
    return data.reshape(shape)


def load_split(split: str, data_dir: Path = DATA_DIR) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [N,28,28], labels int64 [N])`` for ``split`` in {"train", "test"}."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    prefix = "train" if split == "train" else "t10k"
    image_file, label_file = _file_names(prefix)
    images = _read_idx(Path(data_dir) / image_file, _IDX_IMAGES, 3)
    labels = _read_idx(Path(data_dir) / label_file, _IDX_LABELS, 1).astype(np.int64)
    if len(images) != len(labels):
        raise ValueError(f"{data_dir}: {len(images)} images but {len(labels)} labels in the {split} split")
    return images, labels


def to_canvas(images: np.ndarray) -> torch.Tensor:
    """uint8 ``[N,28,28]`` -> float32 ``[N,1,32,32]`` in [-1, 1], zero-padded (black is -1)."""
    x = torch.from_numpy(np.array(images, dtype=np.uint8)).float().div_(127.5).sub_(1.0)
    x = torch.nn.functional.pad(x, (PAD, PAD, PAD, PAD), value=-1.0)
    return x.unsqueeze(1)
