#!/usr/bin/env bash
# The GPU acceptance check, one command, one table (scripts/gpu_check.py says what it
# checks). Sets up .venv first (with Blender and Open MPI) if needed. On a host without a
# GPU it says so, runs the CPU parts and exits 0. Pass --quick for smaller sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] && .venv/bin/python -c 'import gpuflow, torch' 2>/dev/null || bash scripts/setup.sh --render >&2
command -v blender >/dev/null || bash scripts/setup.sh --render >&2
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
exec .venv/bin/python scripts/gpu_check.py "$@"
