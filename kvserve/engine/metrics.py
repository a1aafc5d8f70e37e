"""Prometheus metrics, fed from request outputs and the engine's state after every step.

Latencies are split the way they are felt: queue (arrival to first step), prefill (first step
to first token), time to first token, inter-token latency (gap between successive streamed
tokens), time per output token (decode time / (tokens - 1)) and end to end.

With latency targets (--target-ttft-ms, --target-itl-ms), every request that finishes
(stopped or at its length; not aborted or failed) counts in `kvserve:goodput_requests` under
the target it missed: `none` (a good request: goodput), `ttft`, `itl` or `both`. As in vLLM's
benchmark goodput, the ITL target is checked against the request's time per output token.

The queue, batch and KV-cache gauges are also published under vLLM's names, the ones the
Gateway API Inference Extension's model-server protocol lists for the metrics its endpoint
pickers scrape (cited below), so that llm-d's or KServe's picker reads kvserve as it
reads vLLM.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvserve.outputs import RequestOutput
from kvserve.sched.slo import LatencyTargets
from kvserve.stats import EngineStats, SpecState

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
            3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_LATENCY = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                  0.3, 0.5, 0.75, 1.0, 2.5)
_LENGTHS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_STEP = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
         2.0, 5.0)
STEP_PHASES = ("draft", "schedule", "prepare", "forward", "sample", "output", "total")
# Observed only under tensor parallelism: time in collectives, a part of forward and sample.
TP_PHASE = "all_reduce"
KV_IO_PHASE = "kv_io"  # only with prefix-cache tiers
GRAMMAR_PHASE = "grammar"  # only in steps with structured outputs
MISSED = ("none", "ttft", "itl", "both")  # goodput_requests' labels: which target was missed
# The Gateway API Inference Extension's model-server protocol (kubernetes-sigs/gateway-api-
# inference-extension, docs/proposals/003-model-server-protocol/README.md, as of its commit
# 25557e290ad41bec74d2313182df35d40b2c0cda): its table names the gauges the endpoint picker
# scrapes, and their vLLM names: TotalQueuedRequests vllm:num_requests_waiting,
# TotalRunningRequests vllm:num_requests_running, KVCacheUtilization vllm:kv_cache_usage_perc
# (as vLLM's, a fraction: 1 is a full cache). The document named vllm:gpu_cache_usage_perc,
# vLLM's older name, until cfdce59a (Nov 2025); only the current name is published here.


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 targets: LatencyTargets | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"kvserve:{name}", doc, labels, buckets=buckets,
                             registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", _LATENCY)
        self.itl = hist("inter_token_latency_seconds", "Gap between streamed tokens",
                        _TOKEN_LATENCY)
        self.tpot = hist("time_per_output_token_seconds",
                         "Decode time per output token after the first", _TOKEN_LATENCY)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency", _LATENCY)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled step",
                          _LATENCY)
        self.prefill = hist("request_prefill_time_seconds", "First step to first token",
                            _LATENCY)
        self.decode = hist("request_decode_time_seconds", "First token to finish", _LATENCY)
        self.prompt_len = hist("request_prompt_tokens", "Prompt length", _LENGTHS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens", _LENGTHS)
        self.running = Gauge("kvserve:num_requests_running", "Requests in the running batch",
                             labels, registry=r).labels(model_name)
        self.waiting = Gauge("kvserve:num_requests_waiting", "Requests waiting to be scheduled",
                             labels, registry=r).labels(model_name)
        self.kv_usage = Gauge("kvserve:kv_cache_usage_perc", "Fraction of KV blocks in use",
                              labels, registry=r).labels(model_name)
        # The same three under the names the gateway's endpoint pickers scrape (the
        # model-server protocol, cited above), set from the same snapshot in observe_stats.
        self.gateway_running = Gauge("vllm:num_requests_running", "Requests in the running "
                                     "batch (kvserve:num_requests_running, under the "
                                     "Gateway API Inference Extension's name)", labels,
                                     registry=r).labels(model_name)
        self.gateway_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be "
                                     "scheduled (kvserve:num_requests_waiting, under the "
                                     "Gateway API Inference Extension's name)", labels,
                                     registry=r).labels(model_name)
        self.gateway_kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in "
                                      "use (kvserve:kv_cache_usage_perc, under the Gateway "
                                      "API Inference Extension's name)", labels,
                                      registry=r).labels(model_name)
        self.prompt_tokens = Counter("kvserve:prompt_tokens", "Prompt tokens of finished "
                                     "requests", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("kvserve:generation_tokens", "Generated tokens",
                                         labels, registry=r).labels(model_name)
        self._success = Counter("kvserve:request_success", "Finished requests by reason",
                                ["model_name", "finished_reason"], registry=r)
        self._finish_labels = {reason: self._success.labels(model_name, reason)
                               for reason in ("stop", "length", "abort", "error")}
        self.preemptions = Counter("kvserve:num_preemptions", "Requests preempted by "
                                   "recompute", labels, registry=r).labels(model_name)
        self._prefix_queries = Counter("kvserve:prefix_cache_queries", "Prompt tokens looked "
                                       "up in the prefix cache", labels, registry=r)
        self._prefix_hits = Counter("kvserve:prefix_cache_hits", "Prompt tokens served from "
                                    "the prefix cache, by tier", ["model_name", "tier"],
                                    registry=r)
        self._tier_loads = Counter("kvserve:kv_tier_loads", "KV blocks copied back up from a "
                                   "lower tier", ["model_name", "tier"], registry=r)
        self._tier_saves = Counter("kvserve:kv_tier_saves", "KV blocks copied down into a "
                                   "lower tier", ["model_name", "tier"], registry=r)
        self._spec_drafts = Counter("kvserve:spec_decode_num_draft_tokens", "Draft tokens "
                                    "verified by the target", labels, registry=r)
        self._spec_accepted = Counter("kvserve:spec_decode_num_accepted_tokens", "Draft "
                                      "tokens accepted", labels, registry=r)
        self._spec_rounds = Counter("kvserve:spec_decode_num_drafts", "Drafts verified (a "
                                    "request's draft tokens of one step)", labels, registry=r)
        self._spec_drafts_at = Counter("kvserve:spec_decode_num_draft_tokens_per_pos",
                                       "Draft tokens verified, by position in the draft",
                                       ["model_name", "position"], registry=r)
        self._spec_accepted_at = Counter("kvserve:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the draft",
                                         ["model_name", "position"], registry=r)
        self._spec_off = Counter("kvserve:spec_decode_num_steps_off", "Steps without drafts "
                                 "because the batch exceeded max_batch_size", labels,
                                 registry=r)
        self._spec_config = Gauge("kvserve:spec_decode_config", "Speculative decoding policy "
                                  "(1 for the active config)",
                                  ["model_name", "method", "num_speculative_tokens",
                                   "max_batch_size", "min_acceptance"], registry=r)
        self._step_phase = Histogram("kvserve:engine_step_seconds", "Engine step time by "
                                     "phase (draft, schedule, prepare, forward, sample, "
                                     "output, total; all_reduce under tensor parallelism, "
                                     "part of forward and sample; kv_io with cache tiers; "
                                     "grammar with structured outputs)", ["model_name", "phase"],
                                     buckets=_STEP, registry=r)
        self._step_phases = {p: self._step_phase.labels(model_name, p) for p in STEP_PHASES}
        self.step_tokens = hist("engine_step_tokens", "Tokens computed per engine step",
                                _LENGTHS)
        self.targets = targets or LatencyTargets()
        self._goodput = None
        if self.targets:
            counter = Counter("kvserve:goodput_requests", "Finished requests by the latency "
                              "target they missed (none: good)", ["model_name", "missed"],
                              registry=r)
            self._goodput = {m: counter.labels(model_name, m) for m in MISSED}
        self.goodput_counts = dict.fromkeys(MISSED, 0)
        self.recent_finished: deque[tuple[float, bool]] = deque(maxlen=4000)  # (time, good)
        self.last_step = 0  # newest StepRecord.step observed
        # Recent samples for the dashboard's percentiles and throughput (bounded windows).
        self.recent_ttft: deque[float] = deque(maxlen=500)
        self.recent_itl: deque[float] = deque(maxlen=4000)
        self.recent_tokens: deque[tuple[float, int]] = deque(maxlen=4000)  # (time, tokens)
        self.model_name = model_name
        self._last_token: dict[str, tuple[float, int]] = {}  # request -> (time, tokens seen)
        self._seen: dict[tuple[str, str], int] = {}  # last totals behind each counter

    def observe_output(self, out: RequestOutput, now: float | None = None) -> None:
        """Account one output of a request (called for every step's outputs)."""
        now = time.perf_counter() if now is None else now
        tokens = sum(c.num_output_tokens for c in out.outputs)
        last = self._last_token.get(out.request_id)
        new = tokens - (last[1] if last else 0)
        if new > 0:
            self.generation_tokens.inc(new)
            self.recent_tokens.append((now, new))
            if last is not None:
                gap = (now - last[0]) / new
                for _ in range(new):
                    self.itl.observe(gap)
                    self.recent_itl.append(gap)
            self._last_token[out.request_id] = (now, tokens)
        if not out.finished:
            return
        self._last_token.pop(out.request_id, None)
        m = out.metrics
        if m.ttft is not None:
            self.recent_ttft.append(m.ttft)
        for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e_time),
                            (self.queue, m.queue_time), (self.prefill, m.prefill_time),
                            (self.decode, m.decode_time)):
            if value is not None:
                hist.observe(value)
        self.prompt_len.observe(m.num_prompt_tokens)
        self.gen_len.observe(m.num_generation_tokens)
        self.prompt_tokens.inc(m.num_prompt_tokens)
        reasons = {c.finish_reason for c in out.outputs}
        reason = "error" if out.error else ("abort" if "abort" in reasons else
                                            "length" if reasons == {"length"} else "stop")
        self._finish_labels[reason].inc()
        if self._goodput is not None and reason in ("stop", "length"):
            missed = self.targets.missed(m.ttft, m.tpot)
            self._goodput[missed].inc()
            self.goodput_counts[missed] += 1
            self.recent_finished.append((now, missed == "none"))

    def observe_stats(self, stats: EngineStats) -> None:
        """The engine's snapshot: gauges take its state, counters advance to its running
        totals, and its new step records go to the step histograms."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        self.gateway_running.set(stats.running)
        self.gateway_waiting.set(stats.waiting)
        self.gateway_kv_usage.set(stats.kv_usage)
        self._advance(self.preemptions, ("preemptions", ""), stats.num_preemptions)
        self._advance(self._prefix_queries.labels(self.model_name), ("queries", ""),
                      stats.prefix_queried_tokens)
        for tier, tokens in stats.prefix_hit_tokens:
            self._advance(self._prefix_hits.labels(self.model_name, tier), ("hits", tier),
                          tokens)
        for t in stats.tiers:
            self._advance(self._tier_loads.labels(self.model_name, t.name), ("load", t.name),
                          t.loads)
            self._advance(self._tier_saves.labels(self.model_name, t.name), ("save", t.name),
                          t.saves)
        if stats.spec is not None:
            self.observe_spec(stats.spec)
        self.observe_steps(stats.steps)

    def dashboard(self, now: float | None = None, window: float = 10.0) -> dict:
        """Recent figures: output tokens/s over the last `window` seconds, and TTFT / ITL
        percentiles (ms) over the last 500 requests / 4000 token gaps."""
        now = time.perf_counter() if now is None else now
        tokens = sum(n for t, n in list(self.recent_tokens) if t >= now - window)

        def pct(values) -> dict[str, float] | None:
            v = sorted(values)
            if not v:
                return None
            return {f"p{q}": round(1e3 * v[min(len(v) - 1, int(q / 100 * len(v)))], 3)
                    for q in (50, 90, 99)}

        return {"output_tokens_per_s": round(tokens / window, 2),
                "ttft_ms": pct(list(self.recent_ttft)), "itl_ms": pct(list(self.recent_itl)),
                "slo": self._slo(now, window)}

    def _slo(self, now: float, window: float) -> dict | None:
        """The targets (ms) and goodput: totals since start by missed target, and good
        requests per second over the last `window` seconds. None with no targets."""
        if self._goodput is None:
            return None
        t = self.targets
        count = self.goodput_counts
        good = sum(g for when, g in list(self.recent_finished) if when >= now - window)
        ms = lambda v: None if v is None else 1e3 * v  # noqa: E731
        return {"target_ttft_ms": ms(t.ttft_s), "target_itl_ms": ms(t.itl_s),
                "good": count["none"], "missed_ttft": count["ttft"],
                "missed_itl": count["itl"], "missed_both": count["both"],
                "goodput_per_s": round(good / window, 3)}

    def observe_steps(self, steps) -> None:
        """The engine's StepRecords (a bounded deque, oldest first) not seen yet; walks back
        from the newest only as far as the last one seen."""
        new = list(itertools.takewhile(lambda r: r.step > self.last_step, reversed(steps)))
        for rec in reversed(new):
            self.last_step = rec.step
            for phase, h in self._step_phases.items():
                h.observe(getattr(rec, phase))
            if rec.all_reduce:
                self._step_phase.labels(self.model_name, TP_PHASE).observe(rec.all_reduce)
            if rec.kv_io:
                self._step_phase.labels(self.model_name, KV_IO_PHASE).observe(rec.kv_io)
            if rec.grammar:
                self._step_phase.labels(self.model_name, GRAMMAR_PHASE).observe(rec.grammar)
            self.step_tokens.observe(rec.prefill_tokens + rec.decode_tokens)

    def observe_spec(self, stats: SpecState) -> None:
        """Speculative decoding: the policy (a gauge of 1 labelled with it) and its totals."""
        if ("spec", "config") not in self._seen:
            self._spec_config.labels(self.model_name, stats.method,
                                      str(stats.num_speculative_tokens),
                                      str(stats.max_batch_size),
                                      str(stats.min_acceptance)).set(1)
            self._seen[("spec", "config")] = 1
        self._advance(self._spec_drafts.labels(self.model_name), ("spec", "drafts"),
                      stats.num_drafts)
        self._advance(self._spec_accepted.labels(self.model_name), ("spec", "accepted"),
                      stats.num_accepted)
        self._advance(self._spec_off.labels(self.model_name), ("spec", "off"),
                      stats.num_steps_off)
        self._advance(self._spec_rounds.labels(self.model_name), ("spec", "rounds"),
                      stats.num_rounds)
        for i, (d, a) in enumerate(zip(stats.drafts_at, stats.accepted_at, strict=True)):
            self._advance(self._spec_drafts_at.labels(self.model_name, str(i)),
                          ("spec_drafts_at", str(i)), d)
            self._advance(self._spec_accepted_at.labels(self.model_name, str(i)),
                          ("spec_accepted_at", str(i)), a)

    def _advance(self, counter, key: tuple[str, str], total: int) -> None:
        seen = self._seen.get(key, 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[key] = total
