"""kvserve: an LLM inference engine with a paged KV cache and continuous batching."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput"]

if TYPE_CHECKING:
    from kvserve.engine.llm import LLM
    from kvserve.engine.llm_engine import EngineArgs, LLMEngine
    from kvserve.outputs import RequestOutput
    from kvserve.sample.sampling_params import SamplingParams


def __getattr__(name: str):
    # Lazy, so `import kvserve.entrypoints.cli` stays quick for --help and error messages.
    if name == "LLM":
        from kvserve.engine.llm import LLM
        return LLM
    if name in ("LLMEngine", "EngineArgs"):
        from kvserve.engine import llm_engine
        return getattr(llm_engine, name)
    if name == "RequestOutput":
        from kvserve.outputs import RequestOutput
        return RequestOutput
    if name == "SamplingParams":
        from kvserve.sample.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
