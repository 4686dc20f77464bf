#!/usr/bin/env bash
# Sets up .venv with the test tools (and Debian's prometheus-pushgateway), then runs
# ruff, import-linter's contracts and the whole pytest suite, end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports --no-cache  # the import rules in pyproject.toml
.venv/bin/mypy  # gpuflow/ (tasks/, flows/, blocks/ through it): [tool.mypy] in pyproject.toml
# Tests run in parallel: four workers keep 2 cores busy (1.79 cores on average; with three,
# 0.3 of a core stood idle while tests waited on jobs, servers and Slurm's requeue delays:
# the suite took 1,326-1,408 s, with four 1,268 s). Tests that share one server run on one
# worker (the groups in tests/conftest.py). GPUFLOW_TEST_WORKERS=0 runs them in one process.
workers=${GPUFLOW_TEST_WORKERS:-4}
exec .venv/bin/pytest -q -p no:cacheprovider -n "$workers" --dist loadgroup "$@"
