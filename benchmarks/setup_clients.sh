#!/usr/bin/env bash
# Virtual environments for the external clients that judge kvserve (benchmarks/external_clients.py):
# guidellm 0.8.1 and lm-eval 0.4.13, each pinned by its constraints file here. torch 2.13.0 (the
# CPU build) goes in first: both ask for torch, and left to themselves they pull a CUDA build.
#   benchmarks/setup_clients.sh [DIR]     (default ~/.cache/kvserve-bench)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:-$HOME/.cache/kvserve-bench}"
for tool in guidellm lmeval; do
  venv="$dir/$tool-venv"
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/pip" install -q -c "$here/$tool-constraints.txt" torch==2.13.0
  if [ "$tool" = guidellm ]; then pkg=guidellm; else pkg="lm-eval[api,hf]"; fi
  "$venv/bin/pip" install -q -c "$here/$tool-constraints.txt" "$pkg"
done
echo "guidellm: $dir/guidellm-venv   lm-eval: $dir/lmeval-venv"
