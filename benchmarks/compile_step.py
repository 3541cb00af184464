"""torch.compile with DAF against compiled fp32 (issue 39): step time, activation memory, gradients.

python benchmarks/compile_step.py [--models resnet18,minilm] [--backend inductor] [--batch 32] [--small 8]
    [--steps 5] [--warmup 2] [--config bits=8,rounding=nearest] [--budget 0.5] [--no-rss]
    [--rss-variants plain,compile(wrap(m)),...] [--json FILE]

Variants, each a fresh model of the same initial weights:
- ``plain``: ``torch.compile(m)``, compiled fp32;
- ``compile(wrap(m))`` and ``wrap(compile(m))``: DAF with ``--config`` (``daf.wrap``'s default when empty);
- ``budget``: ``torch.compile(m)`` compiled under ``torch._functorch.config.activation_memory_budget=--budget``,
  compile's own trade of recomputation for memory (0 leaves it out).

Figures:
- step ms: median training step (forward, backward, SGD) at ``--batch``, all variants built in one process,
  warmed up (which compiles them), then timed in alternated rounds so that the machine's load hits them
  alike; ``x plain`` is the ratio of medians;
- held MiB: bytes the compiled functions hold for backward after one forward, parameters left out (exact);
- act. RSS MiB: the activation memory a process needs, as the peak RSS of a child process over two steps
  at ``--batch`` after warm-up (the peak reset once compiled: compiling peaks higher) minus that of one at
  ``--small`` (the same variant): the model, the compiler and the libraries cancel out;
- grad cos: cosine of all parameters' gradient of one step to ``plain``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import daf

from compile_graphs import held_bytes  # noqa: E402 - the benchmarks folder is on sys.path when run

VARIANTS = ("plain", "compile(wrap(m))", "wrap(compile(m))", "budget")


def _resnet(batch: int) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    from daf.workloads.resnet import ResNet18
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(1))
    return ResNet18(num_classes=10), lambda m: nn.functional.cross_entropy(m(x), y)


def _minilm(batch: int) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """all-MiniLM-L6's shape (6 layers, hidden 384, 12 heads, FFN 1536), fused attention, dropout on."""
    import transformers as tf
    config = tf.BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                           intermediate_size=1536, max_position_embeddings=512, num_labels=2,
                           attn_implementation="sdpa")
    ids = torch.randint(0, 30522, (batch, 128), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 2, (batch,), generator=torch.Generator().manual_seed(1))
    return tf.BertForSequenceClassification(config), lambda m: m(input_ids=ids, labels=labels).loss


MODELS = {"resnet18": _resnet, "minilm": _minilm}


class Variant:
    """One compiled model of ``name``'s variant, its loss, its parameters and an SGD optimizer."""

    def __init__(self, model_name: str, variant: str, batch: int, backend: str, config: dict[str, Any],
                 budget: float) -> None:
        torch.manual_seed(0)
        self.model, self.loss_of = MODELS[model_name](batch)
        self.model.train()
        self.params = list(self.model.parameters())
        self.variant, self.budget = variant, budget
        if variant == "compile(wrap(m))":
            self.compiled = torch.compile(daf.wrap(self.model, **config), backend=backend)
        elif variant == "wrap(compile(m))":
            self.compiled = daf.wrap(torch.compile(self.model, backend=backend), **config)
        else:
            self.compiled = torch.compile(self.model, backend=backend)
        self.optimizer = torch.optim.SGD(self.params, lr=1e-3)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        # read when the graphs are partitioned (the first call); a no-op afterwards
        with torch._functorch.config.patch(activation_memory_budget=self.budget if self.variant == "budget" else 1.0):
            self.loss_of(self.compiled).backward()
        self.optimizer.step()

    def gradient_and_held(self) -> tuple[torch.Tensor, int]:
        loss = self.loss_of(self.compiled)
        held = held_bytes(loss, self.params)
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        return torch.cat([g.flatten() for g in grads if g is not None]).double(), held


