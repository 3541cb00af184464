"""The shared half of the image workloads: tensors in memory, cross-entropy, top-1 accuracy."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from daf.workloads.base import Workload, check_positive, index_stream

__all__ = ["ImageClassification"]


class ImageClassification(Workload):
    """Images float32 [N, C, H, W] with int64 labels [N]; batches are ``(images, labels)``.

    A workload may keep its images in a smaller form (e.g. uint8 pixels) and turn each batch into
    float32 with ``prepare``: the whole split in float32 would sit in the process's memory beside
    the model (Fashion-MNIST: 220 MB as float32, 55 MB as pixels).

    ``train_size`` keeps the first images of the (fixed) training split, ``eval_size`` the first
    of the held-out split: a small slice for tests, the same slice every time.
    """

    metric = "accuracy"
    higher_is_better = True
    eval_batch = 500

    def __init__(self, seed: int = 0, train_size: int | None = None, eval_size: int | None = None) -> None:
        super().__init__(seed, train_size, eval_size)
        self._cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @abstractmethod
    def _load(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Train images, train labels, eval images, eval labels (full splits)."""

    def data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The splits after ``train_size``/``eval_size``, loaded once per instance."""
        if self._cache is None:
            x, y, ex, ey = self._load()
            self._cache = (x[:self.train_size], y[:self.train_size], ex[:self.eval_size], ey[:self.eval_size])
        return self._cache

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        """Stored images -> the float32 batch the model takes (identity unless a workload stores less)."""
        return images

    def batches(self, batch_size: int, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        check_positive("batch_size", batch_size)
        images, labels, _, _ = self.data()
        for index in index_stream(len(images), batch_size, steps, self.seed):
            yield self.prepare(images[index]), labels[index]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        _, _, images, labels = self.data()
        was_training = model.training
        model.eval()
        correct, total_loss = 0, 0.0
        try:
            with torch.no_grad():
                for start in range(0, len(images), self.eval_batch):
                    logits = model(self.prepare(images[start:start + self.eval_batch]))
                    target = labels[start:start + self.eval_batch]
                    correct += int((logits.argmax(1) == target).sum())
                    total_loss += float(F.cross_entropy(logits, target, reduction="sum"))
        finally:
            model.train(was_training)
        return {"accuracy": correct / len(images), "eval_loss": total_loss / len(images), "eval_examples": len(images)}
