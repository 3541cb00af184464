"""Gradient cosine to fp32 and stored bytes of DAF on six HF architectures (random init) and two workloads.

GPT-2, BERT, T5, Llama, ViT and ConvNeXt are built from their ``transformers`` configs (no download),
seeded, in training mode without dropout; ``smollm-lora`` and ``minilm-tweets`` are the project's
pretrained workloads (LoRA), on their first batch, dropout masks re-seeded for every method. Each
method's copy of a model computes one gradient on the same batch and is compared with the fp32
gradient: cosine and relative error over all parameter gradients concatenated, bytes from
``daf.report``. The adaptive policy plans from watched forwards:
it runs ``--warmup`` forward/backward passes on the same batch first (``replan_every`` = warmup, so the
plan in force at the measured step is made from all of them).

    python benchmarks/transformer_archs.py                       # methods table
    python benchmarks/transformer_archs.py --sites               # which kind of save costs the error
    python benchmarks/transformer_archs.py --archs llama,bert --methods uniform-2,outliers-2 --json out.json

``--leave-one-in``: per site, the adaptive policy's estimate of its cost at 2 bits against the truth
(only that site quantized, the others raw), split by whether the estimator costs it by its generic
model (``SiteStats.generic``) or as a product with a parameter.

``--sites``: every site at 8 bits except one kind at 2 (kinds: ``site_kinds.KINDS``), and the
elements each kind holds (JSON). ``--outliers N``: the embedding output of N hidden channels is
scaled by 30 (random init has no outlier dimensions; trained LMs do). ``--rounding-seeds N``: each
method under N values of ``Config.seed``. Results and reading: docs/transformers.md.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import daf
from daf.config import Outliers

sys.path.insert(0, str(Path(__file__).parent))
from site_kinds import KINDS, KindBits, classify, module_kinds  # noqa: E402
from transformer_configs import CONFIGS  # noqa: E402

HIDDEN, LAYERS, HEADS, FFN, VOCAB = 256, 2, 4, 1024, 1000


@dataclass
class Arch:
    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Any]
    embedding: Callable[[nn.Module], nn.Module]  # where --outliers scales channels
    loss: Callable[[nn.Module, Any], torch.Tensor] = lambda model, batch: model(**batch).loss


def pretrained(name: str, batch: int) -> Arch:
    """A project workload (``smollm-lora``, ``minilm-tweets``): pretrained weights + LoRA, its first batch.
    The model is loaded once and copied per method (``measure`` deep-copies it)."""
    from daf.workloads import get_workload
    workload = get_workload(name, seed=0)
    first = next(iter(workload.batches(batch, 1)))
    torch.manual_seed(0)
    model = workload.build_model().train()
    return Arch(name, lambda: model, lambda g: first, lambda m: nn.Identity(), workload.loss)


def _text(batch: int, seq: int, labels: str, vocab: int = VOCAB) -> Callable[[torch.Generator], dict]:
    def make(g: torch.Generator) -> dict:
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        if labels == "lm":
            return {"input_ids": ids, "labels": ids}
        if labels == "seq2seq":
            return {"input_ids": ids, "labels": torch.randint(0, vocab, (batch, seq // 2), generator=g)}
        return {"input_ids": ids, "labels": torch.randint(0, 3, (batch,), generator=g)}
    return make


def _image(batch: int, size: int) -> Callable[[torch.Generator], dict]:
    def make(g: torch.Generator) -> dict:
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
                "labels": torch.randint(0, 10, (batch,), generator=g)}
    return make


def archs(attention: str) -> dict[str, Arch]:
    import transformers as tf
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    common = {"attn_implementation": attention}

    def model(cls: type, config: object) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            torch.manual_seed(0)
            return cls(config).train()
        return make

    gpt2 = tf.GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                         n_inner=FFN, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    bert = tf.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         intermediate_size=FFN, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         num_labels=3, **common)
    t5 = tf.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS,
                     num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                     decoder_start_token_id=0, **common)
    llama = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=128, **common)
    vit = tf.ViTConfig(image_size=32, patch_size=4, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, intermediate_size=FFN, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, num_labels=10, **common)
    convnext = tf.ConvNextConfig(num_channels=3, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1],
                                 num_labels=10)
    return {
        "gpt2": Arch("gpt2", model(tf.GPT2LMHeadModel, gpt2), _text(4, 64, "lm"), lambda m: m.transformer.wte),
        "bert": Arch("bert", model(tf.BertForSequenceClassification, bert), _text(4, 64, "cls"),
                     lambda m: m.bert.embeddings.word_embeddings),
        "t5": Arch("t5", model(tf.T5ForConditionalGeneration, t5), _text(4, 64, "seq2seq"), lambda m: m.shared),
        "llama": Arch("llama", model(tf.LlamaForCausalLM, llama), _text(4, 64, "lm"),
                      lambda m: m.model.embed_tokens),
        "vit": Arch("vit", model(tf.ViTForImageClassification, vit), _image(8, 32),
                    lambda m: m.vit.embeddings.patch_embeddings.projection),
        "convnext": Arch("convnext", model(tf.ConvNextForImageClassification, convnext), _image(8, 64),
                         lambda m: m.convnext.embeddings.patch_embeddings),
    }


def kind_configs() -> dict[str, daf.Config]:
    """Outliers at 2 bits except the saves of kind ``other`` (a gated MLP's product: SmolLM2's largest
    remaining error) at 4 or 8 bits: what a per-site policy could reach."""
    return {f"outliers-2-other-{bits}": daf.Config(policy=KindBits("other", bits, 2), codec=Outliers())
            for bits in (4, 8)}


def _with_outliers(model: nn.Module, arch: Arch, channels: int) -> nn.Module:
    """Scale ``channels`` hidden channels of the embedding's output by 30 (a forward hook)."""
    if channels:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            scale = torch.ones(output.shape[-1] if output.dim() != 4 else output.shape[1])
            scale[:channels] = 30.0
            return output * (scale.view(-1, 1, 1) if output.dim() == 4 else scale)
        arch.embedding(model).register_forward_hook(hook)
    return model


