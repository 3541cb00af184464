"""DAF's in-process CPU allocator (daf.allocator.native and csrc/allocator.cpp).

Installing it is process-wide and cached, so every test that installs runs in a child process
(``sys.executable -c``) that prints one ``RESULT {json}`` line.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import daf
from daf.allocator.libraries import INSTALL_HINTS, find_library
from daf.allocator.native import (AllocatorStatus, TensorBytes, install, preloaded, status, tensor_bytes,
                                  transparent_huge_pages)

TCMALLOC = find_library("tcmalloc")
needs_tcmalloc = pytest.mark.skipif(TCMALLOC is None,
                                    reason="tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
MIB = 1 << 20

_PRELUDE = """
import json, sys, warnings
def emit(**values):
    print("RESULT " + json.dumps(values), flush=True)
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(extra)
    return env


def _start(code, env=None):
    return subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or _env())


def _finish(process, timeout=120):
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, f"child exited {process.returncode}:\n{err[-3000:]}"
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len("RESULT "):])


def _child(code, env=None):
    return _finish(_start(code, env))


# --- in this process: only what installs nothing ---------------------------------------------------

def test_public_status_functions_exist_and_have_their_types():
    assert isinstance(daf.allocator_status(), AllocatorStatus)
    assert daf.allocator_status().mode in ("in-process", "preloaded", "system")
    assert isinstance(daf.native_status(), str) and daf.native_status()
    assert {"allocator_status", "native_status"} <= set(daf.__all__)


def test_unknown_name_raises_and_installs_nothing():
    before = status()
    with pytest.raises(ValueError, match="'bogus'"):
        install("bogus")
    assert status() == before


def test_tensor_bytes_is_none_unless_installed_in_process():
    if status().mode != "in-process":
        assert tensor_bytes() is None
    else:  # another test of this session wrapped a model
        assert isinstance(tensor_bytes(), TensorBytes)


# --- in child processes ----------------------------------------------------------------------------

def test_fresh_process_is_on_the_system_allocator():
    result = _child("""
        from daf.allocator.native import status, preloaded, tensor_bytes
        import torch
        torch.ones(1000)
        s = status()
        emit(mode=s.mode, name=s.name, path=s.path, preloaded=preloaded() is None, bytes=tensor_bytes() is None)
    """)
    assert result == {"mode": "system", "name": "system", "path": None, "preloaded": True, "bytes": True}


@needs_tcmalloc
def test_install_auto_makes_tcmalloc_the_cpu_allocator():
    result = _child("""
        from daf.allocator.native import install, status
        import torch
        returned = install("auto")
        again = install("auto")
        emit(returned=returned.__dict__, status=status().__dict__, same=returned is again)
    """)
    assert result["returned"] == result["status"]
    assert result["status"]["mode"] == "in-process" and result["status"]["name"] == "tcmalloc"
    assert result["status"]["path"] == TCMALLOC
    assert result["same"]


@needs_tcmalloc
def test_tensor_bytes_follow_a_64_mib_tensor_and_reset_peak():
    result = _child("""
        from daf.allocator.native import install, tensor_bytes
        import torch
        install("auto")
        start = tensor_bytes()
        x = torch.ones(16 << 20)  # 64 MiB of float32
        held = tensor_bytes()
        x.add_(1)
        assert bool((x == 2).all())
        del x
        freed = tensor_bytes(reset_peak=True)
        after_reset = tensor_bytes()
        y = torch.ones(1 << 20)  # 4 MiB
        small = tensor_bytes()
        emit(start=start.__dict__, held=held.__dict__, freed=freed.__dict__, after_reset=after_reset.__dict__,
             small=small.__dict__)
    """)
    start, held, freed, after, small = (result[k] for k in ("start", "held", "freed", "after_reset", "small"))
    assert held["live_bytes"] - start["live_bytes"] >= 64 * MIB
    assert held["allocations"] > start["allocations"]
    assert held["peak_bytes"] >= held["live_bytes"]
    assert freed["live_bytes"] <= held["live_bytes"] - 64 * MIB
    assert freed["frees"] > held["frees"]
    assert freed["peak_bytes"] >= held["live_bytes"]  # read before the reset
    assert after["peak_bytes"] == after["live_bytes"] < 64 * MIB  # the reset: peak is what is live now
    assert small["live_bytes"] - after["live_bytes"] >= 4 * MIB
    assert small["peak_bytes"] >= small["live_bytes"] and small["peak_bytes"] < 64 * MIB


