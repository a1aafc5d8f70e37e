"""KVServeRequestRouter: Ray Serve's request router of KVServeDeployment, prefix-aware on
kvserve's block hashes (the policy and its table: routing.py).

With `prefix_aware` off it is Ray's power of two choices, stored responses still pinned
(Ray's own router would not honour the pin). It runs where the deployment's handle is, in
the ingress (ingress.py), which puts each
request's route key (its prompt's chained block hashes) and, for a stored response, the
replica that holds it (a pin) on the ForwardedRequest it sends. Loads are Ray's own queue
lengths per replica (what its replicas report and its handle counts); Ray then sends the
request to the least loaded replica of the first rank with room, probing those it has no
length for, and retries with backoff while every replica is full.

Why not Ray's PrefixCacheAffinityRouter (ray.serve.llm): it keys by characters of the
prompt's text, not by tokens: a chat template's rendering, tools, and `cache_salt` are not
in its key, so two tenants with different salts share a route to blocks they cannot share,
and a match in text need not be a match in whole KV blocks. It also asks a shared actor
(`ray.get`) on every request, from the router's event loop. Keyed by the prefix cache's own
hashes, routing and caching agree block for block."""

from __future__ import annotations

import importlib
import logging
import random
import weakref
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.entrypoints.ray_serve.forwarding import ForwardedRequest
from kvserve.entrypoints.ray_serve.routing import PrefixTable, RoutePolicy, rank

log = logging.getLogger("kvserve.entrypoints.ray_serve")

# The routers of this process: Ray Serve builds one where a deployment's handle is used, the
# ingress, once the handle has its first request. live_replicas reads their replica sets.
_ROUTERS: weakref.WeakSet[KVServeRequestRouter] = weakref.WeakSet()


def _routers() -> weakref.WeakSet[KVServeRequestRouter]:
    """The registry of the imported module. Ray can ship code to its workers by value
    (cloudpickle), each function with copies of the globals it names: looked up at run time,
    the router that registers and the ingress that reads share one registry."""
    return importlib.import_module(__name__)._ROUTERS


def live_replicas() -> list[str]:
    """The ids of the replicas the routers in this process route to now (Ray's running
    replicas, as its controller last told them); empty before the first request."""
    return sorted({rid.unique_id for router in list(_routers())
                   for rid in list(router.curr_replicas)})


def _forwarded(pending: PendingRequest | None) -> ForwardedRequest | None:
    if pending is None:
        return None
    return next((a for a in pending.args if isinstance(a, ForwardedRequest)), None)


class KVServeRequestRouter(RequestRouter):
    def initialize_state(self, prefix_aware: bool = True, balance_slack: int = 16,
                         min_match_blocks: int = 4, prefix_entries: int = 100_000,
                         **_: Any) -> None:
        """`prefix_aware` False: Ray's power of two choices (two replicas at random, the
        less loaded taken), stored responses still pinned to their replica."""
        self.prefix_aware = prefix_aware
        self.policy = RoutePolicy(balance_slack, min_match_blocks, prefix_entries)
        self.table = PrefixTable(prefix_entries)
        self.decisions: Counter[str] = Counter()  # why, as routing.rank says
        _routers().add(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        req = _forwarded(pending_request)
        if req is not None and req.pin is not None and req.pin in by_id:
            self.decisions["pinned"] += 1
            return [[by_id[req.pin]]]  # only the owner: wait for it while it is full
        if not self.prefix_aware:
            self.decisions["power of two"] += 1
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        cache = self.replica_queue_len_cache
        load = {rid: cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        ranks, why = rank(self.table, self.policy, req.route_key if req else (), load)
        self.decisions[why] += 1
        return [[by_id[rid] for rid in ids] for ids in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        req = _forwarded(pending_request)
        if self.prefix_aware and req is not None and req.route_key:
            self.table.record(req.route_key, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        for gone in before - {r.unique_id for r in self.curr_replicas}:
            self.table.forget(gone)
