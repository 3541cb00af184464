#!/usr/bin/env bash
# The main job: installs DAF and Fashion-MNIST, then `daf compare` trains ResNet-18 on Fashion-MNIST
# with and without DAF (each in its own process, same seed and batches) and prints the comparison.
# The fp32 arm runs as a plain PyTorch user runs it (the system's malloc); DAF brings its allocator
# (docs/allocator.md). Batch 256 at width 32: a configuration where activations dominate memory.
# About four minutes on 2 cores; extra arguments go to `daf compare` (e.g. --steps 400 -O width=64).
set -euo pipefail
export DAF_EXTRAS="${DAF_EXTRAS:-workloads}"
source "$(dirname "$0")/setup.sh"
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi
cd "$ROOT"
"$VENV/bin/daf" compare resnet18-fmnist --steps 60 --batch 256 -O width=32 --fp32-allocator system \
  --json results/demo.json "$@"
