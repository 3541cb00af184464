"""Spill directories: created with their owner's identity, removed on SIGTERM, swept when stale.

A spill directory is ``daf-spill-<pid>-<random>`` (mode 0700) holding a marker file,
``daf-spill.json``, that records who made it: the pid, that process's start time (from
``/proc/<pid>/stat``), the boot id, the pid namespace and the host. Three mechanisms remove
a directory whose process is gone:

* normal exit and exceptions: the owner's ``weakref.finalize`` (``SpillStore``);
* SIGTERM: ``_on_sigterm`` removes this process's directories, then lets the signal
  terminate the process as it would have (see ``install_sigterm_cleanup``);
* SIGKILL, ``os._exit``, power loss: nothing runs, so the next store to start under the
  same parent sweeps directories whose marker says their process is dead (``sweep_stale``).

The sweep removes a directory only when all of these hold: the name starts with
``daf-spill-``, it is a real directory (not a link) owned by this user, its marker parses and
names this machine's boot, this pid namespace and this host, and the pid does not run or runs
with a different start time (the pid was reused). Anything else is left alone: a directory of
another container, another machine or from before a reboot, a directory without a marker
(one being created, or not DAF's), or one of a live process.

>>> import tempfile
>>> parent = tempfile.mkdtemp()
>>> path = create(parent)
>>> os.path.basename(path).startswith(f"daf-spill-{os.getpid()}-"), is_stale(path)
(True, False)
>>> remove(path); os.rmdir(parent)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
from types import FrameType
from typing import Any

__all__ = ["PREFIX", "MARKER", "create", "remove", "is_stale", "sweep_stale", "install_sigterm_cleanup"]

PREFIX = "daf-spill-"
MARKER = "daf-spill.json"

# The one piece of module-level mutable state: the SIGTERM handler runs with no object to reach the
# stores through. Directory -> the pid that made it (a forked child inherits the mapping and must not
# remove its parent's directories).
_live: dict[str, int] = {}


def _read(path: str, limit: int = 4096) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (field 22 of /proc/<pid>/stat); None without /proc."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    try:
        return int(text.rsplit(")", 1)[1].split()[19])  # after the command name, which may hold spaces
    except (IndexError, ValueError):
        return None


def _identity(pid: int) -> dict[str, Any]:
    """What the marker records and the sweep compares: the process and the machine and namespace it runs in."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return {"daf": "spill", "pid": pid, "start": start_time(pid), "boot": boot and boot.strip(),
            "pidns": namespace, "host": socket.gethostname()}


def create(parent: str) -> str:
    """A new private spill directory under ``parent``, with its marker, registered for SIGTERM clean-up."""
    pid = os.getpid()
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-", dir=parent)
    try:
        os.chmod(path, 0o700)
        with open(os.path.join(path, MARKER), "x", encoding="ascii") as f:
            json.dump(_identity(pid), f)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    _live[path] = pid
    return path


def remove(path: str, owner: int | None = None) -> None:
    """Remove a spill directory and everything in it, only from the process that made it (``owner``, by
    default this one): a forked child that exits must not take its parent's directory with it."""
    if owner is not None and owner != os.getpid():
        return
    _live.pop(path, None)
    shutil.rmtree(path, ignore_errors=True)


def _running(pid: int, started: int | None) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs (a reused pid does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # a process of another user has the pid: it runs, and it is not the one that made the directory
    now = start_time(pid)
    return started is None or now is None or now == started


def is_stale(path: str, here: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` is a DAF spill directory of a process that no longer runs (module docstring);
    ``here`` is this process's ``_identity``, when the caller has it already."""
    name = os.path.basename(path)
    if not name.startswith(PREFIX):
        return False
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return False
    try:
        marker = json.loads(_read(os.path.join(path, MARKER)) or "")
        pid = marker["pid"]
    except (ValueError, TypeError, KeyError):
        return False
    if not isinstance(pid, int) or marker.get("daf") != "spill" or not name.startswith(f"{PREFIX}{pid}-"):
        return False
    here = here or _identity(os.getpid())
    if any(marker.get(key) != here[key] for key in ("boot", "pidns", "host")):
        return False
    return pid != os.getpid() and not _running(pid, marker.get("start"))


def sweep_stale(parent: str) -> list[str]:
    """Remove the stale DAF spill directories directly under ``parent``; the paths removed. Never raises:
    a sweep that cannot read or remove something leaves it."""
    removed = []
    try:
        entries = [entry.path for entry in os.scandir(parent) if entry.name.startswith(PREFIX)]
    except OSError:
        return removed
    here = _identity(os.getpid())
    for path in entries:
        if is_stale(path, here):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def install_sigterm_cleanup() -> bool:
    """Make SIGTERM remove this process's spill directories before it terminates; whether it is installed.

    Installed once (the installed handler is its own flag), from the main thread only (Python runs
    signal handlers there), and only over the default disposition, where SIGTERM would kill the
    process without running any clean-up. Over a Python handler there is nothing to add: it either
    returns (the process goes on and needs its spilled records) or raises (the exception unwinds and
    the directories go at exit). Over SIG_IGN the process means to survive SIGTERM; over a handler
    installed outside Python it cannot be chained.
    """
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return True
    if current is not signal.SIG_DFL or threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Remove this process's spill directories, then terminate by SIGTERM as the default disposition would
    (same exit status). A handler installed after ours replaces it, and chaining is then its business."""
    for path, owner in list(_live.items()):
        remove(path, owner)
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)
