"""Per-request limits: what one request may ask of the server, each with a flag
(`kvserve serve --max-n ...`) and a 400 naming the field that went over.

They bound the work and memory one request can claim before it reaches the engine: samples,
logprobs, stop strings (matched against every output token), logit-bias entries (a tensor
entry each per step), prompts in one call, and prompt tokens. The body's size is the guard
middleware's (413, `--max-request-size`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.sample.sampling_params import MAX_LOGPROBS
from kvserve.settings import setting


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = setting(64, "samples per prompt")
    max_logprobs: int = setting(MAX_LOGPROBS, "logprobs, top_logprobs and prompt_logprobs")
    max_stop_strings: int = setting(16, "stop strings")
    max_stop_length: int = setting(256, "characters in one stop string")
    max_logit_bias: int = setting(1024, "logit_bias entries")
    max_prompts: int = setting(256, "prompts (or embedding inputs) in one request")
    max_prompt_tokens: int | None = setting(
        None, "tokens in one prompt (default: max_model_len)")

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop_strings", "max_stop_length", "max_logit_bias",
                     "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("--max-prompt-tokens must be >= 1")

    def check(self, body) -> None:
        """The sampling fields of a completions or chat body; APIError(400) naming the
        first field over its limit."""
        self._at_most("n", body.n, self.max_n, "--max-n")
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(body, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                self._at_most(name, value, self.max_logprobs, "--max-logprobs")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        self._at_most("stop", len(stop), self.max_stop_strings, "--max-stop-strings",
                      "stop strings")
        longest = max((len(s) for s in stop), default=0)
        self._at_most("stop", longest, self.max_stop_length, "--max-stop-length",
                      "characters in a stop string")
        self._at_most("logit_bias", len(body.logit_bias or {}), self.max_logit_bias,
                      "--max-logit-bias", "entries")

    def check_prompts(self, count: int, name: str) -> None:
        self._at_most(name, count, self.max_prompts, "--max-prompts", "prompts")

    def check_prompt_tokens(self, count: int, name: str) -> None:
        if self.max_prompt_tokens is not None:
            self._at_most(name, count, self.max_prompt_tokens, "--max-prompt-tokens",
                          "prompt tokens")

    @staticmethod
    def _at_most(name: str, value: int, limit: int, flag: str, what: str = "") -> None:
        if value > limit:
            # imported here: the parser reads these settings before the server (FastAPI)
            # is imported
            from kvserve.entrypoints.server.errors import APIError

            unit = f" {what}" if what else ""
            raise APIError(400, f"{name}: {value}{unit} is over this server's limit of "
                           f"{limit} ({flag})", name)
