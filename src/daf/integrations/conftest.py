"""pytest collects doctests from src/daf (``--doctest-modules``), which imports each module: skip the
integrations whose framework is not installed (they are optional) rather than fail collection."""

import importlib.util

collect_ignore = [f"{name}.py" for name in ("transformers", "lightning") if importlib.util.find_spec(name) is None]
