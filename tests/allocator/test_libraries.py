"""Finding an allocator's library and the LD_PRELOAD that puts it first (daf.allocator.libraries)."""

import os

import pytest

from daf.allocator import libraries
from daf.allocator.libraries import (ALLOCATORS, INSTALL_HINTS, PREFERENCE, Resolved, find_library, preload_env,
                                     resolve)


@pytest.fixture
def libdir(tmp_path, monkeypatch):
    """A search path of one empty directory: every allocator is missing until a test puts a file there."""
    directory = tmp_path / "lib"
    directory.mkdir()
    monkeypatch.setattr(libraries, "_search_dirs", lambda: [str(directory)])
    return directory


def _fake(directory, filename):
    path = directory / filename
    path.write_bytes(b"\x7fELF not really")
    return str(path)


def test_tables_agree():
    assert set(ALLOCATORS) == set(INSTALL_HINTS) == set(PREFERENCE)
    assert len(PREFERENCE) == len(set(PREFERENCE)) and PREFERENCE[0] == "tcmalloc"
    assert all(hint.startswith("apt-get install ") for hint in INSTALL_HINTS.values())
    assert all(files and all(f.startswith("lib") and ".so" in f for f in files) for files in ALLOCATORS.values())


@pytest.mark.parametrize("name", ["system", "auto", "glibc", "", "TCMALLOC"])
def test_find_library_rejects_unknown_names(name):
    with pytest.raises(ValueError) as error:
        find_library(name)
    message = str(error.value)
    assert repr(name) in message and all(known in message for known in ALLOCATORS)


@pytest.mark.parametrize("call", [resolve, preload_env])
@pytest.mark.parametrize("name", ["glibc", "", "Auto", "tc-malloc"])
def test_resolve_and_preload_env_reject_unknown_names(call, name):
    with pytest.raises(ValueError) as error:
        call(name)
    message = str(error.value)
    assert repr(name) in message
    assert all(repr(known) in message for known in ("auto", "system", *ALLOCATORS))


def test_system_resolves_to_no_library(libdir):
    _fake(libdir, "libtcmalloc_minimal.so.4")  # even where one is there
    assert resolve("system") == Resolved("system", None, "the system allocator was asked for")
    assert preload_env("system", environ={"LD_PRELOAD": "/x/liba.so"}) == {}


def test_find_library_on_this_machine_gives_an_existing_file_or_none():
    for name, filenames in ALLOCATORS.items():
        path = find_library(name)
        if path is not None:
            assert os.path.isabs(path) and os.path.isfile(path) and os.path.basename(path) in filenames


def test_find_library_prefers_the_first_filename_over_an_earlier_directory(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    _fake(first, "libtcmalloc.so.4")
    minimal = _fake(second, "libtcmalloc_minimal.so.4")
    monkeypatch.setattr(libraries, "_search_dirs", lambda: [str(first), str(second)])
    assert find_library("tcmalloc") == minimal
    os.remove(minimal)
    assert find_library("tcmalloc") == str(first / "libtcmalloc.so.4")


def test_find_library_skips_a_directory_named_like_the_library(libdir):
    (libdir / "libjemalloc.so.2").mkdir()
    assert find_library("jemalloc") is None


def test_ld_library_path_is_searched_first(tmp_path, monkeypatch):
    custom = tmp_path / "custom"
    custom.mkdir()
    path = _fake(custom, "libmimalloc.so.2")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"::{custom}:")
    assert libraries._search_dirs()[0] == str(custom)
    assert "" not in libraries._search_dirs()
    assert find_library("mimalloc") == path


@pytest.mark.parametrize("name", list(ALLOCATORS))
def test_missing_library_resolves_to_system_with_the_install_command(libdir, name):
    assert find_library(name) is None
    resolved = resolve(name)
    assert resolved.name == "system" and resolved.path is None
    assert name in resolved.reason and f"`{INSTALL_HINTS[name]}`" in resolved.reason
    assert preload_env(name, environ={}) == {}


