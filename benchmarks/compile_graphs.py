"""torch.compile under DAF (issue 39): graphs, graph breaks, the bytes compiled graphs hold, gradient cosine.

python benchmarks/compile_graphs.py [--models resnet18,bert] [--steps 3] [--bits 8] [--json FILE]

For each model (random init, dropout off) and each order (plain ``torch.compile(m)``,
``torch.compile(daf.wrap(m))``, ``daf.wrap(torch.compile(m))``):

- dynamo with ``CompileCounter`` as backend over ``--steps`` training steps: frames compiled (graphs plus
  recompiles), ops in them, graph breaks (``torch._dynamo.utils.counters["graph_break"]``);
- the same through AOTAutograd (``aot_eager``: inductor's graphs without C++): the bytes the compiled
  functions hold for backward after one forward, parameters left out, and the cosine of the parameters'
  gradient to the plain compiled one.

No timings (graph counts and bytes do not depend on the machine's load). Run it against an older
checkout with ``PYTHONPATH=<old>/src`` for the "before" figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import daf
from daf.workloads.resnet import ResNet18

ORDERS = ("plain", "compile(wrap(m))", "wrap(compile(m))")


def _resnet() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(1))
    return ResNet18(num_classes=10, width=16), lambda m: nn.functional.cross_entropy(m(x), y)


def _bert() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    import transformers as tf
    config = tf.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                           intermediate_size=512, max_position_embeddings=128, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, num_labels=2)
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 0, 1])
    return tf.BertForSequenceClassification(config), lambda m: m(input_ids=ids, labels=labels).loss


MODELS = {"resnet18": _resnet, "bert": _bert}


def _compiled(model: nn.Module, order: str, backend: Any, bits: int) -> nn.Module:
    if order == "plain":
        return torch.compile(model, backend=backend)
    if order == "compile(wrap(m))":
        return torch.compile(daf.wrap(model, bits=bits, rounding="nearest"), backend=backend)
    return daf.wrap(torch.compile(model, backend=backend), bits=bits, rounding="nearest")


def graphs(make: Callable, order: str, steps: int, bits: int) -> dict[str, int]:
    """Frames compiled, ops and graph breaks over ``steps`` training steps under ``CompileCounter``."""
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounter()
    torch.manual_seed(0)
    model, loss_of = make()
    model = _compiled(model, order, counter, bits)
    for _ in range(steps):
        loss_of(model).backward()
    return {"frames": counter.frame_count, "ops": counter.op_count,
            "graph_breaks": sum(counters["graph_break"].values())}


def held_bytes(loss: torch.Tensor, parameters: list[torch.Tensor]) -> int:
    """Bytes the compiled functions behind ``loss`` hold for backward (packed saves included), but for the
    parameters, which they hold too and which live on anyway."""
    weights = {p.untyped_storage().data_ptr() for p in parameters}
    seen, total, nodes = set(), 0, [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in type(node).__name__:
            total += sum(t.nbytes for t in node.saved_tensors if t.untyped_storage().data_ptr() not in weights)
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return total


def through_aot(make: Callable, order: str, bits: int) -> tuple[int, torch.Tensor]:
    """(bytes held after a forward, the parameters' gradient) of one step through ``aot_eager``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, loss_of = make()
    params = list(model.parameters())
    loss = loss_of(_compiled(model, order, "aot_eager", bits))
    held = held_bytes(loss, params)
    return held, torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]).double()


def run(names: list[str], steps: int, bits: int) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        _, reference = through_aot(MODELS[name], "plain", bits)
        for order in ORDERS:
            row = {"model": name, "order": order, **graphs(MODELS[name], order, steps, bits)}
            held, grad = through_aot(MODELS[name], order, bits)
            row["held_MiB"] = round(held / 2**20, 3)
            row["grad_cosine"] = round(float(nn.functional.cosine_similarity(grad, reference, dim=0)), 6)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,bert")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rows = run(args.models.split(","), args.steps, args.bits)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
