"""The spill store: bit-exact round trip, private files, corruption caught, full disk, clean-up."""

import errno
import gc
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from daf.memory import SpillError
from daf.memory import spill as spill_module
from daf.memory import spilldir
from daf.memory.spill import SpillStore

ROOT = Path(__file__).resolve().parents[2]


def _random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_round_trip_is_bit_exact_across_segments(tmp_path):
    store = SpillStore(str(tmp_path))
    segments = [_random_bytes(n, n) for n in (1, 4096, 70001, 0, 3)]
    handle = store.write(0, segments, "layer#0")
    assert handle.nbytes == sum(s.numel() for s in segments)
    assert torch.equal(store.read(handle, "layer#0"), torch.cat(segments))
    outs = [torch.empty(n, dtype=torch.uint8) for n in (5000, handle.nbytes - 5000)]
    store.read_into(handle, outs, "layer#0")
    assert torch.equal(torch.cat(outs), torch.cat(segments))


def test_directory_and_files_are_private(tmp_path):
    store = SpillStore(str(tmp_path))
    handle = store.write(3, [_random_bytes(10)], "s#0")
    assert stat.S_IMODE(os.stat(store.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(handle.path).st_mode) == 0o600
    assert Path(store.directory).parent == tmp_path


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_a_damaged_record_is_detected_and_names_the_site(tmp_path, damage):
    store = SpillStore(str(tmp_path))
    handle = store.write(0, [_random_bytes(10000)], "encoder.block3#2")
    data = bytearray(Path(handle.path).read_bytes())
    if damage == "flip":
        data[1234] ^= 0x10
    elif damage == "truncate":
        data = data[:-1]
    else:
        data += b"\0"
    Path(handle.path).write_bytes(bytes(data))
    with pytest.raises(SpillError, match=r"encoder\.block3#2"):
        store.read(handle, "encoder.block3#2")


def test_a_full_disk_raises_a_clear_error_and_leaves_no_partial_file(tmp_path, monkeypatch):
    store = SpillStore(str(tmp_path))
    store.write(0, [_random_bytes(10)], "a#0")

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spill_module, "_write_all", full)
    with pytest.raises(SpillError, match=r"no space left.*'b#1'.*Config.spill_dir") as caught:
        store.write(1, [_random_bytes(10)], "b#1")
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    assert sorted(os.listdir(store.directory)) == ["0.bin", spilldir.MARKER]


def test_directory_is_removed_on_close_and_when_the_store_is_collected(tmp_path):
    store = SpillStore(str(tmp_path))
    store.write(0, [_random_bytes(10)], "a#0")
    directory = store.directory
    store.close()
    assert not os.path.exists(directory)
    store = SpillStore(str(tmp_path))
    store.write(0, [_random_bytes(10)], "a#0")
    directory = store.directory
    del store
    gc.collect()
    assert not os.path.exists(directory)


def test_directory_is_removed_when_the_process_exits_after_an_exception(tmp_path):
    child = textwrap.dedent(f"""
        import sys, torch
        from daf.memory.spill import SpillStore
        store = SpillStore({str(tmp_path)!r})
        store.write(0, [torch.zeros(10, dtype=torch.uint8)], "a#0")
        print(store.directory, flush=True)
        raise RuntimeError("training crashed")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "training crashed" in out.stderr
    assert not os.path.exists(out.stdout.strip())
    assert os.listdir(tmp_path) == []


def test_spill_dir_must_exist(tmp_path):
    store = SpillStore(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="Config.spill_dir must be an existing directory"):
        store.write(0, [_random_bytes(1)], "a#0")


def test_a_directory_removed_while_training_is_made_again_for_the_next_spill(tmp_path):
    """Issue 42: every later write failed. A record spilled to the old directory says its file is gone."""
    store = SpillStore(str(tmp_path))
    lost = store.write(0, [_random_bytes(100)], "a#0")
    first = store.directory
    spilldir.remove(first)
    handle = store.write(1, [_random_bytes(100, 1)], "b#0")
    assert store.directory != first and os.path.isdir(store.directory) and not os.path.exists(first)
    assert torch.equal(store.read(handle, "b#0"), _random_bytes(100, 1))
    with pytest.raises(SpillError, match="'a#0'.*is gone"):
        store.read(lost, "a#0")
    directory = store.directory
    store.close()
    assert not os.path.exists(directory)
