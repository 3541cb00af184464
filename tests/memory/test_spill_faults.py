"""Spill faults: a failed read leaks nothing, and no spill directory outlives its process for long.

A failed read keeps its message, never the exception (whose traceback would hold backward's frames
and through them the graph, whose death is what releases the records). A process ended by SIGTERM
removes its directory; one ended by SIGKILL leaves it to the next store that starts under the same
parent, which removes only DAF's directories of dead processes.
"""

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

import daf
from daf.config import Config
from daf.format import Packed, payload_bytes
from daf.memory import PagedStore, SpillError, spilldir
from daf.memory.spill import SpillStore
from tests.models import SmallCNN
from tests.processes import descendants

PAGE = 4096
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


def _packed(numel: int, seed: int) -> Packed:
    """A 2-bit record of random bytes (the store never looks inside a payload)."""
    g = torch.Generator().manual_seed(seed)
    payload = torch.randint(0, 256, (payload_bytes(numel, 2, 256),), dtype=torch.uint8, generator=g)
    return Packed(payload, (numel,), (0,), torch.float32, 2, 256)


def _spill_files(parent: Path) -> list[Path]:
    return sorted(parent.glob(f"{spilldir.PREFIX}*/*.bin"))


def _damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[:-1])
    else:
        path.write_bytes(bytes([path.read_bytes()[0] ^ 0x10]) + path.read_bytes()[1:])


def _wait_for_reads(store: PagedStore) -> None:
    """A released record's read in flight frees its pages and file when it ends: let it end."""
    if store._worker is not None:
        store._worker.submit(lambda: None).result()  # the single worker runs reads in order


# -- a failed read --------------------------------------------------------------------------
class _Graph:
    """Stands in for autograd's graph: when it dies, its saved tensors release their records."""

    def __init__(self, store: PagedStore, refs: list[int]) -> None:
        self.store, self.refs = store, refs

    def __del__(self) -> None:
        for ref in self.refs:
            self.store.release(ref)


def _backward(graph: _Graph) -> None:
    """Take the records back in backward's order, releasing each once used, as autograd does."""
    while graph.refs:
        graph.store.get(graph.refs[-1])
        graph.store.release(graph.refs.pop())