@needs_tcmalloc
def test_tensor_allocated_before_install_keeps_its_values_and_its_deleter():
    result = _child("""
        from daf.allocator.native import install, tensor_bytes
        import torch
        old = torch.arange(4 << 20, dtype=torch.float64)  # 32 MiB from the system allocator
        install("auto")
        fresh = torch.arange(4 << 20, dtype=torch.float64)  # from tcmalloc
        intact = bool(torch.equal(old, fresh))
        before = tensor_bytes()
        del old  # freed by c10's own deleter, not the library's
        after = tensor_bytes()
        fresh.mul_(2)
        emit(intact=intact, before=before.__dict__, after=after.__dict__, total=float(fresh.sum()))
    """)
    assert result["intact"]
    assert result["after"]["live_bytes"] == result["before"]["live_bytes"]
    assert result["after"]["frees"] == result["before"]["frees"]
    n = 4 << 20
    assert result["total"] == float(n * (n - 1))


_TRAINING_STEP = """
    import hashlib, torch
    from torch import nn
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.grad.numpy().tobytes())
    from daf.allocator.native import status, tensor_bytes
    figures = tensor_bytes()
    emit(loss=loss.item(), grads=digest.hexdigest(), mode=status().mode,
         allocations=figures.allocations if figures else 0)
"""


@needs_tcmalloc
def test_training_step_is_bit_identical_with_and_without_the_allocator():
    installed = _start("from daf.allocator.native import install\ninstall('auto')\n" + textwrap.dedent(_TRAINING_STEP))
    plain = _start(_TRAINING_STEP)
    with_allocator, without = _finish(installed), _finish(plain)
    assert with_allocator["mode"] == "in-process" and with_allocator["allocations"] > 10
    assert without["mode"] == "system"
    assert with_allocator["loss"] == without["loss"]
    assert with_allocator["grads"] == without["grads"]


@needs_tcmalloc
def test_wrap_installs_the_allocator():
    result = _child("""
        import torch, daf
        before = daf.allocator_status().mode
        model = daf.wrap(torch.nn.Linear(8, 8))
        model(torch.randn(4, 8)).sum().backward()
        from daf.allocator.native import tensor_bytes
        emit(before=before, after=daf.allocator_status().__dict__, counted=tensor_bytes().allocations)
    """)
    assert result["before"] == "system"
    assert result["after"]["mode"] == "in-process" and result["after"]["name"] == "tcmalloc"
    assert result["counted"] > 0


@needs_tcmalloc
@pytest.mark.parametrize("preload", [False, True])
def test_config_decommit_makes_tcmalloc_give_freed_memory_back(preload):
    """In-process and preloaded alike: the property is set, and a freed 64 MiB block leaves RSS at once
    (without it tcmalloc keeps it for reuse)."""
    result = _child("""
        import torch, daf
        from daf.allocator.native import decommits
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        before = decommits()
        model = daf.wrap(torch.nn.Linear(8, 8), decommit=True)
        block = torch.ones(64 << 20, dtype=torch.uint8)
        held = rss()
        del block
        emit(before=before, after=decommits(), released=held - rss(), mode=daf.allocator_status().mode)
    """, env=_env(LD_PRELOAD=TCMALLOC) if preload else None)
    assert result["mode"] == ("preloaded" if preload else "in-process")
    assert result["before"] is False and result["after"] is True
    assert result["released"] > 48 * MIB


def _without_huge_page_switch(**extra):
    env = _env(**extra)
    if "THP_MEM_ALLOC_ENABLE" not in extra:
        env.pop("THP_MEM_ALLOC_ENABLE", None)
    return env


