#!/usr/bin/env bash
# Sets up .venv, then runs gpuflow's smoke job (torch matmul TFLOP/s) through the full
# pipeline on this machine: GPU if there is one, else CPU. Extra arguments go to `gpuflow run`'s
# place: e.g. `scripts/demo.sh examples/command.yaml`; `scripts/demo.sh render` installs
# Blender and renders a small animation instead; `scripts/demo.sh hpc` installs Open MPI and
# runs molecular dynamics on two MPI ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "render" ]]; then
    bash scripts/setup.sh --render
    exec .venv/bin/gpuflow demo render
fi
if [[ "${1:-}" == "hpc" ]]; then
    bash scripts/setup.sh --hpc
    exec .venv/bin/gpuflow demo hpc
fi
bash scripts/setup.sh
if (($#)); then
    exec .venv/bin/gpuflow run "$@"
fi
exec .venv/bin/gpuflow demo