def measure(model_name: str, variants: list[str], args: argparse.Namespace, config: dict[str, Any]) -> list[dict]:
    built = {v: Variant(model_name, v, args.batch, args.backend, config, args.budget) for v in variants}
    first, compile_s = {}, {}
    for name, variant in built.items():  # the first call compiles; at the same initial weights for all
        start = time.perf_counter()
        torch.manual_seed(1)  # the same dropout masks
        with torch._functorch.config.patch(activation_memory_budget=args.budget if name == "budget" else 1.0):
            first[name] = variant.gradient_and_held()
        for _ in range(args.warmup):
            variant.step()
        compile_s[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.steps):
        for name, variant in built.items():
            start = time.perf_counter()
            variant.step()
            times[name].append(time.perf_counter() - start)
    reference = first["plain"][0]
    rows = []
    for name in variants:
        median = statistics.median(times[name])
        grad, held = first[name]
        wrapped = {"compile(wrap(m))": built[name].model, "wrap(compile(m))": built[name].compiled}.get(name)
        report = daf.report(wrapped) if wrapped is not None else None
        rows.append({"model": model_name, "variant": name, "batch": args.batch, "step_ms": round(median * 1e3, 1),
                     "x_plain": round(median / statistics.median(times["plain"]), 3),
                     "warmup_s": round(compile_s[name], 1), "held_MiB": round(held / 2**20, 2),
                     "grad_cos": round(float(nn.functional.cosine_similarity(grad, reference, dim=0)), 6),
                     "graph_ratio": round(report.ratio, 2) if report is not None else None,
                     "graph_bits": round(report.mean_code_bits, 2) if report is not None and report.mean_code_bits else None,
                     "all_ms": [round(t * 1e3, 1) for t in times[name]]})
    return rows


def child_peak_rss(model_name: str, variant: str, batch: int, args: argparse.Namespace) -> float:
    """Peak RSS (MiB) of a fresh process that runs ``variant`` at ``batch``: warm-up and two steps."""
    command = [sys.executable, __file__, "--child", model_name, variant, str(batch), "--backend", args.backend,
               "--config", args.config, "--budget", str(args.budget), "--warmup", str(args.warmup)]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def run_child(model_name: str, variant: str, batch: int, args: argparse.Namespace, config: dict[str, Any]) -> None:
    """Print the peak RSS (MiB) of two training steps after warm-up: compiling peaks higher than a step, so
    the peak is reset once the graphs are compiled (``/proc/self/clear_refs``; Linux)."""
    v = Variant(model_name, variant, batch, args.backend, config, args.budget)
    for _ in range(args.warmup):
        v.step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    for _ in range(2):
        v.step()
    with open("/proc/self/status") as f:
        peak_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(peak_kib / 1024)


def parse_config(text: str) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        config[key] = int(value) if value.isdigit() else value
    return config


def print_rows(rows: list[dict]) -> None:
    header = ("model", "variant", "step ms", "x plain", "held MiB", "act. RSS MiB", "x plain RSS", "grad cos",
              "graph ratio", "graph bits")
    print("  ".join(f"{h:>14}" for h in header))
    for r in rows:
        cells = (r["model"], r["variant"], r["step_ms"], r["x_plain"], r["held_MiB"], r.get("act_rss_MiB", "-"),
                 r.get("x_plain_rss", "-"), r["grad_cos"], r["graph_ratio"] or "-", r["graph_bits"] or "-")
        print("  ".join(f"{str(c):>14}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,minilm")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--small", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--config", default="", help="daf.wrap keywords, e.g. bits=8,rounding=nearest")
    parser.add_argument("--budget", type=float, default=0.5, help="activation_memory_budget; 0 leaves it out")
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--rss-variants", default=",".join(VARIANTS), help="the variants whose RSS is measured")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "VARIANT", "BATCH"), help=argparse.SUPPRESS)
    parser.add_argument("--json")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    config = {"audit": daf.Audit(every=0), **parse_config(args.config)}
    if args.child:
        run_child(args.child[0], args.child[1], int(args.child[2]), args, config)
        return
    variants = [v for v in VARIANTS if v != "budget" or args.budget]
    rows = []
    for model_name in args.models.split(","):
        model_rows = measure(model_name, variants, args, config)
        if not args.no_rss:
            for row in (r for r in model_rows if r["variant"] in args.rss_variants.split(",")):
                large = child_peak_rss(model_name, row["variant"], args.batch, args)
                small = child_peak_rss(model_name, row["variant"], args.small, args)
                row["act_rss_MiB"] = round(large - small, 1)
            plain = next(r["act_rss_MiB"] for r in model_rows if r["variant"] == "plain")
            for row in (r for r in model_rows if "act_rss_MiB" in r):
                row["x_plain_rss"] = round(row["act_rss_MiB"] / plain, 3) if plain > 0 else None
        rows.extend(model_rows)
        print_rows(model_rows)
        torch._dynamo.reset()
    print(f"\n{torch.get_num_threads()} threads; backend {args.backend}; batch {args.batch} (RSS: minus batch "
          f"{args.small}); median of {args.steps} alternated steps after {args.warmup} warm-up; config "
          f"{args.config or 'daf.wrap default'} (audit off)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