def _gradient(model: nn.Module, arch: Arch, batch: Any) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks for every method (the pretrained workloads keep dropout)
    arch.loss(model, batch).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double()
                      for p in model.parameters() if p.requires_grad])


def measure(arch: Arch, configs: dict[str, daf.Config], warmup: int, outliers: int, seed: int) -> dict:
    """fp32 gradient, then per config: cosine, relative error, stored and raw bytes, seconds."""
    base = _with_outliers(arch.make(), arch, outliers)
    batch = arch.batch(torch.Generator().manual_seed(seed))
    started = time.perf_counter()
    g_ref = _gradient(base, arch, batch)
    rows = {"fp32": {"cosine": 1.0, "rel_error": 0.0, "seconds": time.perf_counter() - started}}
    kinds = module_kinds(base)
    for name, config in configs.items():
        model = copy.deepcopy(base)
        if isinstance(config.policy, KindBits):
            config = config.replace(policy=KindBits(config.policy.low_kind, config.policy.low, config.policy.high,
                                                    kinds))
        if hasattr(config.policy, "replan_every"):  # daf.Adaptive, AdaptiveGeneric
            config = config.replace(policy=dataclasses.replace(config.policy, replan_every=warmup, window=warmup))
            daf.wrap(model, config)
            for _ in range(warmup):
                _gradient(model, arch, batch)
        else:
            daf.wrap(model, config)
        started = time.perf_counter()
        g = _gradient(model, arch, batch)
        seconds = time.perf_counter() - started
        report = daf.report(model)
        rows[name] = {"cosine": float(F.cosine_similarity(g, g_ref, dim=0)),
                      "rel_error": float((g - g_ref).norm() / g_ref.norm()),
                      "stored_bytes": report.stored_bytes, "raw_bytes": report.raw_bytes, "seconds": seconds,
                      "elements_by_kind": _elements_by_kind(report, kinds),
                      "uniform_fallback": report.sections.get("policy", {}).get("uniform_fallback")}
        daf.unwrap(model)
    return rows


@dataclass(frozen=True)
class OnlySite:
    """Policy config: ``bits`` at ``site``, every other saved tensor raw (leave-one-in)."""

    site: str = ""
    bits: int = 2


class _OnlySitePolicy(daf.policy.Policy):
    def __init__(self, config: OnlySite) -> None:
        self.config = config

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        return self.config.bits if site == self.config.site else 0


