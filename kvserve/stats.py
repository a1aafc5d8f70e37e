"""What the engine reports about itself: step records, speculation totals, and the
immutable snapshot (`EngineStats`) that the engine thread publishes after every step, which
the server, dashboard and metrics read from other threads without locks or retries."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class StepRecord:
    """One engine step: what ran and where its time went (seconds). On a GPU, forward and
    sample are only separated where the sampler copies results to the host."""

    step: int
    time: float  # unix time at the start of the step
    num_requests: int
    prefill_tokens: int
    decode_tokens: int  # decode tokens including drafts being verified
    draft_tokens: int
    preempted: int
    draft: float  # proposing speculative drafts
    schedule: float
    prepare: float  # input tensors and attention metadata
    forward: float
    sample: float  # logits, sampling or verification
    output: float  # appending tokens, detokenizing, stop checks, outputs
    total: float
    all_reduce: float = 0.0  # tensor parallelism: collectives, part of forward and sample
    kv_io: float = 0.0  # prefix-cache tiers: copies to and from host and disk, before forward
    grammar: float = 0.0  # structured outputs: the constrained rows' token masks
    # recovery from steps over the ITL target (Scheduler._recover): requests sent back to the
    # queue and queued ones refused (429); its preemptions count in `preempted`
    requeued: int = 0
    refused: int = 0
    # Of forward, the seconds in each phase of the C++ layer loop that took any (run_layers:
    # qkv_proj, attention, o_proj, mlp, moe_router, moe_experts, moe_combine,
    # moe_shared_expert); empty where the layers ran as torch modules.
    layers: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict:
        def rounded(v: object) -> object:
            if isinstance(v, dict):
                return {k: rounded(x) for k, x in v.items()}
            return round(v, 6) if isinstance(v, float) else v
        return {k: rounded(v) for k, v in asdict(self).items()}


class _AcceptanceRates:
    """The rates of speculative decoding's totals (num_drafts, num_accepted, num_rounds)."""

    num_drafts: int
    num_accepted: int
    num_rounds: int

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields per request on average: accepted drafts + 1."""
        return 1 + self.num_accepted / self.num_rounds if self.num_rounds else 0.0


@dataclass
class SpecStats(_AcceptanceRates):
    """Running totals of speculative decoding, for metrics and benchmarks."""

    num_drafts: int = 0  # draft tokens verified
    num_accepted: int = 0  # of those, accepted
    num_rounds: int = 0  # request-steps that verified at least one draft
    num_steps_off: int = 0  # steps where the batch was too large to speculate
    # per draft position i (0-based): drafts verified there, and accepted there
    drafts_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def count(self, drafted: int, accepted: int) -> None:
        self.num_drafts += drafted
        self.num_accepted += accepted
        self.num_rounds += 1
        while len(self.drafts_at) < drafted:
            self.drafts_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafts_at[i] += 1
            self.accepted_at[i] += i < accepted


@dataclass(frozen=True)
class TierState:
    """One lower tier of the prefix cache (host memory or disk)."""

    name: str
    blocks: int
    capacity_blocks: int | None
    loads: int  # blocks served from this tier since start
    saves: int  # blocks written to it since start


@dataclass(frozen=True)
class SpecState(_AcceptanceRates):
    """Speculative decoding: the policy and a copy of its running totals."""

    method: str
    num_speculative_tokens: int
    max_batch_size: int
    min_acceptance: float
    num_drafts: int
    num_accepted: int
    num_rounds: int
    num_steps_off: int
    drafts_at: tuple[int, ...]
    accepted_at: tuple[int, ...]


@dataclass(frozen=True)
class EngineStats:
    """The engine between two steps. Built on the engine thread from copies, never changed
    afterwards: a reader on any thread may keep it as long as it likes."""

    num_steps: int
    running: int
    waiting: int
    num_preemptions: int
    kv_usage: float
    kv_blocks: int
    kv_free_blocks: int
    block_size: int
    tiers: tuple[TierState, ...] = ()
    prefix_queried_tokens: int = 0
    # prompt tokens served by the prefix cache, per tier ("device" is the fast pool)
    prefix_hit_tokens: tuple[tuple[str, int], ...] = ()
    spec: SpecState | None = None
    steps: tuple[StepRecord, ...] = ()  # the step profiler's recent records, oldest first
    # the step cost model's coefficients (seconds: fixed, per prefill token, per decode row,
    # per 1024 attended pairs; kvserve.sched.slo), None until fitted; and the prompt tokens the
    # last step sized under the ITL target allowed, and the factor predicted TTFTs are
    # scaled by (measured / predicted of recent requests; TTFTPredictor.calibration)
    step_cost: tuple[float, float, float, float] | None = None
    prompt_allowance: int | None = None
    ttft_calibration: float = 1.0
    # the ITL target steps with decodes are sized to (seconds; None: off), whether it is the
    # default step budget, how the scheduler sizes steps now (Scheduler.sizing), why the
    # target cannot be met (when predicted so), and the cost model's drift factor
    target_itl_s: float | None = None
    itl_default: bool = False
    sizing: str = "off"
    itl_warning: str | None = None
    step_cost_drift: float = 1.0

    def as_json(self) -> dict:
        """The dashboard's engine figures (JSON-ready)."""
        hits = dict(self.prefix_hit_tokens)
        queried = self.prefix_queried_tokens
        spec = None
        if self.spec is not None:
            st = self.spec
            spec = {"method": st.method, "draft_tokens": st.num_drafts,
                    "accepted_tokens": st.num_accepted,
                    "acceptance_rate": round(st.acceptance_rate, 4),
                    "mean_acceptance_length": round(st.mean_acceptance_length, 3)}
        return {
            "running": self.running, "waiting": self.waiting,
            "kv": {"usage": round(self.kv_usage, 4), "blocks": self.kv_blocks,
                   "free_blocks": self.kv_free_blocks, "block_size": self.block_size,
                   "tiers": [asdict(t) for t in self.tiers]},
            "prefix_cache": {"queried_tokens": queried, "hit_tokens": hits,
                             "hit_rate": round(sum(hits.values()) / queried, 4) if queried
                             else None},
            "spec_decode": spec,
            "step_cost": None if self.step_cost is None else {
                "fixed_ms": round(1e3 * self.step_cost[0], 3),
                "per_prefill_token_ms": round(1e3 * self.step_cost[1], 4),
                "per_decode_row_ms": round(1e3 * self.step_cost[2], 4),
                "per_1k_attended_ms": round(1e3 * self.step_cost[3], 5),
                "prompt_allowance": self.prompt_allowance,
                "ttft_calibration": round(self.ttft_calibration, 3),
                "drift": round(self.step_cost_drift, 3)},
            "step_budget": {
                "target_itl_ms": None if self.target_itl_s is None
                else round(1e3 * self.target_itl_s, 1),
                "default": self.itl_default, "sizing": self.sizing,
                "warning": self.itl_warning},
        }
