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
exec .venv/bin/pytest -q -p no:cacheprovider "$@"
