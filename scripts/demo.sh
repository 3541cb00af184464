#!/usr/bin/env bash
# The main job: installs DAF and Fashion-MNIST, then `daf compare` trains ResNet-18 on Fashion-MNIST
# with and without DAF (each in its own process, same seed and batches) and prints the comparison.
# A few minutes on 2 cores; extra arguments go to `daf compare` (e.g. --steps 400 -O width=64).
set -euo pipefail
export DAF_EXTRAS="${DAF_EXTRAS:-workloads}"
source "$(dirname "$0")/setup.sh"
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi
cd "$ROOT"
"$VENV/bin/daf" compare resnet18-fmnist --steps 150 --batch 64 -O width=16 --json results/demo.json "$@"
