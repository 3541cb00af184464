#!/usr/bin/env bash
# Installs what the tests need (into .venv) and runs the whole suite.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
cd "$ROOT"
"$PY" -m pytest "$@"
