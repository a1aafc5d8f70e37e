"""/metrics in Prometheus' text format: one server's metrics with its `replica` label, and the
merge of several replicas' into one page (what the Ray Serve ingress answers, so one scrape
sees every replica).

Every sample carries `replica`: "0" for a plain `kvserve serve` (vLLM labels its engines the
same way; on Kubernetes each pod is its own target, and Prometheus adds `pod`), a Ray Serve
replica's id behind the ingress. Summing over replicas is then PromQL's
`sum without (replica) (...)`, and one replica is `{replica="..."}`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"
PLAIN_REPLICA = "0"  # the label of a server that is not one of several replicas


class _Families:
    """A collector over metric families already collected (prometheus_client's
    generate_latest takes anything with `collect`), each sample given `extra` labels."""

    def __init__(self, families: Iterable[Metric], extra: dict[str, str] | None = None) -> None:
        self.families, self.extra = list(families), extra or {}

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, **self.extra}, s.value, s.timestamp,
                               s.exemplar)
            yield out


def exposition(registry: CollectorRegistry, replica: str) -> bytes:
    """The registry's metrics as /metrics answers them, each sample labelled with `replica`."""
    return generate_latest(_Families(registry.collect(), {REPLICA_LABEL: replica}))  # type: ignore[arg-type]


def merge(pages: Iterable[bytes]) -> bytes:
    """Several replicas' /metrics pages as one: each family once (its help and type from the
    first page that has it), with every page's samples. The pages' samples must differ in
    their labels (each replica's carry its own `replica`), as Prometheus requires."""
    families: dict[str, Metric] = {}
    for page in pages:
        for f in text_string_to_metric_families(page.decode()):
            merged = families.get(f.name)
            if merged is None:
                families[f.name] = merged = Metric(f.name, f.documentation, f.type, f.unit)
            merged.samples.extend(f.samples)
    return generate_latest(_Families(families.values()))  # type: ignore[arg-type]