@needs_tcmalloc
@pytest.mark.skipif(transparent_huge_pages() != "madvise", reason="needs transparent huge pages on 'madvise'")
def test_config_decommit_puts_large_tensors_in_huge_pages():
    """In-process: a 64 MiB tensor is in 4 KiB pages before and mostly in 2 MiB pages after
    (the kernel grants them only to advised memory in this mode)."""
    result = _child("""
        import re, torch, daf
        from daf.allocator.native import huge_pages
        def huge():
            return int(re.search(r"AnonHugePages:\\s+(\\d+) kB", open("/proc/self/smaps_rollup").read())[1]) << 10
        daf.wrap(torch.nn.Linear(8, 8))
        first = torch.ones(64 << 20, dtype=torch.uint8)
        before, advised_before = huge(), huge_pages()
        daf.wrap(torch.nn.Linear(8, 8), decommit=True)
        second = torch.ones(64 << 20, dtype=torch.uint8)
        emit(before=before, after=huge(), advised=[advised_before, huge_pages()], mode=daf.allocator_status().mode,
             same=bool((second == first).all()))
    """, env=_without_huge_page_switch())
    assert result["mode"] == "in-process" and result["advised"] == [False, True] and result["same"]
    assert result["before"] < 2 * MIB
    assert result["after"] - result["before"] >= 32 * MIB


@needs_tcmalloc
@pytest.mark.parametrize("switch", [None, "0", "1"])
def test_pytorch_huge_page_switch_is_kept_by_the_in_process_allocator(switch):
    result = _child("""
        import torch, daf
        from daf.allocator.native import huge_pages
        daf.wrap(torch.nn.Linear(8, 8))
        block = torch.ones(64 << 20, dtype=torch.uint8)  # a large block: it follows the switch too
        smaps = open("/proc/self/smaps_rollup").read()
        in_huge = int(smaps.split("AnonHugePages:")[1].split()[0]) << 10
        emit(mode=daf.allocator_status().mode, huge=huge_pages(), in_huge=in_huge)
    """, env=_without_huge_page_switch(**({} if switch is None else {"THP_MEM_ALLOC_ENABLE": switch})))
    assert result["mode"] == "in-process" and result["huge"] == (switch == "1")
    if transparent_huge_pages() == "madvise":  # only advised memory gets huge pages
        assert (result["in_huge"] >= 32 * MIB) == (switch == "1")


# --- large blocks: kept memory moved between sizes (csrc/allocator.cpp) ---------------------------

_LARGE_COUNTERS = """
import ctypes
from daf.allocator.native import _library
def counters():
    out = (ctypes.c_uint64 * 7)()
    _library().daf_allocator_large_counters(out)
    return dict(zip(["whole", "moved", "moves", "fresh", "kept", "live", "given"], out))
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
"""


def _large_child(code):
    return _child(_LARGE_COUNTERS + textwrap.dedent(code))