@daf.policy.register_policy(OnlySite, kind="only-site")
def _only_site(config: daf.Config) -> daf.policy.Policy:
    return _OnlySitePolicy(config.policy)


def leave_one_in(arch: Arch, warmup: int, seeds: int, bits: int = 2) -> dict:
    """Per site: the adaptive estimate of its cost at ``bits`` against the truth, the squared gradient error
    with only that site at ``bits`` and every other save raw (mean over ``seeds`` rounding seeds), both
    in units of ``||g||**2``; whether the estimator costs it by its generic model; its kind."""
    base = arch.make()
    batch = arch.batch(torch.Generator().manual_seed(0))
    g_ref = _gradient(base, arch, batch)
    norm = float(g_ref.square().sum())
    model = copy.deepcopy(base)
    daf.wrap(model, daf.Config(policy=daf.Adaptive(average=2.0, replan_every=warmup, window=warmup)))
    for _ in range(warmup + 1):
        _gradient(model, arch, batch)
    policy = daf.session_of(model).policy
    sources = {row.site: row.source for row in daf.report(model).rows}
    sites = {name: (stats.generic, policy.estimator.costs(name)) for name, stats in policy.estimator.sites.items()}
    daf.unwrap(model)
    kinds = module_kinds(base)
    rows = {}
    for name, (generic, costs) in sites.items():
        errors = []
        for seed in range(seeds):
            copy_ = copy.deepcopy(base)
            daf.wrap(copy_, daf.Config(policy=OnlySite(name, bits), seed=seed))
            errors.append(float((_gradient(copy_, arch, batch) - g_ref).square().sum()) / norm)
            daf.unwrap(copy_)
        rows[name] = {"kind": classify(name, sources.get(name, ""), kinds), "generic": generic,
                      "true": statistics.fmean(errors), "estimate": None if costs is None else costs[bits] / norm}
    return rows


def leave_one_in_table(results: dict[str, dict]) -> str:
    """Per arch, generic-model sites and parameter-product sites: log10(true / estimate), median and range,
    and how many are over-estimated more than 10x / under-estimated more than 2x. (The saves the session
    keeps at 8 bits whatever the policy says, softmax outputs, are among the generic ones: their truth is
    the 8-bit error.)"""
    lines = [f"{'arch':14s} {'sites':20s} {'n':>3s} {'median':>7s} {'min':>6s} {'max':>6s} {'>10x over':>10s} "
             f"{'>2x under':>10s}"]
    for arch, rows in results.items():
        for generic, label in ((False, "parameter products"), (True, "generic model")):
            ratios = [math.log10(r["true"] / r["estimate"]) for r in rows.values()
                      if r["generic"] == generic and r["estimate"] and r["true"] > 0]
            unestimated = sum(1 for r in rows.values() if r["generic"] == generic and not r["estimate"])
            if ratios:
                lines.append(f"{arch:14s} {label:20s} {len(ratios):3d} {statistics.median(ratios):7.2f} "
                             f"{min(ratios):6.2f} {max(ratios):6.2f} {sum(x < -1 for x in ratios):10d} "
                             f"{sum(x > math.log10(2) for x in ratios) + unestimated:10d}")
    return "\n".join(lines)


def _elements_by_kind(report: daf.Report, kinds: tuple[tuple[str, str], ...]) -> dict[str, int]:
    """Elements of the compressed rows per kind of save (the kind from the site's module and shape)."""
    counts: dict[str, int] = {}
    for row in report.rows:
        if row.kind == "compressed":
            kind = classify(row.site, row.source, kinds)
            n = 1
            for s in row.shape:
                n *= s
            counts[kind] = counts.get(kind, 0) + n
    return counts


def site_configs(low: int, high: int, codec: str) -> dict[str, daf.Config]:
    """``all-8``, then each kind at ``low`` bits and the others at ``high``, with ``codec`` ("minmax",
    "outliers", "outliers-token", "outliers-derivatives")."""
    codecs = {"minmax": daf.MinMax(), "outliers": Outliers(), "outliers-token": Outliers(axis="token"),
              "outliers-derivatives": Outliers(derivatives=True)}
    configs = {f"all-{high}": daf.Config(policy=KindBits("none", low, high), codec=codecs[codec])}
    for kind in KINDS:
        configs[f"{kind}-{low}"] = daf.Config(policy=KindBits(kind, low, high), codec=codecs[codec])
    return configs


