"""``daf run [--allocator NAME] -- COMMAND ...``: run a whole process on a well-kept allocator.

The convention of PyTorch's own CPU launcher (``python -m torch.backends.xeon.run_cpu
--enable-tcmalloc``): the allocator's library goes first in ``LD_PRELOAD``, so every ``malloc`` of
the process is its, not only PyTorch's tensors (which is all that ``daf.wrap`` can reach from
inside a running process). Where no library is found the command still runs, on the system
allocator, after one warning that names the install command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from daf.allocator.libraries import ALLOCATORS, decommit_env, preload_env, resolve

__all__ = ["add_arguments", "launch"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allocator", default="auto", choices=("auto", "system", *ALLOCATORS),
                        help="the allocator to preload: auto (the best found, tcmalloc first; default), "
                             "system (run as is), or a name")
    parser.add_argument("--decommit", action="store_true",
                        help="tcmalloc gives freed memory back at once and PyTorch puts large tensors in huge "
                             "pages (Config.decommit for the whole process: lower peak, slower steps)")
    parser.add_argument("--print-env", action="store_true",
                        help="print the variables the command would get (for a shell's eval) and run nothing")
    parser.add_argument("to_run", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the command to run, after --")


def launch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Replace this process with ``args.command`` under the allocator (returns only for --print-env)."""
    command = args.to_run[1:] if args.to_run[:1] == ["--"] else args.to_run
    extra = preload_env(args.allocator)
    if args.decommit:
        extra.update(decommit_env(args.allocator))
        if not extra.get("TCMALLOC_AGGRESSIVE_DECOMMIT"):
            print(f"daf run: warning: --decommit has no effect: it needs tcmalloc ({resolve(args.allocator).reason})",
                  file=sys.stderr)
    if args.print_env:
        for key, value in extra.items():
            print(f"export {key}={value}")
        return 0
    if not command:
        parser.error("give the command to run after --, e.g. daf run -- python train.py")
    if shutil.which(command[0]) is None:
        parser.error(f"command not found: {command[0]!r}")
    resolved = resolve(args.allocator)
    if resolved.path is None and args.allocator != "system":
        print(f"daf run: warning: {resolved.reason}; running on the system allocator", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], command, {**os.environ, **extra})
    return 127  # not reached: exec replaced this process
