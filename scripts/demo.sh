#!/usr/bin/env bash
# Sets up .venv, then runs gpuflow's smoke job (torch matmul TFLOP/s) through the full
# pipeline on this machine: GPU if there is one, else CPU. Extra arguments go to `gpuflow run`'s
# place: e.g. `scripts/demo.sh examples/command.yaml`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if (($#)); then
    exec .venv/bin/gpuflow run "$@"
fi
exec .venv/bin/gpuflow demo
