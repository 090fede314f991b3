#!/usr/bin/env bash
# One prepared check of meshforge's CUDA paths (scripts/gpu_check.py): `scripts/gpu_check.sh` on a
# machine with one GPU, `scripts/gpu_check.sh --cpu-smoke` on the CPU. Sets up .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
test -x .venv/bin/python || make install
exec .venv/bin/python scripts/gpu_check.py "$@"