def test_missing_library_via_a_patched_find_library(monkeypatch):
    monkeypatch.setattr(libraries, "find_library", lambda name: None)
    resolved = resolve("tcmalloc")
    assert resolved.path is None and "apt-get install libtcmalloc-minimal4" in resolved.reason


def test_auto_with_nothing_found_names_the_preferred_allocator(libdir):
    resolved = resolve("auto")
    assert resolved.path is None and resolved.name == "system"
    assert resolved.reason.startswith(f"{PREFERENCE[0]} not found")
    assert INSTALL_HINTS[PREFERENCE[0]] in resolved.reason


def test_auto_follows_the_preference_order(libdir):
    mimalloc = _fake(libdir, "libmimalloc.so.2")
    assert resolve("auto") == Resolved("mimalloc", mimalloc, f"mimalloc found at {mimalloc}")
    jemalloc = _fake(libdir, "libjemalloc.so.2")
    assert resolve("auto").path == jemalloc and resolve("auto").name == "jemalloc"
    tcmalloc = _fake(libdir, "libtcmalloc_minimal.so.4")
    assert resolve("auto").path == tcmalloc and resolve("auto").name == "tcmalloc"
    assert resolve().path == tcmalloc  # "auto" is the default
    assert resolve("mimalloc").path == mimalloc  # a name asked for is taken even when not preferred


def test_a_named_allocator_never_falls_back_to_another(libdir):
    _fake(libdir, "libjemalloc.so.2")
    resolved = resolve("tcmalloc")
    assert resolved.path is None and "tcmalloc not found" in resolved.reason


def test_preload_env_puts_the_library_first_and_keeps_the_rest(libdir):
    path = _fake(libdir, "libtcmalloc_minimal.so.4")
    assert preload_env("tcmalloc", environ={}) == {"LD_PRELOAD": path}
    assert preload_env("auto", environ={"LD_PRELOAD": ""}) == {"LD_PRELOAD": path}
    assert preload_env("auto", environ={"LD_PRELOAD": "/x/liba.so"}) == {"LD_PRELOAD": f"{path}:/x/liba.so"}
    # ld.so takes spaces and colons alike as separators; empty entries are dropped
    assert (preload_env("auto", environ={"LD_PRELOAD": "/x/liba.so /x/libb.so::"})
            == {"LD_PRELOAD": f"{path}:/x/liba.so:/x/libb.so"})


@pytest.mark.parametrize("existing", ["{path}", "/x/liba.so:{path}", "/x/liba.so {path} /x/libb.so"])
def test_preload_env_adds_nothing_when_the_library_is_there(libdir, existing):
    path = _fake(libdir, "libtcmalloc_minimal.so.4")
    assert preload_env("tcmalloc", environ={"LD_PRELOAD": existing.format(path=path)}) == {}


def test_preload_env_reads_os_environ_by_default(libdir, monkeypatch):
    path = _fake(libdir, "libjemalloc.so.2")
    monkeypatch.setenv("LD_PRELOAD", "/x/liba.so")
    assert preload_env("jemalloc") == {"LD_PRELOAD": f"{path}:/x/liba.so"}
    monkeypatch.setenv("LD_PRELOAD", path)
    assert preload_env("jemalloc") == {}
    monkeypatch.delenv("LD_PRELOAD")
    assert preload_env("jemalloc") == {"LD_PRELOAD": path}


def test_preload_env_does_not_modify_the_mapping(libdir):
    _fake(libdir, "libtcmalloc_minimal.so.4")
    environ = {"LD_PRELOAD": "/x/liba.so"}
    preload_env("auto", environ=environ)
    assert environ == {"LD_PRELOAD": "/x/liba.so"}


def test_real_tcmalloc_goes_first():
    path = find_library("tcmalloc")
    if path is None:
        pytest.skip("tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
    assert resolve("auto") == Resolved("tcmalloc", path, f"tcmalloc found at {path}")
    assert preload_env(environ={"LD_PRELOAD": "/x/liba.so"}) == {"LD_PRELOAD": f"{path}:/x/liba.so"}