def _random_large_blocks(seed, release):
    """Random sizes (not multiples of anything) allocated and freed in a random order, half of them
    written only after the next block is freed (its pages may move in); with `release`, kept memory is
    unmapped now and then, so that blocks take new memory and freed pages move into them."""
    return _large_child(f"""
        import random, torch, daf, daf.allocator.native
        from daf.allocator.native import LARGE_BLOCKS_FROM
        daf.wrap(torch.nn.Linear(8, 8))
        rng = random.Random({seed})
        grain = 64 << 10
        live, live_bytes, most, bad = {{}}, 0, 0, []
        # 251 bytes over and over, from a place that depends on the key: a page in the wrong place
        # shows. Views of one tensor, so that writing and checking allocate nothing large.
        cycle = torch.arange(251, dtype=torch.uint8).repeat((8 * LARGE_BLOCKS_FROM + 4321 * 1004) // 251 + 2)
        def pattern(n, key):
            return cycle[key % 251:key % 251 + n]
        def check(key):
            tensor = live[key][0]
            if not torch.equal(tensor, pattern(tensor.numel(), key)):
                bad.append(key)
        def free(key):
            global live_bytes
            live_bytes -= live.pop(key)[1]
        def check_and_free(key):
            check(key)
            free(key)
        for key in range(160):
            victim = None
            if live and (len(live) > 6 or rng.random() < 0.45):
                victim = rng.choice(list(live))
                check(victim)
            if rng.random() < {release}:  # kept memory unmapped: the next block takes new memory
                daf.allocator.native.release_free_memory()
            n = rng.randrange(LARGE_BLOCKS_FROM, 5 * LARGE_BLOCKS_FROM)
            tensor = torch.empty(n, dtype=torch.uint8)
            late = rng.random() < 0.5  # written only after the victim is freed: its pages may move in
            if not late:
                tensor.copy_(pattern(n, key))
            live[key] = (tensor, -(-n // grain) * grain)
            live_bytes += live[key][1]
            most = max(most, live_bytes)
            if victim is not None:
                free(victim)
            if late:
                tensor.copy_(pattern(n, key))
        del tensor
        for key in list(live):
            check_and_free(key)
        # many kept blocks smaller than the next one: it is assembled from several of them
        small = [torch.empty(LARGE_BLOCKS_FROM + 12345 * i, dtype=torch.uint8) for i in range(24)]
        del small
        for key in range(1000, 1004):
            n = 7 * LARGE_BLOCKS_FROM + 4321 * key
            live[key] = (torch.empty(n, dtype=torch.uint8).copy_(pattern(n, key)), 0)
        for key in list(live):
            check_and_free(key)
        del cycle
        emit(bad=bad, most=most, peak=daf.allocator.native.tensor_bytes().peak_bytes, **counters())
    """)


@needs_tcmalloc
@pytest.mark.parametrize("seed", [0, 1])
def test_large_blocks_keep_every_value_and_stay_within_the_most_ever_live(seed):
    """Every tensor holds what was written into it, page order included, when it is freed, while kept
    memory is handed out whole and moved between sizes; and the new memory the blocks ever took is no
    more than the most that was live at once (rounded to 64 KiB per block): nothing kept goes unused."""
    result = _random_large_blocks(seed, release=0.0)
    assert result["bad"] == []
    assert result["whole"] + result["moves"] > 0 and result["moved"] > 0  # both ways of reuse ran
    # the peak counts every tensor alive at once, the checks' temporaries too
    assert result["most"] <= result["peak"] and result["fresh"] <= result["peak"]
    assert result["live"] == 0 and result["kept"] == result["fresh"]


@needs_tcmalloc
@pytest.mark.parametrize("seed", [0, 1])
def test_freed_pages_moved_into_untouched_blocks_keep_every_value(seed):
    result = _random_large_blocks(seed, release=0.15)
    assert result["bad"] == [] and result["live"] == 0
    assert result["given"] > 0  # pages did move into blocks not yet written


