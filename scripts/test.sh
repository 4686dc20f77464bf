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
# Tests run in parallel: most of their time is spent waiting on servers and jobs, so three
# workers keep 2 cores busy. Tests that share one server run on one worker (the groups in
# tests/conftest.py). GPUFLOW_TEST_WORKERS=0 runs them in this one process.
workers=${GPUFLOW_TEST_WORKERS:-3}
exec .venv/bin/pytest -q -p no:cacheprovider -n "$workers" --dist loadgroup "$@"
