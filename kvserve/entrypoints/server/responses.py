"""Engine outputs -> OpenAI response bodies and stream chunks."""

from __future__ import annotations

import json
import time

from kvserve.entrypoints.server.chat_tools import ChatPlan, chat_message, finish_reason
from kvserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
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


def usage(outs: list[RequestOutput], prompt_only: bool = False) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = 0 if prompt_only else sum(c.num_output_tokens for o in outs
                                           for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Formatter:
    """Builds response bodies for one API request (id, model, creation time fixed)."""

    def __init__(self, tokenizer: Tokenizer, request_id: str, model: str, n: int,
                 token_ids_as_text: bool = False, echo_logprobs: bool = False,
                 prompt_only: bool = False, prompt_logprobs: bool = False) -> None:
        self.tok = tokenizer
        self.id = request_id
        self.model = model
        self.n = n
        self.created = int(time.time())
        self.token_ids_as_text = token_ids_as_text  # vLLM's return_tokens_as_token_ids
        self.echo_logprobs = echo_logprobs  # completions: logprobs start at the prompt
        self.prompt_only = prompt_only  # max_tokens 0: the echoed prompt, nothing generated
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs field

    def index(self, prompt_idx: int, c: CompletionOutput) -> int:
        return prompt_idx * self.n + c.index

    def token_text(self, token_id: int) -> str:
        if self.token_ids_as_text:
            return f"token_id:{token_id}"
        return self.tok.decode([token_id], skip_special_tokens=False)

    def _lp(self, value: float) -> float:
        return max(value, _LOGPROB_FLOOR)

    # ------------------------------------------------------------------ completions

    def completion_logprobs(self, lps: list[TokenLogprobs], offset: int,
                            prompt: RequestOutput | None = None) -> dict:
        """OpenAI's completion logprobs of `lps`; with `prompt` (echo), the prompt's tokens
        first, from offset 0 (the first has no logprob: nothing precedes it)."""
        tokens, token_lps, tops, offsets = [], [], [], []

        def add(token_id: int, lp: TokenLogprobs | None, at: int) -> int:
            text = self.token_text(token_id)
            tokens.append(text)
            token_lps.append(None if lp is None else self._lp(lp.logprob))
            tops.append(None if lp is None else
                        {self.token_text(t): self._lp(v) for t, v in lp.top})
            offsets.append(at)
            return at + len(text)

        if prompt is not None and prompt.prompt_logprobs is not None:
            at = 0
            for tid, lp in zip(prompt.prompt_token_ids, prompt.prompt_logprobs, strict=True):
                at = add(tid, lp, at)
        for lp in lps:
            offset = add(lp.token_id, lp, offset)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def vllm_prompt_logprobs(self, out: RequestOutput) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank,
        decoded_token}} for the token and the most likely ones."""
        if not self.prompt_logprobs or out.prompt_logprobs is None:
            return None
        result: list[dict | None] = []
        for lp in out.prompt_logprobs:
            if lp is None:
                result.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": self._lp(lp.logprob), "rank": lp.rank,
                                        "decoded_token": self.token_text(lp.token_id)}}
            for rank, (t, v) in enumerate(lp.top, 1):
                entry.setdefault(str(t), {"logprob": self._lp(v), "rank": rank,
                                          "decoded_token": self.token_text(t)})
            result.append(entry)
        return result

    def completion(self, outs: list[RequestOutput], echo_texts: list[str] | None) -> dict:
        choices = []
        for i, out in enumerate(outs):
            prefix = echo_texts[i] if echo_texts else ""
            for c in out.outputs:
                lps = None
                if c.logprobs is not None:
                    lps = self.completion_logprobs(
                        [] if self.prompt_only else c.logprobs, len(prefix),
                        out if self.echo_logprobs else None)
                choice = {
                    "index": self.index(i, c),
                    "text": prefix + ("" if self.prompt_only else c.text),
                    "logprobs": lps,
                    "finish_reason": "length" if self.prompt_only else c.finish_reason,
                    "stop_reason": None if self.prompt_only else c.stop_reason,
                }
                if self.prompt_logprobs:
                    choice["prompt_logprobs"] = self.vllm_prompt_logprobs(out)
                choices.append(choice)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices,
                "usage": usage(outs, self.prompt_only), "timings": timings(outs)}

    def completion_chunk(self, prompt_idx: int, c: CompletionOutput, text: str,
                         logprobs: list[TokenLogprobs] | None, offset: int,
                         prompt: RequestOutput | None = None) -> dict:
        """A stream chunk; `prompt` on a choice's first chunk when its logprobs start at the
        prompt (echo)."""
        finish = c.finish_reason
        if self.prompt_only:
            logprobs = None if logprobs is None else []
            finish = "length" if c.finished else None
        choice = {"index": self.index(prompt_idx, c), "text": text,
                  "logprobs": None if logprobs is None
                  else self.completion_logprobs(logprobs, offset,
                                                prompt if self.echo_logprobs else None),
                  "finish_reason": finish,
                  "stop_reason": None if self.prompt_only else c.stop_reason}
        if self.prompt_logprobs and prompt is not None:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(prompt)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [choice]}

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
        body = {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage([out]),
                "timings": timings([out])}
        if self.prompt_logprobs:
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(out)
        return body

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
