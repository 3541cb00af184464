"""Process memory with and without DAF, measured in fresh subprocesses.

glibc keeps freed blocks cached in the heap, so RSS right after a forward also
counts memory that is free for reuse. The child calls ``malloc_trim(0)`` before
each reading so RSS reflects what live objects hold; the peak over a whole
training step is read too, untrimmed, and printed for the record but not asserted:
on a model this small it is set by the allocator's behaviour during forward (glibc
serves activations from the heap and small long-lived autograd allocations land in
the holes freed activations leave, so the heap grows in a staircase even when every
saved tensor is dropped), not by what DAF stores. Figures seen (ResNet-18 width 16,
batch 64, 2 bits, exact ReLU masks): held after forward fp32 75.1 MB, DAF 6.4 MB (11.7x); step peak
above start fp32 122 MB, DAF 133 MB. docs/memory.md has the full-size figures.
"""

import json
import subprocess
import sys
import textwrap

import pytest

import daf

CHILD = textwrap.dedent("""
    import ctypes, gc, json, resource, sys
    import torch, daf
    from daf.workloads.resnet import ResNet18
    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    def rss():
        gc.collect(); libc.malloc_trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    torch.manual_seed(0)
    model = ResNet18(width=16)
    x = torch.randn(64, 3, 32, 32)
    if sys.argv[1] == "daf":
        daf.wrap(model, bits=2)
    model(x).sum().backward()  # warm-up: allocator and autograd caches
    model.zero_grad()
    start = rss()
    loss = model(x).sum()
    held = rss() - start
    loss.backward()
    report = daf.report(model).to_dict()["totals"] if sys.argv[1] == "daf" else None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start
    print(json.dumps({"held": held, "peak": peak, "report": report}))
""")


def measure(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and calls glibc's malloc_trim")
def test_resnet_at_two_bits_holds_far_less_memory_after_forward():
    fp32, compressed = measure("fp32"), measure("daf")
    totals = compressed["report"]
    assert totals["raw_bytes"] >= 10 * totals["stored_bytes"]  # 11x: 2-bit codes plus exact ReLU masks
    # RSS held after forward drops by a factor comparable to the report's (activations are not all
    # there is: the autograd graph and BatchNorm's saved statistics stay raw).
    assert compressed["held"] * 8 <= fp32["held"], (fp32, compressed)
    print(f"held after forward: fp32 {fp32['held']} B, DAF {compressed['held']} B; "
          f"step peak: fp32 {fp32['peak']} B, DAF {compressed['peak']} B")
