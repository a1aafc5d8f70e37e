"""A CI-sized soak (`kvserve bench soak`, 21 s of arrivals in three patterns of 7 s) of a
real server on the default model, with faults injected: a request marker that fails its
requests, a slow step now and then, a disk tier that fails every third write, n-gram
speculation, and bursts far beyond the seats and the queue. Zero 5xx but the injected ones,
zero leaked blocks, back to idle, every successful stream ends with [DONE], every other
request gets its 4xx (or its 408 / close for slow clients), and /health stays under a second
throughout (or 100x the idle server's, measured first, on a machine slower than that)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.bench.soak import FAULT_MARKER, add_parser, passed, run_soak
from tests.server_utils import free_port

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

FAULTS = {"request_error": FAULT_MARKER, "slow_step_s": 0.3, "slow_every": 150,
          "disk_write": "ENOSPC", "disk_every": 3}


def test_a_short_soak_with_faults_keeps_everything(real_model_path, tmp_path):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    flags = (f"--model {real_model_path} --max-num-seqs 16 --max-waiting-requests 32 "
             f"--header-timeout 2 --read-timeout 2 --kv-cache-memory 128MiB "
             f"--host-kv-cache-memory 32MiB --kv-cache-dir {tmp_path / 'kv'} "
             f"--speculative-config '{spec}'")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args([
        "soak", "--spawn", flags, "--port", str(free_port()), "--faults",
        "--faults-env", json.dumps(FAULTS), "--server-log", str(tmp_path / "server.log"),
        "--duration", "21", "--window", "7", "--rate", "8", "--concurrency", "24",
        "--arrivals", "mixed", "--phase", "7", "--burst-size", "64", "--burst-every", "5",
        "--slow-client-wait", "15", "--timeout", "120", "--seed", "3"])
    report = run_soak(args)
    summary = {k: v for k, v in report.items() if k not in ("windows", "integrity")}
    assert passed(report), f"not ok: {report['first_not_ok']}; {summary}"
    kinds = report["by_kind"]
    assert kinds["injected_error"]["ok"] > 0 and report["5xx"] == report["5xx_injected"] > 0
    assert report["shed_429"] > 0, "the bursts never filled the queue"
    assert {"half_head", "silent", "stalled_body", "oversized", "cut_stream"} <= set(kinds)
    # /health answers within a second under load (a Kubernetes probe's default timeout),
    # or within 100x the idle server's own latency where this machine is slower than that
    bound = max(1.0, 100 * report["health_idle_s"])
    assert report["health_worst_s"] < bound, (report["health_idle_s"], report["windows"])
    # ~8 a second for 21 s and two bursts of 64 (the third phase's, at 14 and 19 s)
    assert report["requests"] > 180
