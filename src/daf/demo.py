"""A short demo: ResNet-18 (width 16) on Fashion-MNIST, trained with and without DAF.

Each arm runs in its own process so that peak memory is measured honestly.
``python -m daf.demo [--steps 100] [--bits 2]``
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

__all__ = ["main"]


def _train(arm: str, steps: int, bits: int, batch: int) -> dict:
    import daf
    from daf.workloads.fashion_mnist import load_fashion_mnist
    from daf.workloads.resnet import ResNet18

    torch.manual_seed(0)
    images, labels = load_fashion_mnist("train")
    test_images, test_labels = load_fashion_mnist("test")
    model = ResNet18(num_classes=10, in_channels=1, width=16)
    if arm == "daf":
        daf.wrap(model, bits=bits)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    times, losses = [], []
    for step in range(steps):
        index = order[(step * batch) % len(order):][:batch]
        start = time.perf_counter()
        loss = F.cross_entropy(model(images[index]), labels[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        predictions = torch.cat([model(test_images[i:i + 500]).argmax(1) for i in range(0, 2000, 500)])
    result = {"arm": arm, "accuracy": float((predictions == test_labels[:2000]).float().mean()),
              "final_loss": statistics.mean(losses[-10:]),
              "step_ms": 1000 * statistics.median(times[min(3, steps - 1):]),
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if arm == "daf":
        report = daf.report(model)
        result.update(raw_mib=report.raw_bytes / 2**20, stored_mib=report.stored_bytes / 2**20)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m daf.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--bits", type=int, default=2, choices=(1, 2, 4, 8))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--arm", choices=("fp32", "daf"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm:
        print(json.dumps(_train(args.arm, args.steps, args.bits, args.batch)))
        return 0
    results = {}
    for arm in ("fp32", "daf"):
        print(f"training {arm} for {args.steps} steps ...", flush=True)
        out = subprocess.run([sys.executable, "-m", "daf.demo", "--arm", arm, "--steps", str(args.steps),
                              "--bits", str(args.bits), "--batch", str(args.batch)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        results[arm] = json.loads(out.stdout.strip().splitlines()[-1])
    fp32, compressed = results["fp32"], results["daf"]
    print(f"\nResNet-18 (width 16) on Fashion-MNIST, {args.steps} steps of batch {args.batch}, DAF at {args.bits} bits")
    print(f"{'':22}{'fp32':>12}{'DAF':>12}")
    print(f"{'test accuracy (2000)':22}{fp32['accuracy']:>12.4f}{compressed['accuracy']:>12.4f}")
    print(f"{'final train loss':22}{fp32['final_loss']:>12.4f}{compressed['final_loss']:>12.4f}")
    print(f"{'activations (MiB)':22}{compressed['raw_mib']:>12.2f}{compressed['stored_mib']:>12.2f}"
          f"   ({compressed['raw_mib'] / compressed['stored_mib']:.1f}x smaller)")
    print(f"{'peak RSS (MiB)':22}{fp32['peak_rss_mib']:>12.1f}{compressed['peak_rss_mib']:>12.1f}")
    print(f"{'median step (ms)':22}{fp32['step_ms']:>12.1f}{compressed['step_ms']:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