@pytest.mark.parametrize("close_first", [False, True], ids=["prefetched", "read-at-get"])
@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_a_failed_read_names_the_site_and_file_and_the_step_leaks_nothing(tmp_path, how, close_first):
    originals = [_packed(16384, i) for i in range(8)]
    budget = 2 * -(-originals[0].payload.nbytes // PAGE) * PAGE
    store = PagedStore(Config(page_size=PAGE, budget=budget, min_bits=2, spill_dir=str(tmp_path)))
    expected = {"flip": r"corrupted on disk .*CRC-32 0x[0-9a-f]{8}, expected 0x[0-9a-f]{8}",
                "truncate": r"truncated on disk", "delete": r"is gone \(removed while training\?\)"}[how]
    for step in range(4):
        refs = [store.put(p, float(i), f"block{i}#{step}") for i, p in enumerate(originals)]
        for path in _spill_files(tmp_path):
            _damage(path, how)
        if close_first and step == 3:
            store.close()  # no worker: the read happens at get
        graph = _Graph(store, refs)
        with pytest.raises(SpillError, match=rf"DAF.*'block5#{step}'.*{expected}") as caught:
            _backward(graph)
        assert str(tmp_path) in str(caught.value)
        _wait_for_reads(store)
        store._check()
        assert all(r.failure is None or isinstance(r.failure, str) for r in store._records.values())
        gone = weakref.ref(graph)
        del graph, caught
        gc.collect()
        assert gone() is None  # nothing the store keeps holds the graph
        _wait_for_reads(store)
        stats = store.stats()
        assert stats["records"] == 0 and stats["bytes_in_use"] == 0 and stats["pool_in_use_bytes"] == 0
        assert _spill_files(tmp_path) == [] and store._spill.files == 0
        store._check()
    store.close()
    assert os.listdir(tmp_path) == []


def test_training_steps_with_a_damaged_spill_file_do_not_accumulate_records_files_or_graphs(tmp_path):
    torch.manual_seed(0)
    model = daf.wrap(SmallCNN(), bits=2, page_size=PAGE, budget="32KiB", spill_dir=str(tmp_path))
    store = daf.session_of(model).store
    x = torch.randn(8, 3, 32, 32)
    for step in range(3):
        loss = model(x).sum()
        assert _spill_files(tmp_path)
        for path in _spill_files(tmp_path):
            _damage(path, "flip")
        with pytest.raises(SpillError, match=r"DAF: spilled activation '.*' is corrupted on disk"):
            loss.backward()
        gone = weakref.ref(loss)
        del loss
        gc.collect()
        assert gone() is None
        _wait_for_reads(store)
        assert store.stats()["records"] == 0 and _spill_files(tmp_path) == []
    model(x).sum().backward()  # and the next clean step trains
    assert store.stats()["records"] == 0


# -- the directory: marker, SIGTERM, SIGKILL, the sweep -------------------------------------
CHILD = textwrap.dedent("""
    import signal, sys, time, torch
    from daf.config import Config
    from daf.format import Packed, payload_bytes
    from daf.memory import PagedStore
    if sys.argv[2] == "raising":  # the program's own handler: SystemExit, the directory goes at exit
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(3))
    store = PagedStore(Config(page_size=4096, budget=8192, min_bits=2, spill_dir=sys.argv[1]))
    payload = torch.zeros(payload_bytes(16384, 2, 256), dtype=torch.uint8)
    for i in range(4):
        store.put(Packed(payload, (16384,), (0,), torch.float32, 2, 256), float(i), f"s#{i}")
    print(store._spill.directory, flush=True)
    time.sleep(120)
""")


class _Child:
    """A process that spills under ``parent`` and sleeps; killed, with anything it started, on exit."""

    def __init__(self, parent: Path, mode: str = "default") -> None:
        self.process = subprocess.Popen([sys.executable, "-c", CHILD, str(parent), mode], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=ENV)

    def __enter__(self) -> "_Child":
        try:
            self.directory = Path(self.process.stdout.readline().strip())
            assert self.directory.name.startswith(f"{spilldir.PREFIX}{self.process.pid}-"), self.process.stderr.read()
            assert list(self.directory.glob("*.bin")) and (self.directory / spilldir.MARKER).is_file()
        except BaseException:
            self.__exit__()
            raise
        return self

    def end(self, signum: int) -> int:
        self.process.send_signal(signum)
        return self.process.wait(timeout=60)

    def __exit__(self, *exc) -> None:
        for pid in [*descendants(self.process.pid), self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=60)
        self.process.stdout.close()
        self.process.stderr.close()


@pytest.mark.parametrize("mode, status", [("default", -signal.SIGTERM), ("raising", 3)])
def test_sigterm_removes_the_spill_directory_and_still_ends_the_process(tmp_path, mode, status):
    with _Child(tmp_path, mode) as child:
        assert child.end(signal.SIGTERM) == status  # the default disposition's status, or the program's own
        assert not child.directory.exists() and os.listdir(tmp_path) == []


def test_sigkill_leaves_the_directory_and_the_next_store_removes_it_but_not_a_live_ones(tmp_path):
    mine = spilldir.create(str(tmp_path))  # this process's: it runs
    try:
        with _Child(tmp_path) as live, _Child(tmp_path) as killed:
            assert killed.end(signal.SIGKILL) == -signal.SIGKILL
            assert killed.directory.exists()  # nothing could run
            store = PagedStore(Config(page_size=PAGE, budget=8 * PAGE, spill_dir=str(tmp_path)))
            assert store._spill.swept == [str(killed.directory)]
            assert not killed.directory.exists() and live.directory.exists() and os.path.isdir(mine)
            assert live.end(signal.SIGKILL) == -signal.SIGKILL
            assert SpillStore(str(tmp_path)).swept == [str(live.directory)] and os.path.isdir(mine)
            store.close()
    finally:
        spilldir.remove(mine)


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def _fake(parent: Path, name: str, marker: object | None) -> Path:
    path = parent / name
    path.mkdir()
    if marker is not None:
        (path / spilldir.MARKER).write_text(marker if isinstance(marker, str) else json.dumps(marker))
    (path / "0.bin").write_bytes(b"activations")
    return path


def test_the_sweep_removes_only_daf_directories_of_dead_processes(tmp_path):
    dead = _dead_pid()
    identity = spilldir._identity(dead)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = _fake(elsewhere, f"{spilldir.PREFIX}{dead}-target", identity)
    parent = tmp_path / "spill"
    parent.mkdir()
    stale = _fake(parent, f"{spilldir.PREFIX}{dead}-stale", identity)
    parent_pid = os.getppid()  # runs; a marker with another start time is a reused pid
    reused = _fake(parent, f"{spilldir.PREFIX}{parent_pid}-reused",
                   {**identity, "pid": parent_pid, "start": spilldir.start_time(parent_pid) + 1})
    kept = [
        _fake(parent, f"{spilldir.PREFIX}{dead}-nomarker", None),  # being created, or not DAF's
        _fake(parent, f"{spilldir.PREFIX}{dead}-garbage", "not json"),
        _fake(parent, f"{spilldir.PREFIX}{dead}-other", {**identity, "daf": "other"}),
        _fake(parent, f"{spilldir.PREFIX}{dead}-host", {**identity, "host": "another-machine"}),
        _fake(parent, f"{spilldir.PREFIX}{dead}-boot", {**identity, "boot": "before-a-reboot"}),
        _fake(parent, f"{spilldir.PREFIX}{dead}-pidns", {**identity, "pidns": "pid:[1]"}),
        _fake(parent, f"{spilldir.PREFIX}{dead + 1}-name", identity),  # the name and the marker disagree
        _fake(parent, f"{spilldir.PREFIX}x-{dead}", identity),
        _fake(parent, f"daf-spilled-{dead}-similar", identity),
        _fake(parent, f"{spilldir.PREFIX}{parent_pid}-running",
              {**identity, "pid": parent_pid, "start": spilldir.start_time(parent_pid)}),
    ]
    (parent / f"{spilldir.PREFIX}{dead}-file").write_text(json.dumps(identity))
    (parent / f"{spilldir.PREFIX}{dead}-link").symlink_to(target)
    kept += [parent / f"{spilldir.PREFIX}{dead}-file", parent / f"{spilldir.PREFIX}{dead}-link"]
    assert sorted(spilldir.sweep_stale(str(parent))) == sorted([str(stale), str(reused)])
    assert not stale.exists() and not reused.exists()
    assert all(path.exists() for path in kept) and (target / "0.bin").exists()
    assert spilldir.sweep_stale(str(tmp_path / "missing")) == []


def test_the_sigterm_handler_goes_only_over_the_default_from_the_main_thread():
    check = textwrap.dedent("""
        import signal, threading
        from daf.memory import spilldir
        from daf.memory.spill import SpillStore
        mine = lambda signum, frame: None
        signal.signal(signal.SIGTERM, mine)
        SpillStore()
        assert signal.getsignal(signal.SIGTERM) is mine  # the program's own handler stays
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        SpillStore()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # the program means to survive SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        thread = threading.Thread(target=SpillStore)
        thread.start(); thread.join()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # not from another thread
        SpillStore(); SpillStore()
        assert signal.getsignal(signal.SIGTERM) is spilldir._on_sigterm
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_forked_child_does_not_remove_its_parents_directory(tmp_path):
    path = spilldir.create(str(tmp_path))
    spilldir.remove(path, owner=os.getpid() + 1)  # what the finalizer does in a child that exits
    assert os.path.isdir(path)
    spilldir.remove(path, owner=os.getpid())
    assert not os.path.exists(path)
