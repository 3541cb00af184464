# Sourced by demo.sh and test.sh: a virtual environment with torch 2.13.0 (CPU) and DAF.
# torch is installed first and pinned, so nothing below can resolve a newer or CUDA build.
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
"${PIP[@]}" -e "$ROOT[${DAF_EXTRAS:-test}]"
