"""The replica settings of `kvserve serve --data-parallel-size N` and `kvserve ray`, each
declared once as its flag (kvserve.settings), and the Ray Serve deployment options they make.
Imports neither ray nor torch: the command line is parsed, and checked, without them."""

from __future__ import annotations

import argparse
import importlib
import os
from dataclasses import dataclass
from typing import Any

from kvserve.settings import add_fields_as_flags, fields_from_flags, setting

INSTALL_HINT = "pip install kvserve[ray]"
APP_NAME = "kvserve"  # the Ray Serve application's name (serve.status, serve.delete)
REQUEST_ROUTERS = ("prefix-aware", "power-of-two")
# KVServeRequestRouter, named by its import path: these settings import no ray
PREFIX_ROUTER = "kvserve.entrypoints.ray_serve.request_router:KVServeRequestRouter"


@dataclass(frozen=True)
class ReplicaArgs:
    data_parallel_size: int = setting(
        1, "engine replicas; above 1 they run as Ray Serve replicas on a local Ray instance, "
           "or on the cluster that $RAY_ADDRESS names (pip install kvserve[ray]); 1: one "
           "plain server", aliases=("-dp",))
    min_replicas: int | None = setting(
        None, "autoscaling on requests in flight: the fewest replicas (default 1; needs "
              "--max-replicas)")
    max_replicas: int | None = setting(
        None, "autoscaling on requests in flight: the most replicas (turns autoscaling on; "
              "--data-parallel-size is then the count to start with)")
    target_ongoing_requests: float | None = setting(
        None, "autoscaling: the requests in flight per replica that Ray scales toward "
              "(default: --max-num-seqs, a full step)")
    max_ongoing_requests: int | None = setting(
        None, "requests Ray's router sends one replica at once; more wait in Ray's queue "
              "for the first replica with room (default: twice --max-num-seqs)")
    threads_per_replica: int | None = setting(
        None, "torch threads of each replica's engine, and the CPUs Ray reserves for the "
              "replica (default: this machine's CPUs shared among the replicas, at least 1)")
    request_router: str = setting(
        "prefix-aware", "how Ray picks a replica for a request: prefix-aware (the replica "
        "believed to hold the most leading KV blocks of its prompt, keyed by the prefix "
        "cache's block hashes and cache_salt, unless it is busy) or power-of-two (as Ray's "
        "default: the less loaded of two at random); stored responses stay on their "
        "replica either way", choices=REQUEST_ROUTERS)
    balance_slack: int = setting(
        16, "prefix-aware: requests in flight a prefix's replica may have beyond the least "
            "loaded one before a request goes to the least loaded instead (a hit saves the "
            "prefix's prefill; a replica runs up to --max-num-seqs requests in one step)")

    def __post_init__(self) -> None:
        if self.request_router not in REQUEST_ROUTERS:
            raise ValueError(f"--request-router must be one of {', '.join(REQUEST_ROUTERS)}")
        if self.balance_slack < 0:
            raise ValueError("--balance-slack must be >= 0")
        if self.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be >= 1")
        if self.min_replicas is not None and self.max_replicas is None:
            raise ValueError("--min-replicas needs --max-replicas (autoscaling)")
        if self.max_replicas is not None and self.max_replicas < 1:
            raise ValueError("--max-replicas must be >= 1")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("--min-replicas must be in [0, --max-replicas]")
        if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
            raise ValueError("--target-ongoing-requests must be > 0")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError("--max-ongoing-requests must be >= 1")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise ValueError("--threads-per-replica must be >= 1")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, only: list[str] | None = None
                     ) -> None:
        add_fields_as_flags(cls, parser.add_argument_group(
            "replicas (Ray Serve; pip install kvserve[ray])"), only)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ReplicaArgs:
        return fields_from_flags(cls, ns)

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def on_ray(self) -> bool:
        """Whether these settings need Ray (else `kvserve serve` runs its plain server)."""
        return self.data_parallel_size > 1 or self.autoscaling

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.data_parallel_size

    def threads(self, cpus: int | None = None) -> int:
        """Each replica's engine threads: --threads-per-replica, else the CPUs this process
        may run on shared among the most replicas there can be."""
        if self.threads_per_replica is not None:
            return self.threads_per_replica
        if cpus is None:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else os.cpu_count() or 1
        return max(1, cpus // self.most_replicas)

    def check_engine(self, engine_args: Any) -> None:
        """What one engine per replica cannot do yet, refused before Ray starts."""
        if engine_args.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size > 1 with Ray Serve replicas is not "
                             "supported yet; run the tensor-parallel engine with a plain "
                             "`kvserve serve`")
        from kvserve.config import KVEventsConfig  # here: kvserve.config imports torch

        events = KVEventsConfig.parse(engine_args.kv_events_config)
        if events is not None and events.enabled:
            # each replica publishes on the endpoints offset by its rank (KVEventsConfig.
            # for_rank); no two ranks may meet on one
            events.check_ranks(self.most_replicas)
        if engine_args.device not in ("cpu", "cpu:0", "cuda"):
            raise ValueError(f"--device {engine_args.device}: Ray places each replica on a "
                             "device of its own; give cpu or cuda")

    def deployment_options(self, engine_args: Any, server_args: Any,
                           cpus: int | None = None) -> dict[str, Any]:
        """The Ray Serve options of KVServeDeployment (`Deployment.options`): one engine's
        threads as the replica's CPUs (and one GPU with --device cuda), the replica count or
        the autoscaling on requests in flight, the server's --shutdown-timeout as the drain a
        stopping replica gets, and the request router (KVServeRequestRouter, prefix-aware or
        power of two choices)."""
        actor: dict[str, Any] = {"num_cpus": self.threads(cpus)}
        if engine_args.device == "cuda":
            actor["num_gpus"] = 1
        opts: dict[str, Any] = {
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_ongoing_requests or 2 * engine_args.max_num_seqs,
            # a stopping replica (downscale, delete, redeploy) takes no new requests and
            # waits this long for those in flight, as `kvserve serve` does after SIGTERM
            "graceful_shutdown_timeout_s": server_args.shutdown_timeout,
            "graceful_shutdown_wait_loop_s": 0.5,
            # a model that fails to load fails the same way again: report it, do not retry
            # Ray's default 20 times
            "max_constructor_retry_count": 2,
        }
        # power-of-two too: KVServeRequestRouter then chooses as Ray's default does, and
        # still sends a stored response's requests to the replica that holds it
        opts["request_router_config"] = {
            "request_router_class": PREFIX_ROUTER,
            "request_router_kwargs": {"prefix_aware": self.request_router == "prefix-aware",
                                      "balance_slack": self.balance_slack}}
        if self.autoscaling:
            assert self.max_replicas is not None
            low = self.min_replicas if self.min_replicas is not None else 1
            opts["autoscaling_config"] = {
                "min_replicas": low, "max_replicas": self.max_replicas,
                "initial_replicas": min(max(self.data_parallel_size, low), self.max_replicas),
                "target_ongoing_requests": self.target_ongoing_requests
                or engine_args.max_num_seqs}
        else:
            opts["num_replicas"] = self.data_parallel_size
        return opts


def require_ray() -> None:
    """ValueError (the CLI's exit 2, with its message) where ray[serve] cannot be imported."""
    try:
        importlib.import_module("ray.serve")
    except ImportError as e:
        raise ValueError(f"replicas run on Ray Serve, which is not installed ({e}); install "
                         f"it with: {INSTALL_HINT}") from None
