"""Benchmarks that drive a running server over HTTP.

`kvserve bench serve` (in `serve.py`) load-tests any OpenAI-compatible server -- kvserve, vLLM,
llama.cpp's llama-server -- with prompts from `datasets.py`, and reports TTFT, TPOT, ITL,
end-to-end latency, throughput and goodput as measured by the client from the SSE stream.

Nothing here imports torch at import time; only the datasets that need the model's tokenizer
load it (and the default model's path lookup lives in a module that imports torch).
"""

from __future__ import annotations