@needs_tcmalloc
def test_a_block_dropped_unwritten_gives_its_pages_back_for_the_block_after_it():
    """Freed pages go back to the system only if the block after it is all untouched, allocated by the
    same thread, with nothing large in between; the process then grows by nothing when that block is
    written. The block after it is never changed: its pages stay untouched until the program writes
    them (issue 42: pages moved into it could land on a write of another thread)."""
    result = _large_child("""
        import threading, torch, daf, daf.allocator.native
        daf.wrap(torch.nn.Linear(8, 8))
        n = 24 << 20
        def present(tensor):  # pages of `tensor` present or swapped (/proc/self/pagemap bits 63, 62)
            with open("/proc/self/pagemap", "rb") as pagemap:
                pagemap.seek(tensor.data_ptr() // 4096 * 8)
                entries = memoryview(pagemap.read(tensor.numel() // 4096 * 8)).cast("Q")
                return sum(1 for entry in entries if entry >> 62)
        def case(touch_first=False, other_thread=False, between=False):
            daf.allocator.native.release_free_memory()  # nothing kept: the second block is new memory
            first = torch.full((n,), 1, dtype=torch.uint8)
            box = []
            make = lambda: box.append(torch.empty(n, dtype=torch.uint8))
            if other_thread:
                thread = threading.Thread(target=make)
                thread.start()
                thread.join()
            else:
                make()
            second = box.pop()
            if touch_first:
                second[n - 1] = 7  # one byte on the last page
            if between:  # a large block allocated, written and freed
                extra = torch.full((n // 2,), 0, dtype=torch.uint8)
                del extra
            given, start = counters()["given"], rss()
            del first
            untouched = present(second) == int(touch_first)
            kept_byte = int(second[n - 1])
            second[: n - 1] = 3
            return dict(given=counters()["given"] - given, growth=(rss() - start) / n, byte=kept_byte,
                        ok=bool((second[: n - 1] == 3).all()), untouched=untouched)
        emit(plain=case(), touched=case(touch_first=True), thread=case(other_thread=True),
             between=case(between=True))
    """)
    assert result["plain"]["given"] == 24 << 20 and result["plain"]["growth"] < 0.1 and result["plain"]["ok"]
    assert result["touched"]["given"] == 0 and result["touched"]["byte"] == 7 and result["touched"]["ok"]
    assert result["touched"]["growth"] > 0.9  # the first block's pages stayed kept
    for other in ("thread", "between"):
        assert result[other]["given"] == 0 and result[other]["ok"] and result[other]["growth"] > 0.9
    assert all(case["untouched"] for case in result.values())  # the live block's pages were not replaced


# A receiver thread blocked in os.readv on an inotify descriptor that watches this process's pagemap
# for reads: its first event arrives while the allocator reads the pagemap at a free, so the fresh
# buffer is written by the kernel, with the GIL released, in the middle of that free (the window in
# which moving pages into the buffer lost the write: 7 of 10 steps before issue 42). The other writers
# are what programs do: a pipe read with os.readv, fill_ and a numpy copy in a worker thread.
_WRITERS = """
import ctypes, os, threading, time, numpy as np, torch, daf, daf.allocator.native
daf.wrap(torch.nn.Linear(8, 8))
libc = ctypes.CDLL(None, use_errno=True)
IN_ACCESS = 0x1

def inotify(buffer, value):
    fd = libc.inotify_init1(os.O_CLOEXEC)
    wd = libc.inotify_add_watch(fd, f"/proc/{os.getpid()}/pagemap".encode(), IN_ACCESS)
    assert fd >= 0 and wd >= 0, ctypes.get_errno()
    def work():
        os.readv(fd, [memoryview(buffer.numpy())[:4096]])  # one event: its watch descriptor first
        os.close(fd)
    return work, None, lambda: int.from_bytes(bytes(buffer[:4].tolist()), "little") == wd

def pipe(buffer, value):
    r, w = os.pipe()
    def work():
        view, done = memoryview(buffer.numpy()), 0
        while done < buffer.numel():
            done += os.readv(r, [view[done:]])
        os.close(r)
    def feed():
        chunk, left = bytes([value]) * 65536, buffer.numel()
        while left:
            left -= os.write(w, chunk[:min(left, 65536)])
        os.close(w)
    return work, feed, lambda: bool((buffer == value).all())

def fill(buffer, value):
    return (lambda: buffer.fill_(value)), None, lambda: bool((buffer == value).all())

def numpy(buffer, value):
    return (lambda: np.copyto(buffer.numpy(), value)), None, lambda: bool((buffer == value).all())

def run(writer, steps, n):
    bad = []
    previous = torch.full((n,), 1, dtype=torch.uint8)
    for step in range(steps):
        value = 2 + step % 250
        daf.allocator.native.release_free_memory()  # nothing kept: the fresh buffer takes new memory
        fresh = torch.empty(n, dtype=torch.uint8)
        work, feed, check = writer(fresh, value)
        thread = threading.Thread(target=work)
        thread.start()
        time.sleep(0.002)  # the worker is waiting in its syscall, or has started writing
        if feed is not None:
            feeder = threading.Thread(target=feed)
            feeder.start()
        del previous  # the allocator's free, while the worker writes the fresh buffer
        thread.join()
        if feed is not None:
            feeder.join()
        if not check():
            bad.append(step)
        fresh[:64].fill_(0xEE)  # its first page differs from the next buffer's, should it come back
        previous = fresh
    return bad
"""


