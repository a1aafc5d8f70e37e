"""The dashboard's figures over several replicas: what the ingress answers for
/v1/engine/stats and /v1/engine/history without a `replica` parameter, from each replica's own
answer. Pure functions on the routes' JSON (no ray, no I/O).

How each figure combines:
- counts and rates (requests running and waiting, tokens a second, KV blocks, prefix-cache
  tokens, draft tokens, goodput) add up; the ratios built on them (KV usage, prefix hit rate,
  draft acceptance) are recomputed from the sums;
- a latency percentile cannot be recomputed from the replicas' percentiles: the sum shows the
  slowest replica's, an upper bound of the percentile over all of their requests (at most a
  fraction 1-q of each replica's values lie above its own q-th percentile, so at most that
  fraction of all of them lie above the largest);
- per-replica figures (the step-cost model, the step budget) are left out (None): ask a
  replica for them.
A history is summed sample by sample: each replica records once an interval on its own clock,
so the samples are grouped by the interval they fall in (one a replica: its newest)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

RECENT = 20  # the waterfall's rows in the sum, as in one replica's stats


def _total(pages: Sequence[dict], key: str) -> float:
    return sum(p.get(key) or 0 for p in pages)


def _worst(items: Sequence[dict | None], keys: Sequence[str]) -> dict | None:
    """Each percentile's largest over the replicas that have it (upper bounds, see above);
    `count`s add up."""
    have = [i for i in items if i]
    if not have:
        return None
    out: dict[str, Any] = {k: max(i[k] for i in have) for k in keys if k in have[0]}
    if "count" in have[0]:
        out["count"] = sum(i["count"] for i in have)
    return out


def _slo(items: Sequence[dict | None]) -> dict | None:
    have = [i for i in items if i]
    if not have:
        return None
    out = dict(have[0])  # the targets: every replica has the same engine settings
    for key in ("good", "missed_ttft", "missed_itl", "missed_both", "goodput_per_s"):
        out[key] = round(sum(i.get(key) or 0 for i in have), 3)
    return out


def sum_stats(pages: Sequence[dict]) -> dict:
    """One /v1/engine/stats from each replica's (at least one), as one server's would read."""
    if not pages:
        raise ValueError("no replica's stats to sum")
    kv_blocks = sum(p["kv"]["blocks"] for p in pages)
    used = sum(p["kv"]["usage"] * p["kv"]["blocks"] for p in pages)
    tiers: dict[str, dict] = {}
    for p in pages:
        for t in p["kv"]["tiers"]:
            s = tiers.setdefault(t["name"], {"name": t["name"], "blocks": 0,
                                             "capacity_blocks": 0, "loads": 0, "saves": 0})
            for k in ("blocks", "loads", "saves"):
                s[k] += t[k]
            s["capacity_blocks"] = None if t["capacity_blocks"] is None or \
                s["capacity_blocks"] is None else s["capacity_blocks"] + t["capacity_blocks"]
    queried = sum(p["prefix_cache"]["queried_tokens"] for p in pages)
    hits: dict[str, int] = defaultdict(int)
    for p in pages:
        for tier, n in p["prefix_cache"]["hit_tokens"].items():
            hits[tier] += n
    specs = [p["spec_decode"] for p in pages if p.get("spec_decode")]
    spec = None
    if specs:
        drafts = sum(s["draft_tokens"] for s in specs)
        accepted = sum(s["accepted_tokens"] for s in specs)
        spec = {"method": specs[0]["method"], "draft_tokens": drafts,
                "accepted_tokens": accepted,
                "acceptance_rate": round(accepted / drafts, 4) if drafts else 0.0,
                "mean_acceptance_length": None}  # needs each replica's verifying steps
    recent = sorted((r for p in pages for r in p.get("recent", ())),
                    key=lambda r: r["arrival_unix"])[-RECENT:]
    return {
        "model": pages[0].get("model"), "replicas": len(pages),
        "running": int(_total(pages, "running")), "waiting": int(_total(pages, "waiting")),
        "kv": {"usage": round(used / kv_blocks, 4) if kv_blocks else 0.0, "blocks": kv_blocks,
               "free_blocks": sum(p["kv"]["free_blocks"] for p in pages),
               "block_size": pages[0]["kv"]["block_size"], "tiers": list(tiers.values())},
        "prefix_cache": {"queried_tokens": queried, "hit_tokens": dict(hits),
                         "hit_rate": round(sum(hits.values()) / queried, 4) if queried
                         else None},
        "spec_decode": spec, "step_cost": None, "step_budget": None,
        "output_tokens_per_s": round(_total(pages, "output_tokens_per_s"), 2),
        "ttft_ms": _worst([p.get("ttft_ms") for p in pages], ("p50", "p90", "p99")),
        "itl_ms": _worst([p.get("itl_ms") for p in pages], ("p50", "p90", "p99")),
        "slo": _slo([p.get("slo") for p in pages]),
        "recent": recent,
    }


def _sum_samples(samples: Sequence[dict]) -> dict:
    specs = [s["spec"] for s in samples if s.get("spec")]
    spec = None
    if specs:
        drafts = sum(s["drafts"] for s in specs)
        rated = [s for s in specs if s["acceptance"] is not None and s["drafts"]]
        positions = max(len(s["acceptance_at"]) for s in specs)
        at = []
        for i in range(positions):
            # weighted by each replica's drafts in the interval (its per-position counts are
            # not in the sample)
            have = [(s["acceptance_at"][i], s["drafts"]) for s in specs
                    if i < len(s["acceptance_at"]) and s["acceptance_at"][i] is not None]
            weight = sum(w for _, w in have)
            at.append(round(sum(a * w for a, w in have) / weight, 4) if weight else None)
        spec = {"drafts": drafts, "acceptance": round(
            sum(s["acceptance"] * s["drafts"] for s in rated) / drafts, 4) if rated else None,
            "acceptance_at": at}
    return {"time": max(s["time"] for s in samples), "replicas": len(samples),
            "running": int(_total(samples, "running")),
            "waiting": int(_total(samples, "waiting")),
            # every replica's pool has the same size (one engine configuration)
            "kv_usage": round(_total(samples, "kv_usage") / len(samples), 4),
            "output_tokens_per_s": round(_total(samples, "output_tokens_per_s"), 2),
            "ttft_ms": _worst([s.get("ttft_ms") for s in samples], ("p50", "p99")),
            "itl_ms": _worst([s.get("itl_ms") for s in samples], ("p50", "p99")),
            "slo": _slo([s.get("slo") for s in samples]), "spec": spec}


def sum_histories(pages: Sequence[dict]) -> dict:
    """One /v1/engine/history from each replica's (at least one): a sample an interval, the
    sum of the replicas' samples in it, oldest first."""
    if not pages:
        raise ValueError("no replica's history to sum")
    interval = pages[0]["interval_s"]
    slots: dict[int, dict[int, dict]] = defaultdict(dict)  # interval -> replica -> sample
    for replica, page in enumerate(pages):
        for s in page["data"]:
            slots[int(s["time"] // interval)][replica] = s  # oldest first: the newest stays
    return {"object": "list", "interval_s": interval, "replicas": len(pages),
            "data": [_sum_samples(list(slots[k].values())) for k in sorted(slots)]}
