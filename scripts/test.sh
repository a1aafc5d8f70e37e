#!/usr/bin/env bash
# Set up (pinned) and run the whole test suite plus the linters. Extra args go to pytest.
#   scripts/test.sh            everything (what .ci/run calls)
#   scripts/test.sh --fast     the fast lane: the linters and the tests not marked slow
#                              (under 2 minutes on 2 cores); run it before each commit
#   scripts/test.sh --parallel the same in two pytest-xdist workers (both: --fast --parallel)
set -euo pipefail
cd "$(dirname "$0")/.."
lane=()
if [ "${1:-}" = "--fast" ]; then
  shift
  lane=(-m "not slow")
fi
if [ "${1:-}" = "--parallel" ]; then
  shift
  lane+=(-n 2)
fi
scripts/setup.sh --test
.venv/bin/ruff check kvserve tests benchmarks scripts
.venv/bin/lint-imports --no-cache
.venv/bin/python -m pytest -q "${lane[@]}" "$@"
