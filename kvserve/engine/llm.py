"""Offline API: hand over all prompts, get every output back, batched by the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from kvserve.engine.llm_engine import EngineArgs, build_engine
from kvserve.outputs import OutputKind, RequestOutput
from kvserve.sample.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """`LLM(model=...).generate(prompts, SamplingParams(...))`.

    Keyword arguments are those of EngineArgs (model, dtype, device, max_model_len,
    max_num_seqs, max_num_batched_tokens, block_size, kv_cache_memory, ...).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(known)}")
        self.engine = build_engine(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Persist the prefix cache to disk when a disk tier is configured."""
        self.engine.close()

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache's pool blocks (vLLM's LLM.reset_prefix_cache); the host
        and disk tiers keep theirs."""
        self.engine.reset_prefix_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = self.engine.add_requests(
            [(None, prompt, sp) for prompt, sp in zip(prompts, params, strict=True)],
            output_kind=OutputKind.FINAL_ONLY)
        return self._run(ids)

    def embed(self, prompts: str | Sequence[str] | Sequence[list[int]],
              pooling: str = "mean") -> list[list[float]]:
        """Each prompt's final hidden states pooled ("mean" over its tokens, or the "last"
        token's) and L2-normalised, in the order of `prompts`."""
        outs = self.generate(prompts, SamplingParams(max_tokens=1, pooling=pooling))
        return [o.embedding for o in outs]  # type: ignore[misc]

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True
                    ) -> list[int]:
        return self.engine.processor.encode_chat(messages, add_generation_prompt)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
