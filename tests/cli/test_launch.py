"""``daf run [--allocator NAME] -- COMMAND``: a whole process with the allocator first in LD_PRELOAD."""

import os
import subprocess
import sys

import pytest

from daf.allocator import libraries
from daf.allocator.libraries import INSTALL_HINTS, find_library
from daf.cli import main

TCMALLOC = find_library("tcmalloc")
needs_tcmalloc = pytest.mark.skipif(TCMALLOC is None,
                                    reason="tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
PRINT_PRELOAD = [sys.executable, "-c", "import os; print(os.environ.get('LD_PRELOAD', ''))"]


def _daf_run(*argv, env=None, timeout=120):
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return subprocess.run([sys.executable, "-m", "daf.cli", "run", *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture
def no_exec(monkeypatch):
    """Records what ``daf run`` would exec instead of replacing the test process with it."""
    calls = []

    def execvpe(file, args, env):
        calls.append((file, list(args), dict(env)))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execvpe", execvpe)
    return calls


# --- the real thing, in subprocesses ---------------------------------------------------------------

@needs_tcmalloc
def test_tcmalloc_goes_first_in_the_child():
    done = _daf_run("--", *PRINT_PRELOAD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == TCMALLOC


@needs_tcmalloc
def test_an_existing_preload_stays_after_tcmalloc():
    env = {**os.environ, "LD_PRELOAD": "libm.so.6"}
    done = _daf_run("--allocator", "tcmalloc", "--", *PRINT_PRELOAD, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{TCMALLOC}:libm.so.6"


@needs_tcmalloc
def test_a_library_preloaded_already_is_not_added_twice():
    env = {**os.environ, "LD_PRELOAD": TCMALLOC}
    done = _daf_run("--", *PRINT_PRELOAD, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == TCMALLOC


@pytest.mark.parametrize("preload", [None, "libm.so.6"])
def test_system_leaves_ld_preload_unchanged(preload):
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload is not None:
        env["LD_PRELOAD"] = preload
    done = _daf_run("--allocator", "system", "--", *PRINT_PRELOAD, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (preload or "")
    assert "warning" not in done.stderr


@needs_tcmalloc
def test_print_env_prints_an_export_line_and_runs_nothing():
    done = _daf_run("--print-env", "--", sys.executable, "-c", "print('RAN')")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"export LD_PRELOAD={TCMALLOC}"]


@needs_tcmalloc
def test_print_env_with_decommit_adds_tcmalloc_and_pytorch_switches():
    done = _daf_run("--decommit", "--print-env")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"export LD_PRELOAD={TCMALLOC}", "export TCMALLOC_AGGRESSIVE_DECOMMIT=true",
                                        "export THP_MEM_ALLOC_ENABLE=1"]


@needs_tcmalloc
def test_decommit_reaches_the_child_process():
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "THP_MEM_ALLOC_ENABLE")}
    done = _daf_run("--decommit", "--", sys.executable, "-c",
                    "import daf; from daf.allocator.native import decommits, huge_pages; "
                    "print(daf.allocator_status().mode, decommits(), huge_pages())", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["preloaded", "True", "True"]


def test_print_env_for_the_system_allocator_prints_nothing():
    done = _daf_run("--allocator", "system", "--print-env")
    assert done.returncode == 0 and done.stdout == ""


def test_no_command_is_an_argument_error():
    done = _daf_run()
    assert done.returncode == 2
    assert "give the command to run after --" in done.stderr


def test_an_unknown_command_is_an_argument_error():
    done = _daf_run("--", "daf-no-such-command-xyz", "--flag")
    assert done.returncode == 2
    assert "command not found: 'daf-no-such-command-xyz'" in done.stderr


@pytest.mark.parametrize("code", [0, 3, 17])
def test_the_exit_status_of_the_command_is_passed_through(code):
    done = _daf_run("--", "sh", "-c", f"echo out; echo err >&2; exit {code}")
    assert done.returncode == code
    assert done.stdout == "out\n" and done.stderr == "err\n"


def test_arguments_after_the_command_belong_to_it():
    done = _daf_run("--allocator", "system", "--", sys.executable, "-c", "import sys; print(sys.argv[1:])",
                    "--allocator", "jemalloc", "--print-env", "--")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['--allocator', 'jemalloc', '--print-env', '--']"


@needs_tcmalloc
def test_daf_in_the_child_reports_preloaded():
    done = _daf_run("--", sys.executable, "-c",
                    "import daf; s = daf.allocator_status(); print(s.mode, s.name, s.path)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["preloaded", "tcmalloc", TCMALLOC]


def test_an_unknown_allocator_is_an_argument_error():
    done = _daf_run("--allocator", "glibc", "--", "true")
    assert done.returncode == 2 and "invalid choice: 'glibc'" in done.stderr


# --- in this process, with exec recorded instead of done -------------------------------------------

def test_missing_library_warns_with_the_install_command_and_still_runs(no_exec, monkeypatch, capsys):
    monkeypatch.setattr(libraries, "find_library", lambda name: None)
    monkeypatch.setenv("LD_PRELOAD", "libm.so.6")
    with pytest.raises(SystemExit):
        main(["run", "--", "true", "x"])
    [(file, args, env)] = no_exec
    assert file == "true" and args == ["true", "x"]
    assert env["LD_PRELOAD"] == "libm.so.6"
    err = capsys.readouterr().err
    assert "warning" in err and INSTALL_HINTS["tcmalloc"] in err and "system allocator" in err


def test_the_named_allocator_is_preloaded(no_exec, tmp_path, monkeypatch):
    fake = tmp_path / "libjemalloc.so.2"
    fake.write_bytes(b"")
    monkeypatch.setattr(libraries, "_search_dirs", lambda: [str(tmp_path)])
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with pytest.raises(SystemExit):
        main(["run", "--allocator", "jemalloc", "--", "true"])
    [(_, _, env)] = no_exec
    assert env["LD_PRELOAD"] == str(fake)
    assert {k: v for k, v in env.items() if k != "LD_PRELOAD"} == dict(os.environ)


def test_decommit_on_another_allocator_warns_and_sets_nothing(no_exec, tmp_path, monkeypatch, capsys):
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    monkeypatch.setattr(libraries, "_search_dirs", lambda: [str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["run", "--allocator", "jemalloc", "--decommit", "--", "true"])
    [(_, _, env)] = no_exec
    assert "TCMALLOC_AGGRESSIVE_DECOMMIT" not in env and env.get("THP_MEM_ALLOC_ENABLE") == os.environ.get(
        "THP_MEM_ALLOC_ENABLE")
    assert "--decommit has no effect: it needs tcmalloc" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["run"], "give the command to run after --"),
    (["run", "--"], "give the command to run after --"),
    (["run", "--", "daf-no-such-command-xyz"], "command not found: 'daf-no-such-command-xyz'"),
])
def test_argument_errors_in_process(no_exec, argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert no_exec == []