@needs_tcmalloc
@pytest.mark.parametrize("writer, steps", [("inotify", 12), ("pipe", 40), ("fill", 40), ("numpy", 40)])
def test_a_fresh_buffer_written_by_another_thread_during_a_free_keeps_every_write(writer, steps):
    """A fresh buffer that another thread fills (GIL released) while this thread frees the buffer
    before it holds what that thread wrote, at every step: the allocator never moves pages into a
    block it has handed out."""
    result = _large_child(_WRITERS + f"emit(bad=run({writer}, {steps}, 64 << 20), **counters())")
    assert result["bad"] == [] and result["live"] <= 1
@needs_tcmalloc
def test_batch_norm_backward_grows_the_process_by_its_gradient_only():
    """PyTorch's batch norm backward allocates its input gradient twice and drops the first unwritten:
    with kept memory for one of them, the process does not grow."""
    result = _large_child("""
        import torch, daf
        daf.wrap(torch.nn.Linear(8, 8))
        bn = torch.nn.BatchNorm2d(64)
        x = torch.randn(48, 64, 32, 32, requires_grad=True)  # 12 MiB
        g = torch.randn_like(x)
        bn(x).backward(g)  # the first backward starts autograd's machinery
        x.grad = None
        y = bn(x)
        daf.allocator.native.release_free_memory()
        spare = torch.full_like(x, 1.0)
        del spare  # one tensor's pages kept
        start = rss()
        open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts here
        y.backward(g)
        hwm = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) << 10
        emit(growth=(hwm - start) / (x.numel() * 4), given=counters()["given"], ok=bool(torch.isfinite(x.grad).all()))
    """)
    assert result["ok"] and result["given"] > 0 and result["growth"] < 0.2


@needs_tcmalloc
def test_large_blocks_from_threads_keep_their_values():
    result = _large_child("""
        import threading, torch, daf
        daf.wrap(torch.nn.Linear(8, 8))
        bad = []
        def work(index):
            for round in range(12):
                n = (9 + (index * 7 + round * 5) % 23) << 20
                tensor = torch.full((n,), (index * 31 + round) % 256, dtype=torch.uint8)
                if not bool((tensor == (index * 31 + round) % 256).all()):
                    bad.append((index, round))
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        emit(bad=bad, **counters())
    """)
    assert result["bad"] == [] and result["live"] == 0 and result["whole"] + result["moves"] > 0


@needs_tcmalloc
def test_a_preloaded_process_gets_large_blocks_too():
    result = _child(_LARGE_COUNTERS + textwrap.dedent("""
        import torch, daf
        daf.wrap(torch.nn.Linear(8, 8))
        for size in (20, 20, 30):
            block = torch.full((size << 20,), 7, dtype=torch.uint8)
            ok = bool((block == 7).all())
            del block
        emit(mode=daf.allocator_status().mode, reason=daf.allocator_status().reason, ok=ok, **counters())
    """), env=_env(LD_PRELOAD=TCMALLOC))
    assert result["mode"] == "preloaded" and result["ok"]
    assert result["whole"] >= 1 and result["moved"] > 0 and result["live"] == 0
    assert result["reason"].endswith("tensors of 8 MiB and more come from DAF's large blocks (docs/allocator.md)")


@needs_tcmalloc
def test_a_forked_child_allocates_large_blocks_and_keeps_the_parents():
    result = _child(_LARGE_COUNTERS + textwrap.dedent("""
        import os, torch, daf
        daf.wrap(torch.nn.Linear(8, 8))
        parent = torch.full((24 << 20,), 5, dtype=torch.uint8)
        del parent  # kept: the child inherits it
        inherited = torch.full((24 << 20,), 9, dtype=torch.uint8)
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)  # as a DataLoader's worker does: the parent's OpenMP team is not forked
            ok = bool((inherited == 9).all())
            for size in (24, 40, 16):
                block = torch.full((size << 20,), 3, dtype=torch.uint8)
                ok = ok and bool((block == 3).all())
                del block
            os._exit(0 if ok else 1)
        _, code = os.waitpid(pid, 0)
        emit(child=os.waitstatus_to_exitcode(code), parent=bool((inherited == 9).all()))
    """))
    assert result == {"child": 0, "parent": True}


