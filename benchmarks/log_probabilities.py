"""Cross-entropy's saved log-probabilities on a real LM: codes of the logarithm against codes of the probabilities.

SmolLM2-135M (the ``smollm-lora`` workload's model, no LoRA needed) on its first batch: the exact
gradient that cross-entropy's backward sends to the logits and on to the last hidden state (through
the tied output embedding), against the same with the saved ``log_softmax`` output replaced by
DAF's codes of it: format-1 codes of the log-probabilities (what DAF stored before, at 8 bits) or
``daf.codec.logprob`` codes of the probabilities (what it stores now, at 4). Relative error, bytes.

    python benchmarks/log_probabilities.py [--batch 8] [--seeds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from daf.codec import Spec
from daf.codec.backends import select_backend
from daf.codec.logprob import LogProbCodec
from daf.codec.minmax import decode, encode
from daf.workloads import get_workload

FORMS = [("logarithm", 8), ("logarithm", 4), ("probabilities", 8), ("probabilities", 4), ("probabilities", 2)]


def _backward(log_probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What LogSoftmaxBackward0 computes from the saved output under a mean NLL loss."""
    grad = torch.zeros_like(log_probs)
    grad[torch.arange(len(labels)), labels] = -1.0 / len(labels)
    return grad - torch.exp(log_probs) * grad.sum(-1, keepdim=True)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3, help="rounding seeds per form")
    parser.add_argument("--json")
    args = parser.parse_args()
    workload = get_workload("smollm-lora")
    model = workload.build_model().eval()
    tokens = next(iter(workload.batches(args.batch, 1)))
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits[:, :-1].float()
    logits = logits.reshape(-1, logits.shape[-1])
    labels = tokens[:, 1:].reshape(-1)
    log_probs = F.log_softmax(logits, -1)
    embedding = model.get_output_embeddings().weight.float()
    exact = _backward(log_probs, labels)
    backend = select_backend("auto")
    rows = []
    for form, bits in FORMS:
        logit_errors, hidden_errors = [], []
        for seed in range(args.seeds):
            if form == "logarithm":
                packed = encode(log_probs, bits, 256, "stochastic", seed, backend)
                restored = decode(packed, backend)
            else:
                codec = LogProbCodec(backend)
                packed = codec.encode(log_probs, Spec(bits, seed))
                restored = codec.decode(packed)
            grad = _backward(restored, labels)
            logit_errors.append(float((grad - exact).norm() / exact.norm()))
            hidden_errors.append(float(((grad - exact) @ embedding).norm() / (exact @ embedding).norm()))
        rows.append({"form": form, "bits": bits, "stored_mib": packed.nbytes / 2**20,
                     "logits_rel_error": statistics.median(logit_errors),
                     "hidden_rel_error": statistics.median(hidden_errors)})
    print(f"SmolLM2-135M, {tuple(log_probs.shape)} log-probabilities ({log_probs.numel() * 4 / 2**20:.1f} MiB), "
          f"median of {args.seeds} rounding seeds")
    print(f"{'codes of':>14} {'bits':>4} {'MiB':>7} {'grad logits':>12} {'grad hidden':>12}")
    for row in rows:
        print(f"{row['form']:>14} {row['bits']:>4} {row['stored_mib']:7.2f} {row['logits_rel_error']:12.4f} "
              f"{row['hidden_rel_error']:12.4f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "shape": list(log_probs.shape), "argv": sys.argv}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
