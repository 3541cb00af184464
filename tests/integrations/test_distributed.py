"""DDP and FSDP2 (``torch.distributed.fsdp.fully_shard``) with DAF in either order, on two CPU processes over gloo.

FSDP2's parameters are DTensors, whose own storage raises "invalid python storage" when read; DAF finds a
parameter's storage through its local shard (``daf.tracing.storage_addresses``). The two ranks run in
a fresh interpreter (as torchrun starts them): inside pytest's process gloo once hung in its destructor
(tests/test_integrations.py, ``_run_alone``). Run alone, this file prints the figures of
docs/integrations.md: ``PYTHONPATH=src python tests/integrations/test_distributed.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

WORLD = 2
STEPS = 3


ARMS = ("ddp/daf_first", "ddp/daf_last", "fsdp2/daf_first", "fsdp2/daf_last")


def test_ddp_and_fsdp2_train_in_either_order_like_without_daf():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired:
        raise AssertionError("the ranks did not finish in 180 s (killed)") from None
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ARMS:
        arm = figures[name]
        assert arm["ranks_agree"], name       # every rank holds the same full gradient, step after step
        assert min(arm["cosine"]) >= 0.999, (name, arm["cosine"])
        assert arm["ratio"] > 2, (name, arm["ratio"])   # the activations were stored compressed
        assert arm["losses"][-1] < arm["losses"][0], name   # it trains


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 10))


def _distributed(arm: str) -> torch.nn.Module:
    """The model under DDP or FSDP2 (each Linear a unit, then the root), DAF wrapped first, last or not at all."""
    import daf
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    kind, order = arm.split("/")
    model = _model()
    if order == "daf_first":
        model = daf.wrap(model, bits=8, rounding="nearest")
    if kind == "ddp":
        model = DistributedDataParallel(model)
    else:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    if order == "daf_last":
        model = daf.wrap(model, bits=8, rounding="nearest")
    return model


def _full(gradient: torch.Tensor) -> torch.Tensor:
    """A gradient whole: FSDP2's are DTensors holding this rank's shard."""
    return gradient.full_tensor() if hasattr(gradient, "full_tensor") else gradient


def _train(arm: str, rank: int) -> dict:
    """STEPS of SGD on a batch of the rank's own; each step's full gradient (gathered from the shards) and loss."""
    import daf

    model = _distributed(arm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gradients, losses = [], []
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))
    for _ in range(STEPS):
        loss = model(x).square().mean()
        loss.backward()
        gradients.append(torch.cat([_full(p.grad).flatten() for p in model.parameters()]))
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    wrapped = model.module if arm == "ddp/daf_first" else model  # DDP(daf.wrap(model)): the inner one
    ratio = daf.report(wrapped).ratio if not arm.endswith("/plain") else 1.0
    return {"gradients": gradients, "losses": losses, "ratio": ratio}


def _rank(rank: int, store: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        runs = {arm: _train(arm, rank) for arm in ("ddp/plain", "fsdp2/plain", *ARMS)}
        figures = {}
        for arm in ARMS:
            gradients, plain = runs[arm]["gradients"], runs[arm.split("/")[0] + "/plain"]["gradients"]
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, [g.tolist() for g in gradients])
            cosine = [torch.nn.functional.cosine_similarity(g, p, dim=0).item() for g, p in zip(gradients, plain)]
            figures[arm] = {"ranks_agree": all(other == gathered[0] for other in gathered),
                            "cosine": cosine, "ratio": runs[arm]["ratio"], "losses": runs[arm]["losses"]}
        if rank == 0:
            print(json.dumps(figures))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    import daf

    # Forked ranks start in a second, spawned ones import torch again (10 s each on 2 busy cores). The parent
    # loads DAF's kernels once and runs no op, so no thread pool exists yet to be broken by the fork.
    torch.set_num_threads(1)
    daf.native_status()
    mp.start_processes(_rank, args=(tempfile.mktemp(),), nprocs=WORLD, start_method="fork")
