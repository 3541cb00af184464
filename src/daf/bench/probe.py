"""One probe of ``daf bench memory``, run as its own process: train a few steps of one method at one
batch size and print one JSON line (peak RSS, step times). ``python -m daf.bench.probe SPEC_JSON``."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

__all__ = ["run_probe"]


def run_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["steps"]`` steps of ``spec["method"]`` on ``spec["workload"]`` at ``spec["batch"]``."""
    from daf.allocator.native import install

    method = spec["method"]
    if method["allocator"] != "system":
        install(method["allocator"])  # before the first tensor, as daf.wrap would
    if method.get("decommit"):
        from daf.allocator.native import decommit_freed_memory
        decommit_freed_memory()
    import torch

    import daf
    from daf.bench.methods import checkpoint_blocks
    from daf.workloads import get_workload

    workload = get_workload(spec["workload"], **spec.get("options", {}))
    model = workload.build_model()
    blocks = checkpoint_blocks(model) if method["checkpoint"] else 0
    if method["daf"] is not None:
        daf.wrap(model, daf.Config.from_dict(method["daf"]), allocator=method["allocator"])
    if method["compile"]:  # after daf.wrap: torch.compile(daf.wrap(model)) compresses inside the graphs
        if method.get("compile_budget") is not None:
            import torch._functorch.config as functorch_config
            functorch_config.activation_memory_budget = method["compile_budget"]
        model = torch.compile(model)
    optimizer, schedule = workload.optimizer(model, spec["steps"])
    seconds = []
    for data in workload.batches(spec["batch"], spec["steps"]):
        start = time.perf_counter()
        loss = workload.loss(model, data)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if not torch.isfinite(loss.detach()):
            raise FloatingPointError(f"loss is {loss.item()}")
        del loss
        seconds.append(time.perf_counter() - start)
    from daf.workloads.measure import peak_rss_bytes  # here: torch only after the allocator
    return {"ok": True, "peak_rss_bytes": peak_rss_bytes(), "step_seconds": seconds, "blocks": blocks}


def main() -> int:
    spec = json.loads(sys.argv[1])
    result = run_probe(spec)
    print("DAF-PROBE " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
