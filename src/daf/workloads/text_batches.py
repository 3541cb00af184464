"""Token tensors for the text workloads: padded id matrices, batches trimmed to their longest row."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["encode_padded", "trim"]


def encode_padded(tokenizer: Any, texts: tuple[str, ...], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask int64 [len(texts), max_length], truncated and right-padded."""
    encoded = tokenizer(list(texts), padding="max_length", truncation=True, max_length=max_length,
                        return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


def trim(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the columns that are padding in every row (right padding). O(numel).

    >>> trim(torch.tensor([[5, 6, 0], [7, 0, 0]]), torch.tensor([[1, 1, 0], [1, 0, 0]]))[0].tolist()
    [[5, 6], [7, 0]]
    """
    length = max(int(mask.sum(1).max()), 1)
    return ids[:, :length], mask[:, :length]
