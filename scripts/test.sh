#!/usr/bin/env bash
# Set up (pinned) and run the whole test suite plus the linter. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
.venv/bin/ruff check kvserve tests benchmarks
.venv/bin/lint-imports --no-cache
.venv/bin/python -m pytest -q "$@"
