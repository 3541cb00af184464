#!/usr/bin/env bash
# Installs what the tests need (into .venv) and runs the whole suite.
# The workload tests need the "workloads" and "text" extras and the data packages (about 190 MB);
# tests/test_integrations.py needs "integrations" (transformers, accelerate, lightning).
set -euo pipefail
export DAF_EXTRAS="${DAF_EXTRAS:-test,workloads,text,integrations}"
source "$(dirname "$0")/setup.sh"
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null; } \
    || echo "warning: could not install dataset-fashion-mnist; the resnet18-fmnist tests will be skipped" >&2
fi
cd "$ROOT"
"$PY" -m pytest "$@"
