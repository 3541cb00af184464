"""The spill store: activation payloads written to disk under a memory budget, checked on the way back.

One private directory per store (``daf-spill-<pid>-<random>``, mode 0700, created at the
first spill under ``Config.spill_dir`` or the system temp dir), one file per record (mode
0600), one CRC-32 per record verified on every read. The directory goes away when the store
is closed, garbage-collected (after an exception, with its session), at exit or on SIGTERM;
one left by a killed process is removed by the next store to start under the same parent
(``spilldir``).

>>> import tempfile
>>> spill = SpillStore(tempfile.gettempdir())
>>> handle = spill.write(7, [torch.arange(5, dtype=torch.uint8)], "fc#0")
>>> spill.read(handle, "fc#0").tolist()
[0, 1, 2, 3, 4]
>>> spill.close()
"""

from __future__ import annotations

import errno
import os
import tempfile
import weakref
import zlib
from dataclasses import dataclass

import torch

from daf.memory import spilldir
from daf.memory.errors import SpillError

__all__ = ["SpillStore", "SpillHandle"]


@dataclass(frozen=True)
class SpillHandle:
    """Where one record's bytes are on disk and what they must hash to."""

    path: str
    nbytes: int
    crc: int


def _write_all(fd: int, data: memoryview) -> None:
    """os.write until every byte is written (it may write less than asked)."""
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _host_bytes(view: torch.Tensor) -> memoryview:
    """A uint8 CPU tensor's bytes without a copy (a device tensor is copied to the host first)."""
    return memoryview(view.cpu().numpy()).cast("B")


class SpillStore:
    """Files of spilled payloads. Not thread-safe for one handle; different handles may be used at once."""

    def __init__(self, parent: str | None = None) -> None:
        self.parent = parent
        self.directory: str | None = None
        self._finalizer: weakref.finalize | None = None
        self.bytes_on_disk = 0
        self.files = 0
        self.swept = spilldir.sweep_stale(self._parent())  # what killed processes left under the same parent
        spilldir.install_sigterm_cleanup()

    def _parent(self) -> str:
        return self.parent if self.parent is not None else tempfile.gettempdir()

    def _ensure_directory(self) -> str:
        if self.directory is not None and not os.path.isdir(self.directory):
            # Removed under us (a clean-up of the temp dir while training): the records spilled there are
            # gone and say so when read; later spills go to a new directory rather than fail every step.
            self._finalizer.detach()
            spilldir.remove(self.directory)
            self.directory = None
        if self.directory is None:
            parent = self._parent()
            if not os.path.isdir(parent):
                raise ValueError(f"Config.spill_dir must be an existing directory, got {parent!r}")
            self.directory = spilldir.create(parent)
            self._finalizer = weakref.finalize(self, spilldir.remove, self.directory, os.getpid())
        return self.directory

    def write(self, key: int, segments: list[torch.Tensor], site: str) -> SpillHandle:
        """Write the concatenation of ``segments`` (uint8 [*] each, any device) as record ``key``.

        O(total bytes). A full disk or any other OS error (creating the directory or the file included)
        raises ``SpillError`` and leaves no partial file.
        """
        try:
            path = os.path.join(self._ensure_directory(), f"{key}.bin")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            raise self._write_error(error, site, 0, self.directory or self.parent or tempfile.gettempdir()) from error
        crc, nbytes = 0, 0
        try:
            for segment in segments:
                data = _host_bytes(segment)
                _write_all(fd, data)
                crc = zlib.crc32(data, crc)
                nbytes += len(data)
        except OSError as error:
            os.close(fd)
            os.unlink(path)
            raise self._write_error(error, site, nbytes, path) from error
        os.close(fd)
        self.bytes_on_disk += nbytes
        self.files += 1
        return SpillHandle(path, nbytes, crc)

    def _write_error(self, error: OSError, site: str, written: int, where: str) -> SpillError:
        """The ``SpillError`` for an OS error met while writing ``site``'s record at ``where``."""
        if error.errno == errno.ENOSPC:
            return SpillError(
                f"no space left on the device of {where!r} while spilling activation {site!r} "
                f"({written} B written); free disk space, set Config.spill_dir to a larger disk, or raise "
                f"Config.budget")
        return SpillError(f"could not spill activation {site!r} to {where!r}: {error}")

    def read_into(self, handle: SpillHandle, segments: list[torch.Tensor], site: str) -> None:
        """Fill ``segments`` (uint8 views, any device, ``handle.nbytes`` in all) with the record's bytes.

        O(nbytes). Raises ``SpillError`` naming ``site`` and the file if the bytes are short, long or do not
        match their CRC-32, or the file cannot be read (deleted while training, an I/O error).
        """
        if sum(s.numel() for s in segments) != handle.nbytes:
            raise ValueError(f"segments hold {sum(s.numel() for s in segments)} bytes, the record {handle.nbytes}")
        try:
            crc = self._read_checked(handle, segments, site)
        except FileNotFoundError as error:
            raise SpillError(f"DAF could not read back spilled activation {site!r}: its spill file "
                             f"{handle.path!r} is gone (removed while training?)") from error
        except OSError as error:
            raise SpillError(f"DAF could not read back spilled activation {site!r} from {handle.path!r}: "
                             f"{error}") from error
        if crc != handle.crc:
            raise SpillError(f"DAF: spilled activation {site!r} is corrupted on disk ({handle.path!r}): "
                             f"CRC-32 {crc:#010x}, expected {handle.crc:#010x} as written; the file changed "
                             f"after DAF wrote it")

    def _read_checked(self, handle: SpillHandle, segments: list[torch.Tensor], site: str) -> int:
        """Read the file into ``segments``; its CRC-32. ``SpillError`` if it is shorter or longer than written."""
        crc = 0
        with open(handle.path, "rb", buffering=0) as f:
            for segment in segments:
                host = segment if segment.device.type == "cpu" else torch.empty_like(segment, device="cpu")
                data = memoryview(host.numpy()).cast("B")
                if f.readinto(data) != len(data):
                    raise SpillError(f"DAF: spilled activation {site!r} is truncated on disk ({handle.path!r}): "
                                     f"shorter than the {handle.nbytes} B written")
                crc = zlib.crc32(data, crc)
                if host is not segment:
                    segment.copy_(host)
            if f.read(1):
                raise SpillError(f"DAF: spilled activation {site!r} has extra bytes on disk ({handle.path!r}): "
                                 f"longer than the {handle.nbytes} B written")
        return crc

    def read(self, handle: SpillHandle, site: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The record's bytes: uint8 [nbytes] on ``device``, verified like ``read_into``. O(nbytes)."""
        out = torch.empty(handle.nbytes, dtype=torch.uint8, device=device)
        self.read_into(handle, [out], site)
        return out

    def remove(self, handle: SpillHandle) -> None:
        """Delete the record's file (once per handle; one already gone counts as deleted). O(1)."""
        try:
            os.unlink(handle.path)
        except FileNotFoundError:
            pass
        self.bytes_on_disk -= handle.nbytes
        self.files -= 1

    def close(self) -> None:
        """Remove the directory and everything in it."""
        if self._finalizer is not None:
            self._finalizer()
        self.directory, self.bytes_on_disk, self.files = None, 0, 0
