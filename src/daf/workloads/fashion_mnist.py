"""Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (installed offline by apt)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

__all__ = ["load_fashion_mnist", "normalize", "DATA_DIR", "INSTALL_HINT"]

DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
INSTALL_HINT = "apt-get update && apt-get install -y dataset-fashion-mnist"
_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
          "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
# Per-pixel statistics of the training split, fixed so that every run normalizes the same way.
MEAN, STD = 0.2860, 0.3530


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels [*] -> float32 [*], scaled to [0, 1] then standardized; elementwise, so a batch
    normalized alone equals the same rows of the whole split normalized at once, bit for bit."""
    return images.float().div_(255).sub_(MEAN).div_(STD)


def load_fashion_mnist(split: str = "train", data_dir: Path | str = DATA_DIR,
                       pixels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Images float32 [N, 1, 28, 28] (normalized; uint8 pixels with ``pixels=True``, 4x smaller in
    memory, for ``normalize`` per batch) and labels int64 [N] of ``split`` ("train" 60k, "test" 10k)."""
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    images_file, labels_file = (Path(data_dir) / name for name in _FILES[split])
    if not images_file.exists():
        raise FileNotFoundError(f"Fashion-MNIST is not installed at {data_dir}; install it with: {INSTALL_HINT}")
    images = torch.from_numpy(_read_idx(images_file).copy())
    labels = torch.from_numpy(_read_idx(labels_file).astype(np.int64))
    return (images if pixels else normalize(images)).unsqueeze(1), labels