def table(results: dict[str, dict]) -> str:
    names = list(next(iter(results.values())).keys())
    width = max(len(n) for n in names) + 1
    lines = [f"{'method':{width}s}" + "".join(f"{arch:>18s}" for arch in results),
             f"{'':{width}s}" + "".join(f"{'cos   rel   MiB':>18s}" for _ in results)]
    for name in names:
        cells = []
        for rows in results.values():
            r = rows.get(name)
            if r is None:
                cells.append(f"{'-':>18s}")
                continue
            mib = r.get("stored_bytes", 0) / 2**20
            cells.append(f"{r['cosine']:>8.4f} {r['rel_error']:5.3f} {mib:4.1f}" if "stored_bytes" in r
                         else f"{r['cosine']:>8.4f} {r['rel_error']:5.3f}  raw")
        lines.append(f"{name:{width}s}" + "".join(f"{c:>18s}" for c in cells))
    return "\n".join(lines)


def noise_table(results: dict[str, dict]) -> str:
    """Mean and standard deviation of the cosine over the rounding seeds of each method ("name/seed")."""
    lines = []
    for arch, rows in results.items():
        by_method: dict[str, list[float]] = {}
        for name, r in rows.items():
            if "/" in name:
                by_method.setdefault(name.split("/")[0], []).append(r["cosine"])
        for method, values in by_method.items():
            lines.append(f"{arch:14s} {method:26s} mean {statistics.fmean(values):.4f} "
                         f"sd {statistics.stdev(values):.4f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="gpt2,bert,t5,llama,vit,convnext",
                        help="of gpt2,bert,t5,llama,vit,convnext (random init) and smollm-lora, minilm-tweets")
    parser.add_argument("--pretrained-batch", type=int, default=8)
    parser.add_argument("--methods", default="uniform-2,uniform-4,adaptive-2.0")
    parser.add_argument("--sites", action="store_true", help="one kind of save at 2 bits, the others at 8")
    parser.add_argument("--sites-codec", default="minmax",
                        choices=("minmax", "outliers", "outliers-token", "outliers-derivatives"))
    parser.add_argument("--attention", default="eager", choices=("eager", "sdpa"))
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--outliers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounding-seeds", type=int, default=1,
                        help="N > 1: each method with Config.seed 0..N-1 (rounding noise); mean and sd of the cosine")
    parser.add_argument("--leave-one-in", action="store_true",
                        help="per site: the adaptive estimate at 2 bits against the truth (only that site "
                             "quantized); --rounding-seeds seeds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    known = {**CONFIGS, **kind_configs()}
    configs = site_configs(2, 8, args.sites_codec) if args.sites else {}
    for name in filter(None, args.methods.split(",")) if not args.sites else []:
        if name not in known:
            parser.error(f"unknown method {name!r}; choose from {list(known)}")
        configs[name] = known[name]
    if args.rounding_seeds > 1:
        configs = {f"{name}/{seed}": config.replace(seed=seed) for name, config in configs.items()
                   for seed in range(args.rounding_seeds)}
    all_archs = archs(args.attention)
    results = {}
    if args.leave_one_in:
        for name in args.archs.split(","):
            arch = all_archs[name] if name in all_archs else pretrained(name, args.pretrained_batch)
            results[name] = leave_one_in(arch, args.warmup, args.rounding_seeds)
        print(leave_one_in_table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"torch": torch.__version__, "args": vars(args), "leave_one_in": results}, f, indent=1)
        return
    for name in args.archs.split(","):
        arch = all_archs[name] if name in all_archs else pretrained(name, args.pretrained_batch)
        results[name] = measure(arch, configs, args.warmup, args.outliers, args.seed)
        print(f"{name}: " + "  ".join(f"{m} {r['cosine']:.4f}" for m, r in results[name].items()), flush=True)
    print(table(results))
    if args.rounding_seeds > 1:
        print(noise_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "args": vars(args), "hidden": HIDDEN, "layers": LAYERS,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
