"""Importing daf stays lean: no heavy optional packages, no native build, no work at import time."""

import subprocess
import sys

CHILD = """
import sys, time
start = time.perf_counter()
import daf
elapsed = time.perf_counter() - start
heavy = [m for m in ("transformers", "peft", "matplotlib", "daf.kernels", "daf.workloads", "torch.utils.cpp_extension")
         if m in sys.modules]
print(repr((heavy, sorted(daf.__all__))))
"""


def test_import_daf_pulls_in_nothing_heavy():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    heavy, names = eval(out.stdout.strip().splitlines()[-1])
    assert heavy == []
    assert {"wrap", "unwrap", "compress", "report", "Config"} <= set(names)
