"""`kvserve bench serve` against a fake OpenAI-compatible server whose timing we control.

The fake streams one token per chunk: the first after FIRST_DELAY, then one every GAP, then a
usage chunk. What the benchmark measures must match what the fake did, within tolerances loose
enough for a busy two-core CI machine.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' annotations
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvserve.bench.client import (
    BenchError,
    RequestRecord,
    ServeBenchConfig,
    arrival_offsets,
    build_payload,
    join_url,
)
from kvserve.bench.datasets import (
    DatasetConfig,
    DatasetError,
    RandomText,
    SampleRequest,
    load_requests,
    load_tokenizer,
)
from kvserve.bench.report import Stats, format_report, meets_slos, parse_goodput, summarize
from kvserve.bench.serve import benchmark
from kvserve.entrypoints.cli import main
from tests.conftest import byte_level_tokenizer_json

FIRST_DELAY = 0.05
GAP = 0.01
SLACK = 0.15  # scheduling noise we tolerate on a loaded machine, in seconds
# Single measurements (not medians) can catch one stall of a shared machine (a 0.26 s one was
# seen); their upper bounds only guard against gross errors, the lower bounds stay exact.
LOOSE = 1.0


# ------------------------------------------------------------------------------ fake server


@dataclass
class FakeServer:
    """State of the fake: how it streams, and what it saw. A prompt containing "http500" gets
    a 500, "errevent" an error event after one token, "empty" a stream without text."""

    url: str = ""
    first_delay: float = FIRST_DELAY
    gap: float = GAP
    send_usage: bool = True
    in_flight: int = 0
    peak: int = 0
    bodies: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    # /metrics with kvserve's speculative-decoding counters (404 when False); per request
    # served: 2 drafts of 3 tokens, accepted 2, 1 and 0 at positions 0, 1 and 2.
    spec_metrics: bool = False
    served: int = 0

    def reset(self) -> None:
        self.spec_metrics, self.served = False, 0
        self.first_delay, self.gap, self.send_usage = FIRST_DELAY, GAP, True
        self.in_flight = self.peak = 0
        self.bodies.clear()
        self.arrivals.clear()


def make_app(fake: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        fake.arrivals.append(time.perf_counter())
        fake.bodies.append(body)
        prompt = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        if "http500" in prompt:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        n = 0 if "empty" in prompt else int(body["max_tokens"])
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                 "total_tokens": len(prompt.split()) + n}

        def chunk(text: str | None, finish: str | None = None, **extra) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return "data: " + json.dumps({"choices": [choice], **extra}) + "\n\n"

        async def stream():
            fake.in_flight += 1
            fake.peak = max(fake.peak, fake.in_flight)
            try:
                if chat:  # the role chunk comes at once and carries no text: not the first token
                    yield chunk("", **{"object": "chat.completion.chunk"})
                for i in range(n):
                    await asyncio.sleep(fake.first_delay if i == 0 else fake.gap)
                    yield chunk(f"t{i} ")
                    if "errevent" in prompt:
                        yield "data: " + json.dumps({"error": {"message": "overloaded"}}) + "\n\n"
                        return
                yield chunk(None, "length")
                if fake.send_usage and body.get("stream_options", {}).get("include_usage"):
                    timings = {"queue_time": fake.first_delay / 2, "num_preemptions": 0}
                    yield "data: " + json.dumps({"choices": [], "usage": usage,
                                                 "timings": timings}) + "\n\n"
                fake.served += 1
                yield "data: [DONE]\n\n"
            finally:
                fake.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        if not fake.spec_metrics:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        n, m = fake.served, 'model_name="fake-model"'
        lines = [f"kvserve:spec_decode_num_drafts_total{{{m}}} {2.0 * n}",
                 f"kvserve:spec_decode_num_drafts_created{{{m}}} 1.7e9",
                 f"kvserve:spec_decode_num_draft_tokens_total{{{m}}} {6.0 * n}",
                 f"kvserve:spec_decode_num_accepted_tokens_total{{{m}}} {3.0 * n}",
                 f"kvserve:spec_decode_num_steps_off_total{{{m}}} 0.0",
                 f'kvserve:spec_decode_config{{{m},method="ngram"}} 1.0']
        for pos, acc in enumerate((2, 1, 0)):
            lines.append(f'kvserve:spec_decode_num_draft_tokens_per_pos_total{{{m},'
                         f'position="{pos}"}} {2.0 * n}')
            lines.append(f'kvserve:spec_decode_num_accepted_tokens_per_pos_total{{{m},'
                         f'position="{pos}"}} {float(acc * n)}')
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def server_state():
    import uvicorn

    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(make_app(fake), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield fake
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fake(server_state: FakeServer) -> FakeServer:
    server_state.reset()
    return server_state


def run_bench(fake: FakeServer, requests, **kw):
    cfg = ServeBenchConfig(base_url=fake.url, warmup=0, progress=False, **kw)
    return asyncio.run(benchmark(cfg, requests))


def prompts(n: int, output_len: int = 8, text: str = "one two three", **kw) -> list[SampleRequest]:
    return [SampleRequest(prompt=text, output_len=output_len, prompt_len=99, **kw)
            for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------ measuring streams


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_measures_what_the_server_did(fake, endpoint):
    n_tok = 8
    result = run_bench(fake, prompts(4, n_tok, system="be brief. "), endpoint=endpoint)
    s = result.summary
    assert result.model == "fake-model"  # from GET /v1/models
    assert (s.completed, s.failed, s.short_outputs) == (4, 0, 0)
    for r in result.records:
        assert r.usage_reported and r.output_tokens == n_tok and r.content_chunks == n_tok
        assert r.finish_reason == "length"
        assert FIRST_DELAY <= r.ttft < FIRST_DELAY + LOOSE
        assert len(r.itl) == n_tok - 1
        assert GAP * 0.9 <= float(np.median(r.itl)) < GAP + SLACK / 3
        expected_e2e = FIRST_DELAY + (n_tok - 1) * GAP
        assert expected_e2e <= r.e2el < expected_e2e + LOOSE
        assert r.ttft + sum(r.itl) <= r.e2el  # the parts fit in the whole
        assert GAP * 0.9 <= r.tpot < GAP + SLACK / 3
    # usage.prompt_tokens (words of the prompt, in the fake) replaces the dataset's 99
    words = 5  # "be brief. one two three"
    assert s.total_input_tokens == 4 * words
    assert s.total_output_tokens == 4 * n_tok
    assert s.request_throughput == pytest.approx(4 / s.duration_s)
    assert s.total_token_throughput == pytest.approx((4 * words + 4 * n_tok) / s.duration_s)
    assert s.ttft_ms.count == 4 and s.itl_ms.count == 4 * (n_tok - 1)
    assert s.peak_concurrency == fake.peak == 4

    body = fake.bodies[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == n_tok
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    if endpoint.endswith("chat/completions"):
        assert body["messages"] == [{"role": "system", "content": "be brief. "},
                                    {"role": "user", "content": "one two three"}]
    else:
        assert body["prompt"] == "be brief. one two three"


def test_counts_chunks_when_the_server_sends_no_usage(fake):
    fake.send_usage = False
    result = run_bench(fake, prompts(2, 5), model="named")
    for r in result.records:
        assert not r.usage_reported and r.output_tokens == 5 and r.prompt_len == 99
    assert result.summary.total_input_tokens == 2 * 99
    assert {b["model"] for b in fake.bodies} == {"named"}


def test_failures_are_counted_and_do_not_stop_the_run(fake):
    reqs = (prompts(3, 4) + prompts(2, 4, text="http500") + prompts(1, 4, text="errevent")
            + prompts(1, 4, text="empty"))
    result = run_bench(fake, reqs)
    s = result.summary
    assert (s.completed, s.failed) == (3, 4)
    assert len(fake.bodies) == 7
    errors = [r.error for r in result.records if r.error]
    assert sum(e.startswith("HTTP 500") and "boom" in e for e in errors) == 2
    assert any("error event" in e and "overloaded" in e for e in errors)
    assert any(e.startswith("empty output") for e in errors)
    assert s.total_output_tokens == 3 * 4  # failed requests add nothing
    report = format_report(result)
    assert "Failed requests:" in report and "error (2x): HTTP 500" in report


def test_max_concurrency_bounds_requests_in_flight(fake):
    result = run_bench(fake, prompts(10, 3), max_concurrency=3)
    assert result.summary.completed == 10
    assert fake.peak == 3 and result.summary.peak_concurrency == 3


def test_timeouts_fail_the_request(fake):
    fake.first_delay = 1.0
    result = run_bench(fake, prompts(2, 2), timeout=0.2)
    assert result.summary.failed == 2
    assert all(r.error == "timed out after 0.2 s" for r in result.records)


def test_warmup_requests_are_not_counted(fake):
    cfg = ServeBenchConfig(base_url=fake.url, warmup=2, progress=False)
    result = asyncio.run(benchmark(cfg, prompts(3, 2)))
    assert len(fake.bodies) == 5 and len(result.records) == 3


def test_a_failing_warmup_stops_with_a_clear_error(fake):
    cfg = ServeBenchConfig(base_url=fake.url, warmup=1, progress=False)
    with pytest.raises(BenchError, match="warm-up request failed: HTTP 500"):
        asyncio.run(benchmark(cfg, prompts(3, 2, text="http500")))


# ---------------------------------------------------------------------------------- arrivals


def test_arrival_offsets_follow_the_gamma_process():
    rate, n = 10.0, 4000
    poisson = arrival_offsets(n, rate, 1.0, seed=3)
    gaps = np.diff(poisson)
    assert poisson[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    steady = np.diff(arrival_offsets(n, rate, 4.0, seed=3))
    assert steady.mean() == pytest.approx(1 / rate, rel=0.05)
    assert steady.std() / steady.mean() == pytest.approx(0.5, rel=0.1)  # gamma(k): CV 1/sqrt(k)
    np.testing.assert_array_equal(poisson, arrival_offsets(n, rate, 1.0, seed=3))
    assert not np.array_equal(poisson, arrival_offsets(n, rate, 1.0, seed=4))
    assert np.all(arrival_offsets(5, math.inf, 1.0, seed=0) == 0)


def test_requests_are_sent_at_their_poisson_arrival_times(fake):
    fake.first_delay = fake.gap = 0.002
    rate, n = 40.0, 12
    result = run_bench(fake, prompts(n, 2), request_rate=rate, seed=7)
    assert len(fake.bodies) == n and result.summary.completed == n
    expected = arrival_offsets(n, rate, 1.0, seed=7)
    starts = np.array(sorted(r.start for r in result.records))
    # Never early, to the millisecond: a client that ignored the schedule (all at once, or
    # at a steady rate) sends some request before its time. Late only by what a loaded
    # machine may stall (LOOSE): a wall-clock bound any tighter flakes on 2 shared cores.
    assert np.all(starts >= expected - 1e-3)
    assert np.all(starts < expected + LOOSE)
    assert result.summary.duration_s >= expected[-1]
    seen = np.array(fake.arrivals) - fake.arrivals[0]
    np.testing.assert_allclose(seen, expected - expected[0], atol=LOOSE)


# ----------------------------------------------------------------------------------- the CLI


def test_cli_run_saves_every_figure(fake, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a b c", "output_len": 3}\n\n{"prompt": "d e", "max_tokens": 2}\n'
                    '{"prompt": "f"}\n')
    out = tmp_path / "res" / "result.json"
    rc = main(["bench", "serve", "--base-url", fake.url + "/v1", "--dataset", "jsonl",
               "--dataset-path", str(data), "--output-len", "4", "--max-concurrency", "2",
               "--goodput", "ttft:5000", "tpot:1000", "--save-result", str(out),
               "--endpoint", "/v1/chat/completions", "--extra-body", '{"top_k": 5}',
               "--no-ignore-eos"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = captured.out
    print(report)
    for label in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Request goodput (req/s):", "Output token throughput (tok/s):",
                  "Median TTFT (ms):", "P99 TPOT (ms):", "P90 ITL (ms):", "Max E2EL (ms):",
                  "Maximum request concurrency:", "Request rate configured (RPS):"):
        assert label in report
    saved = json.loads(out.read_text())
    assert saved["model"] == "fake-model"
    assert saved["config"]["max_concurrency"] == 2 and saved["config"]["request_rate"] == "inf"
    assert saved["config"]["dataset"]["name"] == "jsonl"
    assert "api_key" not in saved["config"]
    summary = saved["summary"]
    assert summary["completed"] == 3 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 3 + 2 + 4
    assert summary["good_requests"] == 3 and summary["goodput"] > 0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(summary[metric]) >= {"mean", "median", "p90", "p99", "std", "max"}
    recs = saved["requests"]
    assert sorted(r["output_len"] for r in recs) == [2, 3, 4]
    assert all(len(r["itl_ms"]) == r["output_len"] - 1 and r["error"] is None for r in recs)
    assert all(r["ttft_ms"] > 0 and r["e2el_ms"] >= r["ttft_ms"] for r in recs)
    # warm-up + 3; --extra-body merged, --no-ignore-eos leaves the field out
    assert len(fake.bodies) == 4
    assert all(b["top_k"] == 5 and "ignore_eos" not in b for b in fake.bodies)


@pytest.mark.parametrize("args, message", [
    (["--dataset", "jsonl", "--dataset-path", "/no/such/file.jsonl"],
     "dataset file not found: /no/such/file.jsonl"),
    (["--dataset", "jsonl"], "needs --dataset-path"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--shared-prefix-groups", "2", "--prompts-per-group", "3", "--num-prompts", "5",
      "--dataset", "shared-prefix"], "groups x"),
    (["--base-url", "localhost:8000"], "must start with http://"),
])
def test_cli_errors_exit_2_without_traceback(args, message, capsys):
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_cli_names_an_unreachable_server(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    rc = main(["bench", "serve", "--base-url", url, "--model", "m"])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot reach the server at {url}" in err


@pytest.mark.parametrize("args, message", [
    (["--dataset", "sharegpt"], "invalid choice: 'sharegpt'"),
    (["--goodput", "ttft=500"], "--goodput"),
    (["--goodput", "latency:5"], "ttft, tpot, e2el"),
    (["--extra-body", "{oops"], "--extra-body: not valid JSON"),
    (["--request-rate", "0"], "--request-rate: must be > 0"),
])
def test_cli_rejects_bad_flags(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err


def test_importing_the_benchmark_does_not_import_torch():
    code = "import sys, kvserve.bench.serve; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_join_url_accepts_a_base_with_v1():
    assert join_url("http://h:1/v1/", "/v1/completions") == "http://h:1/v1/completions"
    assert join_url("http://h:1", "v1/models") == "http://h:1/v1/models"


def test_payload_merges_extra_body_last():
    cfg = ServeBenchConfig(extra_body={"temperature": 0.5, "seed": 1}, ignore_eos=False,
                           endpoint="/v1/chat/completions")
    body = build_payload(cfg, "m", SampleRequest(prompt="hi", output_len=3))
    assert body["temperature"] == 0.5 and body["seed"] == 1 and "ignore_eos" not in body
    assert body["messages"] == [{"role": "user", "content": "hi"}]


# ----------------------------------------------------------------------------------- metrics


def record(ttft_ms: float, e2el_ms: float, tokens: int, error: str | None = None):
    return RequestRecord(prompt_len=10, max_tokens=tokens, ttft=ttft_ms / 1e3,
                         e2el=e2el_ms / 1e3, output_tokens=tokens, error=error)


def test_stats_use_linear_percentiles():
    s = Stats.of([float(x) for x in range(1, 101)])
    assert (s.mean, s.median, s.max, s.count) == (50.5, 50.5, 100.0, 100)
    assert s.p90 == pytest.approx(90.1) and s.p99 == pytest.approx(99.01)
    assert s.std == pytest.approx(np.std(np.arange(1, 101)))
    assert Stats.of([]) is None


def test_summary_and_goodput_on_hand_made_records():
    recs = [
        record(100, 1000, 10),   # tpot 100 ms
        record(400, 490, 10),    # tpot 10 ms
        record(600, 690, 10),    # ttft too slow
        record(50, 50, 1),       # one token: no tpot, cannot miss the tpot SLO
        record(10, 20, 5, error="HTTP 500: x"),
    ]
    slos = {"ttft": 500.0, "tpot": 50.0}
    assert [meets_slos(r, slos) for r in recs] == [False, True, False, True, False]
    s = summarize(recs, duration_s=2.0, slos_ms=slos, peak_concurrency=3)
    assert (s.completed, s.failed, s.good_requests) == (4, 1, 2)
    assert s.goodput == pytest.approx(1.0) and s.request_throughput == pytest.approx(2.0)
    assert s.total_input_tokens == 40 and s.total_output_tokens == 31
    assert s.output_throughput == pytest.approx(15.5)
    assert s.total_token_throughput == pytest.approx(35.5)
    assert s.tpot_ms.count == 3 and s.tpot_ms.mean == pytest.approx((100 + 10 + 10) / 3)
    assert s.ttft_ms.median == pytest.approx(250.0)
    assert s.errors == {"HTTP 500: x": 1}
    assert summarize(recs, 2.0).goodput is None
    assert summarize(recs, 2.0, {"e2el": 700.0}).good_requests == 3


def test_parse_goodput():
    assert parse_goodput(["ttft:500 tpot:50", "e2el:2000"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_goodput(["TTFT:1.5,tpot:2"]) == {"ttft": 1.5, "tpot": 2.0}
    for bad in (["ttft"], ["ttft:abc"], ["ttft:-1"], ["itl:5"], ["ttft:1 ttft:2"], [""]):
        with pytest.raises(BenchError):
            parse_goodput(bad)


# ---------------------------------------------------------------------------------- datasets


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    """One token per byte: re-encoding always round-trips, so lengths are exact."""
    root = tmp_path_factory.mktemp("byte-tok")
    (root / "tokenizer.json").write_text(byte_level_tokenizer_json())
    return load_tokenizer(str(root))


@pytest.fixture(scope="module")
def real_tokenizer(real_model_path):
    return load_tokenizer(None)


def count(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def test_random_prompts_on_a_byte_tokenizer(byte_tokenizer):
    cfg = DatasetConfig(num_prompts=20, random_input_len=30, random_output_len=7,
                        random_range_ratio=0.5, random_prefix_len=5)
    reqs = load_requests(cfg, byte_tokenizer)
    assert len(reqs) == 20
    prefix = reqs[0].prompt[:5]
    for r in reqs:
        assert r.prompt.startswith(prefix) and r.system == ""
        assert 5 + 15 <= r.prompt_len <= 5 + 45 and r.prompt_len == count(byte_tokenizer, r.text)
        assert 3 <= r.output_len <= 10
    assert len({r.prompt_len for r in reqs}) > 1 and len({r.output_len for r in reqs}) > 1
    assert load_requests(cfg, byte_tokenizer) == reqs  # seeded
    assert load_requests(DatasetConfig(num_prompts=20, seed=1), byte_tokenizer) != reqs


@pytest.mark.slow
@pytest.mark.real_model
def test_random_prompts_hit_the_target_length(real_tokenizer):
    cfg = DatasetConfig(num_prompts=40, random_input_len=200, random_output_len=16,
                        random_prefix_len=50)
    reqs = load_requests(cfg, real_tokenizer)
    common = os.path.commonprefix([r.prompt for r in reqs])
    assert count(real_tokenizer, common) >= 49  # the shared random prefix
    for r in reqs:
        assert r.prompt_len == count(real_tokenizer, r.text)
        assert abs(r.prompt_len - 250) <= 1  # documented tolerance; exact in practice
        assert r.output_len == 16
        assert not any(real_tokenizer.is_special(i)
                       for i in real_tokenizer.encode(r.text, add_special_tokens=False))
    maker = RandomText(real_tokenizer, np.random.default_rng(0))
    for n in (1, 2, 7, 64, 513):
        text, total = maker.make(n)
        assert total == count(real_tokenizer, text) and abs(total - n) <= 1


@pytest.mark.real_model
def test_shared_prefix_prompts_share_the_exact_prefix(real_tokenizer):
    cfg = DatasetConfig(name="shared-prefix", shared_prefix_groups=3, prompts_per_group=4,
                        system_prompt_len=100, question_len=20, output_len=9)
    reqs = load_requests(cfg, real_tokenizer)
    assert len(reqs) == 12
    groups: dict[str, list[SampleRequest]] = {}
    for r in reqs:
        groups.setdefault(r.system, []).append(r)
        assert r.text.startswith(r.system) and r.output_len == 9
        assert abs(r.prompt_len - 120) <= 1 and abs(count(real_tokenizer, r.system) - 100) <= 1
    assert len(groups) == 3 and all(len(g) == 4 for g in groups.values())
    assert all(len({r.prompt for r in g}) == 4 for g in groups.values())
    # the groups interleave, so a prefix cache sees them arrive mixed
    assert [r.system for r in reqs] != sorted(r.system for r in reqs)


def test_shared_prefix_on_a_byte_tokenizer(byte_tokenizer):
    cfg = DatasetConfig(name="shared-prefix", shared_prefix_groups=2, prompts_per_group=3,
                        system_prompt_len=12, question_len=4)
    reqs = load_requests(cfg, byte_tokenizer)
    assert len({r.system for r in reqs}) == 2
    assert all(count(byte_tokenizer, r.system) == 12 and r.prompt_len == 16 for r in reqs)


def test_jsonl_dataset(tmp_path, byte_tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"prompt": "x", "output_len": 3}\n'
                    '{"prompt": "y", "max_tokens": 5}\n{"prompt": "z"}\n')
    cfg = DatasetConfig(name="jsonl", dataset_path=str(path), output_len=11, num_prompts=3)
    reqs = load_requests(cfg)
    assert [(r.prompt, r.output_len, r.prompt_len) for r in reqs] == [
        ("hello", 11, None), ("x", 3, None), ("y", 5, None)]
    assert load_requests(cfg, byte_tokenizer)[0].prompt_len == 5
    assert len(load_requests(DatasetConfig(name="jsonl", dataset_path=str(path)))) == 4


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\n{"prompt": ', ":2: not valid JSON"),
    ('["a"]\n', ":1: expected a JSON object"),
    ('{"text": "a"}\n', ':1: "prompt" must be a non-empty string'),
    ('{"prompt": "a", "output_len": 0}\n', ':1: "output_len" must be a positive integer'),
    ('{"prompt": "a", "max_tokens": "5"}\n', ':1: "output_len" must be a positive integer'),
    ("\n\n", "no prompts in the file"),
])
def test_jsonl_errors_name_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message.replace("[", r"\[")) as info:
        load_requests(DatasetConfig(name="jsonl", dataset_path=str(path)))
    assert str(path) in str(info.value)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetError, match="--tokenizer"):
        load_tokenizer(str(tmp_path / "nope.gguf"))


def test_reports_speculative_decoding_from_server_metrics(fake):
    fake.served = 5  # counts before the run must not leak into its figures
    fake.spec_metrics = True
    result = run_bench(fake, prompts(4))
    assert result.spec_decode == {
        "drafts": 8, "draft_tokens": 24, "accepted_tokens": 12, "acceptance_rate": 0.5,
        "mean_acceptance_length": 2.5, "acceptance_rate_per_position": [1.0, 0.5, 0.0],
        "steps_without_speculation": 0}
    report = format_report(result)
    assert "Speculative Decoding" in report and "100.0 50.0 0.0" in report
    assert "Mean acceptance length:" in report


def test_no_speculation_section_without_server_metrics(fake):
    result = run_bench(fake, prompts(2))
    assert result.spec_decode is None
    assert "Speculative Decoding" not in format_report(result)


@pytest.mark.slow
def test_cli_plots(fake, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "p {i}", "output_len": {3 + i}}}\n' for i in range(6)))
    rc = main(["bench", "serve", "--base-url", fake.url, "--dataset", "jsonl", "--dataset-path",
               str(data), "--max-concurrency", "3", "--no-progress", "--plot",
               str(tmp_path / "plots")])
    err = capsys.readouterr().err
    assert rc == 0, err
    for name in ("latency.png", "throughput.png", "waterfall.png"):
        path = tmp_path / "plots" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
        assert f"plot written to {path}" in err


def test_server_timings_are_recorded(fake):
    result = run_bench(fake, prompts(2))
    assert all(r.server_timings == {"queue_time": FIRST_DELAY / 2, "num_preemptions": 0}
               for r in result.records)


def test_timeline_segments():
    from kvserve.request import timeline_segments

    t = {"samples": [{"events": [
        {"t": 0.0, "event": "arrival"}, {"t": 0.1, "event": "prefill", "tokens": 8},
        {"t": 0.2, "event": "prefill", "tokens": 3}, {"t": 0.3, "event": "first_token"},
        {"t": 0.3, "event": "decode", "end": 0.5}, {"t": 0.55, "event": "preempted"},
        {"t": 0.7, "event": "resumed"}, {"t": 0.7, "event": "prefill", "tokens": 14},
        {"t": 0.8, "event": "decode", "end": 0.9}, {"t": 0.95, "event": "finished"}]}]}
    assert timeline_segments(t["samples"][0]["events"]) == [
        ("queue", 0.0, 0.1), ("prefill", 0.1, 0.2), ("prefill", 0.2, 0.3),
        ("decode", 0.3, 0.55), ("preempted", 0.55, 0.7), ("prefill", 0.7, 0.8),
        ("decode", 0.8, 0.95)]
