"""``daf.allocator`` on its own (an fp32 run that never wraps a model) and the allocator named in ``daf.report``."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import daf
import daf.allocator
from daf.allocator import shim
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


@pytest.mark.skipif(shim.installed_path() is None or find_library("tcmalloc") is None,
                    reason="no shim built at install (pip install --no-build-isolation), or no tcmalloc")
def test_the_shim_built_at_install_serves_without_a_compiler_or_a_cache(tmp_path):
    cache = tmp_path / "extensions"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CXX")}
    env.update(PATH=str(tmp_path), TORCH_EXTENSIONS_DIR=str(cache), PYTHONPATH=str(Path(daf.__file__).parents[1]))
    code = "import daf.allocator; print(daf.allocator.install().mode)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "in-process" and list(cache.iterdir()) == [], done.stderr[-2000:]


def test_a_shim_built_from_other_sources_is_not_used(monkeypatch):
    if shim.installed_path() is None:
        monkeypatch.setattr(shim, "installed_path", lambda: Path("/nonexistent/_shim.so"))
    monkeypatch.setattr(shim, "build_key", lambda: "k0000000000000000")
    assert daf.allocator.native._installed_library() is None
