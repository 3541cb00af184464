"""``daf.allocator`` on its own (an fp32 run that never wraps a model) and the allocator named in ``daf.report``."""

import json
import os
import subprocess
import sys
import textwrap

import torch

import daf
import daf.allocator
from daf.allocator.libraries import find_library


def test_the_package_exports_install_and_status():
    assert {"install", "status", "tensor_bytes", "release_free_memory", "AllocatorStatus"} <= set(daf.allocator.__all__)
    assert daf.allocator.install is daf.allocator.native.install


def test_an_fp32_run_uses_the_allocator_without_daf_wrap():
    code = textwrap.dedent("""
        import json, sys, torch
        import daf.allocator
        installed = daf.allocator.install()
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        model(torch.randn(32, 64)).square().mean().backward()   # plain fp32: no hooks, nothing wrapped
        counted = daf.allocator.tensor_bytes()
        print(json.dumps({"name": installed.name, "mode": installed.mode, "status": daf.allocator.status().name,
                          "allocations": counted.allocations if counted else None}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if find_library("tcmalloc") is None:  # the system's, said once in a warning naming the package to install
        assert result["name"] == "system" and "libtcmalloc" in done.stderr
    else:
        assert (result["name"], result["mode"], result["status"]) == ("tcmalloc", "in-process", "tcmalloc")
        assert result["allocations"] > 0  # the model's tensors came from it


def test_report_names_the_allocator_in_use():
    model = daf.wrap(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)), bits=4)
    model(torch.randn(32, 64)).square().mean().backward()
    report = daf.report(model)
    current = daf.allocator_status()
    assert report.sections["allocator"] == {"name": current.name, "mode": current.mode}
    assert f"allocator: name={current.name}, mode={current.mode}" in str(report)
    assert report.to_dict()["sections"]["allocator"]["name"] == current.name