@needs_tcmalloc
def test_release_free_memory_gives_kept_large_blocks_back():
    result = _large_child("""
        import torch, daf
        from daf.allocator.native import release_free_memory
        daf.wrap(torch.nn.Linear(8, 8))
        block = torch.ones(64 << 20, dtype=torch.uint8)
        del block
        kept = counters()["kept"]
        held = rss()
        asked = release_free_memory()
        emit(kept=kept, released=held - rss(), asked=asked, after=counters()["kept"])
    """)
    assert result["kept"] == 64 * MIB and result["after"] == 0 and "daf" in result["asked"]
    assert result["released"] > 48 * MIB


@needs_tcmalloc
def test_decommit_turns_large_blocks_off_and_frees_them_at_once():
    result = _large_child("""
        import torch, daf
        from daf.allocator.native import _library
        daf.wrap(torch.nn.Linear(8, 8))
        before = _library().daf_allocator_large_from()
        early = torch.ones(64 << 20, dtype=torch.uint8)  # a large block, alive when decommit starts
        daf.wrap(torch.nn.Linear(8, 8), decommit=True)
        held = rss()
        del early
        emit(before=before, after=_library().daf_allocator_large_from(), released=held - rss(),
             reason=daf.allocator_status().reason, **counters())
    """)
    assert result["before"] > 0 and result["after"] == 0 and "large blocks" not in result["reason"]
    assert result["released"] > 48 * MIB and result["kept"] == 0 and result["live"] == 0


@needs_tcmalloc
def test_decommit_says_when_the_kernel_gives_no_huge_pages():
    result = _child("""
        import torch, daf
        import daf.allocator.native as native
        native.transparent_huge_pages = lambda: "never"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            daf.wrap(torch.nn.Linear(8, 8), decommit=True)
            daf.wrap(torch.nn.Linear(8, 8), decommit=True)
        emit(messages=[str(w.message) for w in caught if "huge pages" in str(w.message)],
             decommits=native.decommits())
    """)
    assert result["decommits"] is True
    assert len(result["messages"]) == 1 and "transparent_hugepage is 'never'" in result["messages"][0]


def test_config_decommit_without_tcmalloc_warns_once_and_changes_nothing():
    result = _child("""
        import torch, daf
        from daf.allocator.native import decommits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                daf.wrap(torch.nn.Linear(8, 8), allocator="system", decommit=True)
        emit(messages=[str(w.message) for w in caught if "decommit" in str(w.message)], decommits=decommits())
    """)
    assert len(result["messages"]) == 1 and "Config.decommit has no effect" in result["messages"][0]
    assert "libtcmalloc-minimal4" in result["messages"][0]
    assert result["decommits"] is False


def test_wrap_with_the_system_allocator_installs_nothing():
    result = _child("""
        import torch, daf
        model = daf.wrap(torch.nn.Linear(8, 8), allocator="system")
        model(torch.randn(4, 8)).sum().backward()
        from daf.allocator.native import tensor_bytes
        emit(status=daf.allocator_status().__dict__, bytes=tensor_bytes() is None)
    """)
    assert result["status"]["mode"] == "system" and result["status"]["name"] == "system"
    assert result["bytes"]


