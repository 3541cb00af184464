#!/usr/bin/env bash
# The main job: installs DAF and Fashion-MNIST, trains a small model with and without DAF, prints the comparison.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi
cd "$ROOT"
"$PY" -m daf.demo "$@"
