"""Engine outputs -> OpenAI response bodies and stream chunks."""

from __future__ import annotations

import json
import time

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampler import TokenLogprobs
from kvserve.server.chat_tools import ChatPlan, chat_message, finish_reason
from kvserve.tokenizer import Tokenizer

# JSON has no -inf; a floor like this is what OpenAI-compatible servers send instead.
_LOGPROB_FLOOR = -9999.0


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def timings(outs: list[RequestOutput]) -> dict | list[dict]:
    """Per-request timing breakdown (seconds): a dict for one prompt, a list for several."""
    items = [o.metrics.as_dict() for o in outs]
    return items[0] if len(items) == 1 else items


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(c.num_output_tokens for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Formatter:
    """Builds response bodies for one API request (id, model, creation time fixed)."""

    def __init__(self, tokenizer: Tokenizer, request_id: str, model: str, n: int) -> None:
        self.tok = tokenizer
        self.id = request_id
        self.model = model
        self.n = n
        self.created = int(time.time())

    def index(self, prompt_idx: int, c: CompletionOutput) -> int:
        return prompt_idx * self.n + c.index

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def _lp(self, value: float) -> float:
        return max(value, _LOGPROB_FLOOR)

    # ------------------------------------------------------------------ completions

    def completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            token_lps.append(self._lp(lp.logprob))
            tops.append({self.token_text(t): self._lp(v) for t, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def completion(self, outs: list[RequestOutput], echo_texts: list[str] | None) -> dict:
        choices = []
        for i, out in enumerate(outs):
            prefix = echo_texts[i] if echo_texts else ""
            for c in out.outputs:
                choices.append({
                    "index": self.index(i, c),
                    "text": prefix + c.text,
                    "logprobs": None if c.logprobs is None
                    else self.completion_logprobs(c.logprobs, len(prefix)),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                })
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage(outs),
                "timings": timings(outs)}

    def completion_chunk(self, prompt_idx: int, c: CompletionOutput, text: str,
                         logprobs: list[TokenLogprobs] | None, offset: int) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [{
                    "index": self.index(prompt_idx, c), "text": text,
                    "logprobs": None if logprobs is None
                    else self.completion_logprobs(logprobs, offset),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}

    # ------------------------------------------------------------------------- chat

    def chat_logprobs(self, lps: list[TokenLogprobs]) -> dict:
        def entry(token_id: int, value: float) -> dict:
            return {"token": self.token_text(token_id), "logprob": self._lp(value),
                    "bytes": list(self.tok.token_bytes(token_id))}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}

    def chat(self, out: RequestOutput, plan: ChatPlan) -> dict:
        choices = []
        for c in out.outputs:
            message, has_calls = chat_message(plan, c.text)
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": None if c.logprobs is None else self.chat_logprobs(c.logprobs),
                "finish_reason": finish_reason(c.finish_reason, has_calls),
                "stop_reason": c.stop_reason,
            })
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage([out]),
                "timings": timings([out])}

    def chat_chunk(self, index: int, delta: dict, finish: str | None = None,
                   logprobs: list[TokenLogprobs] | None = None,
                   stop_reason: str | int | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [{
                    "index": index, "delta": delta,
                    "logprobs": None if logprobs is None else self.chat_logprobs(logprobs),
                    "finish_reason": finish, "stop_reason": stop_reason}]}

    def usage_chunk(self, outs: list[RequestOutput], obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": usage(outs), "timings": timings(outs)}
