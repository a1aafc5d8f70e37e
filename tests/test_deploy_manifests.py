"""deploy/kubernetes/ without a cluster: both manifests validate against Kubernetes' own
schemas (kubernetes-validate bundles them), the probes name routes the server has, the
container's command line is one kvserve's parser takes, and the Service reaches the pods."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient

from kvserve.engine.args import EngineArgs
from kvserve.entrypoints.cli.main import build_parser
from kvserve.entrypoints.ray_serve.args import ReplicaArgs
from kvserve.entrypoints.server.app import build_app
from kvserve.entrypoints.server.args import ServerArgs

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests are checked for, and the newest the pinned validator
# has schemas of.
KUBERNETES_VERSIONS = ("1.31", "1.37")


def _manifest(name: str) -> dict:
    docs = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    assert len(docs) == 1, f"{name}: one resource per file"
    return docs[0]


@pytest.fixture(scope="module")
def deployment() -> dict:
    return _manifest("deployment.yaml")


@pytest.fixture(scope="module")
def service() -> dict:
    return _manifest("service.yaml")


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", ["deployment.yaml", "service.yaml"])
def test_manifests_validate_against_kubernetes_schemas(name, version):
    """strict: a field the schema does not know (a misspelt probe) fails as a wrong type does."""
    assert kubernetes_validate.validate(_manifest(name), version, strict=True) == version


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_validator_refuses_a_broken_deployment(deployment, version):
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError, match="replicas|'one'"):
        kubernetes_validate.validate(wrong_type, version, strict=True)
    misspelt = copy.deepcopy(deployment)
    container = _container(misspelt)
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(misspelt, version, strict=True)


@pytest.fixture(scope="module")
def unloaded() -> TestClient:
    """The server's app, built as `kvserve serve` builds it, with its lifespan not run: its
    model never loads, as in the pod before the startup probe passes."""
    return TestClient(build_app(EngineArgs(model="unused"),
                                ServerArgs(served_model_name="unused")))


def test_probes_reach_the_servers_routes_on_its_port(deployment, unloaded):
    container = _container(deployment)
    probes = {kind: container[f"{kind}Probe"]["httpGet"]
              for kind in ("startup", "liveness", "readiness")}
    # liveness is the engine's health; readiness whether a request would be taken now
    assert probes["liveness"]["path"] == "/health" == probes["startup"]["path"]
    assert probes["readiness"]["path"] == "/ready"
    for kind, get in probes.items():
        r = unloaded.get(get["path"])
        # a route of the app (not a 404), failing the probe until the model has loaded
        assert r.status_code == 503, (kind, get["path"], r.status_code)
        assert r.json()["error"]["message"] == "model is loading"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for kind, get in probes.items():
        assert get["port"] in ports, f"the {kind} probe's port is not the container's"
    assert unloaded.get("/no-such-route").status_code == 404  # what a wrong path would get


def test_container_runs_kvserve_serve_as_its_parser_reads_it(deployment):
    container = _container(deployment)
    assert container["command"] == ["kvserve"]
    ns = build_parser().parse_args(container["args"])
    assert ns.command == "serve"
    server = ServerArgs.from_cli_args(ns)
    assert server.host == "0.0.0.0"  # reachable from outside the pod
    assert [p["containerPort"] for p in container["ports"]] == [server.port]
    assert not ReplicaArgs.from_cli_args(ns).on_ray  # one plain server per pod
    engine = EngineArgs.from_cli_args(ns)
    assert engine.model is None and ns.model_tag is None  # the default model, in the image
    # the grace period outlasts the preStop pause plus the server's drain
    spec = deployment["spec"]["template"]["spec"]
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert spec["terminationGracePeriodSeconds"] > pause + server.shutdown_timeout
    # torch's threads are the CPUs the pod asks for, not the node's
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["OMP_NUM_THREADS"] == container["resources"]["requests"]["cpu"]


def test_service_reaches_the_deployments_pods(deployment, service, unloaded):
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    names = {p["name"] for p in _container(deployment)["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in names
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert unloaded.get(annotations["prometheus.io/path"]).status_code == 200
    assert int(annotations["prometheus.io/port"]) in {
        p["containerPort"] for p in _container(deployment)["ports"]}