@needs_tcmalloc
def test_preloaded_library_is_reported_and_install_returns_it():
    result = _child("""
        import torch
        from daf.allocator.native import install, preloaded, status, tensor_bytes
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            returned = install("auto")
        emit(status=status().__dict__, returned=returned.__dict__, preloaded=preloaded().__dict__,
             warnings=len(caught), bytes=tensor_bytes() is None, works=float(torch.ones(10).sum()))
    """, env=_env(LD_PRELOAD=TCMALLOC))
    assert result["status"]["mode"] == "preloaded" and result["status"]["name"] == "tcmalloc"
    assert result["status"]["path"] == TCMALLOC
    assert result["returned"] == result["status"]
    assert {k: v for k, v in result["status"].items() if k != "reason"} == \
        {k: v for k, v in result["preloaded"].items() if k != "reason"}
    assert result["status"]["reason"].startswith(result["preloaded"]["reason"])
    assert "DAF's large blocks" in result["status"]["reason"]
    assert result["warnings"] == 0 and result["bytes"] and result["works"] == 10.0


def test_a_preload_of_something_else_is_not_an_allocator():
    result = _child("""
        from daf.allocator.native import preloaded, status
        emit(preloaded=preloaded() is None, mode=status().mode)
    """, env=_env(LD_PRELOAD="libm.so.6"))
    assert result == {"preloaded": True, "mode": "system"}


def test_missing_library_warns_once_naming_the_install_command():
    result = _child("""
        from daf.allocator import libraries
        libraries.find_library = lambda name: None  # as on a machine without the library
        import torch
        from daf.allocator.native import install, status, tensor_bytes
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            returned = install("mimalloc")
            again = install("mimalloc")
        runtime = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        x = torch.randn(100, 100, requires_grad=True)
        (x @ x).sum().backward()
        emit(warnings=runtime, other=len(caught) - len(runtime), returned=returned.__dict__,
             same=returned == again, mode=status().mode, grad=bool(torch.isfinite(x.grad).all()),
             bytes=tensor_bytes() is None)
    """)
    assert len(result["warnings"]) == 1 and result["other"] == 0
    assert INSTALL_HINTS["mimalloc"] in result["warnings"][0]
    assert result["returned"]["mode"] == "system" and result["returned"]["path"] is None
    assert INSTALL_HINTS["mimalloc"] in result["returned"]["reason"]
    assert result["same"] and result["mode"] == "system" and result["grad"] and result["bytes"]


def test_install_system_installs_nothing():
    result = _child("""
        from daf.allocator.native import install, status, tensor_bytes
        import torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            returned = install("system")
        torch.ones(100)
        emit(returned=returned.__dict__, mode=status().mode, warnings=len(caught), bytes=tensor_bytes() is None)
    """)
    assert result["returned"]["mode"] == "system" and result["mode"] == "system"
    assert result["warnings"] == 0 and result["bytes"]


@needs_tcmalloc
def test_second_install_reports_the_allocator_actually_in_use():
    result = _child("""
        from daf.allocator import libraries
        real = libraries.find_library  # a second library "found" (never loaded: the first one stays)
        libraries.find_library = lambda name: "/elsewhere/libjemalloc.so.2" if name == "jemalloc" else real(name)
        from daf.allocator.native import install, status
        import torch
        install("tcmalloc")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            second = install("jemalloc")
        emit(second=second.__dict__, status=status().__dict__)
    """)
    assert result["status"]["mode"] == "in-process" and result["status"]["name"] == "tcmalloc"
    assert result["second"] == result["status"]


@needs_tcmalloc
def test_release_free_memory_returns_what_preloaded_tcmalloc_kept():
    """Freed Python bytes stay in tcmalloc's heap (RSS) until release_free_memory gives them back."""
    result = _child("""
        from daf.allocator.native import release_free_memory
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        chunks = [bytes(8 << 20) for _ in range(24)]  # 192 MiB in 8 MiB Python objects
        del chunks
        kept = rss()
        asked = release_free_memory()
        emit(kept=kept, after=rss(), asked=asked)
    """, _env(LD_PRELOAD=TCMALLOC))
    assert "tcmalloc" in result["asked"]
    assert result["kept"] - result["after"] > 100 * MIB


def test_release_free_memory_on_the_system_allocator_asks_glibc_only():
    result = _child("""
        from daf.allocator.native import release_free_memory
        emit(asked=release_free_memory())
    """)
    assert "tcmalloc" not in result["asked"]
    assert result["asked"] in (["glibc"], [])  # [] on a libc without malloc_trim
