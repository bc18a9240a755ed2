"""deploy/kubernetes: every manifest valid against the Kubernetes API schemas (offline, with
the schemas kubernetes-validate ships, strict: an unknown field is an error), and what no
schema sees: the names that refer to each other, the probes and ports, and the settings the
servers get (the ConfigMap's TOML and the environment) loaded by the server's own
`load_settings`, with the values the downward API and the Secret would give."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from prorl_server.config import Settings, load_settings
from tests.deploy.settings_names import setting_of

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"
# gRPC probes are GA since 1.27; the newest the package ships is checked too.
KUBERNETES_VERSIONS = ["1.27", kubernetes_validate.utils.latest_version()]
POD_NAME, POD_IP, NAMESPACE = "prorl-0", "10.1.2.3", "prorl"

Doc = dict[str, Any]


@functools.cache
def kustomization() -> Doc:
    data: Doc = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return data


@functools.cache
def manifests() -> tuple[tuple[str, Doc], ...]:
    """(file name, document) for every document of the files kustomization.yaml lists
    (parsed once; the tests only read them)."""
    return tuple(
        (name, doc)
        for name in kustomization()["resources"]
        for doc in yaml.safe_load_all((K8S / name).read_text())
        if doc is not None
    )


def named(kind: str, name: str) -> Doc:
    found = [doc for _, doc in manifests() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def of_kind(kind: str) -> list[Doc]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def server_statefulset() -> Doc:
    return named("StatefulSet", "prorl")


def server_container() -> Doc:
    containers = server_statefulset()["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "server")


def configmap_toml() -> str:
    text: str = named("ConfigMap", "prorl-config")["data"]["prorl.toml"]
    return text


def secret_value(name: str, key: str) -> str:
    value: str = named("Secret", name)["stringData"][key]
    return value


def downward(field: str) -> str:
    return {"metadata.name": POD_NAME, "status.podIP": POD_IP, "metadata.namespace": NAMESPACE}[field]


def container_environment(container: Doc) -> dict[str, str]:
    """The container's environment as the kubelet makes it: downward API and Secret values
    in, `$(NAME)` replaced by a variable defined before it (left as is otherwise)."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        source = entry.get("valueFrom")
        if source is None:
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), entry["value"])
        elif "fieldRef" in source:
            value = downward(source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            value = secret_value(source["secretKeyRef"]["name"], source["secretKeyRef"]["key"])
        else:
            raise AssertionError(f"unexpected env source {source}")
        env[entry["name"]] = value
    return env


def server_settings(tmp_path: Path) -> Settings:
    """What a server pod starts with: the ConfigMap's file, then its environment."""
    config = tmp_path / "prorl.toml"
    config.write_text(configmap_toml())
    return load_settings(config, environ=container_environment(server_container()))


def pod_templates() -> Iterator[tuple[Doc, Doc]]:
    """(workload, pod template) of every StatefulSet."""
    for workload in of_kind("StatefulSet"):
        yield workload, workload["spec"]["template"]


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", quantity)
    assert match, quantity
    return int(match[1]) * units.get(match[2] or "", 1)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version: str) -> None:
    checked = []
    for name, doc in manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} ({version}): {exc.message} at {exc.path}")
        checked.append(doc["kind"])
    assert {"Namespace", "Secret", "Service", "StatefulSet", "ConfigMap", "PodDisruptionBudget"} <= set(checked)


def test_the_strict_validation_refuses_a_misspelt_field() -> None:
    """The check above can fail: a field the API does not know is an error."""
    statefulset = server_statefulset()
    broken = yaml.safe_load(yaml.safe_dump(statefulset))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest_and_names_the_server_image() -> None:
    listed = set(kustomization()["resources"])
    on_disk = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    images = {image["name"] for image in kustomization()["images"]}
    spec = server_statefulset()["spec"]["template"]["spec"]
    used = {c["image"].split(":")[0] for c in spec["containers"] + spec.get("initContainers", [])}
    assert used == {"prorl-server"} <= images
    # Everything in one namespace, the one the client's DNS name uses.
    assert kustomization()["namespace"] == NAMESPACE == named("Namespace", NAMESPACE)["metadata"]["name"]


def test_each_workload_selects_its_own_pods_and_each_service_selects_a_workloads_pods() -> None:
    templates = list(pod_templates())
    for workload, template in templates:
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), workload["metadata"]["name"]
    for service in of_kind("Service"):
        selector = service["spec"]["selector"]
        matching = [w for w, t in templates if selector.items() <= t["metadata"]["labels"].items()]
        assert len(matching) == 1, f"service {service['metadata']['name']} selects {len(matching)} workloads"
        ports = {p["name"]: p["containerPort"] for c in matching[0]["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}  # fmt: skip
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{service['metadata']['name']}: no container port {port['targetPort']}"
            assert ports[port["targetPort"]] == port["port"]
    for budget in of_kind("PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert [w for w, t in templates if selector.items() <= t["metadata"]["labels"].items()] == [
            server_statefulset()
        ]
        assert budget["spec"]["maxUnavailable"] == 1


def test_the_headless_service_gives_clients_every_ready_server(tmp_path: Path) -> None:
    headless = named("Service", "prorl-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False
    assert server_statefulset()["spec"]["serviceName"] == "prorl-headless"
    (port,) = headless["spec"]["ports"]
    assert port["port"] == server_settings(tmp_path).server.port == 50051
    # The target documented for clients resolves through this Service.
    assert f"dns:///prorl-headless.{NAMESPACE}.svc.cluster.local:50051" in (K8S / "prorl.yaml").read_text()


def test_probes_use_grpc_health_on_the_servers_port(tmp_path: Path) -> None:
    container = server_container()
    port = server_settings(tmp_path).server.port
    grpc_port = next(p for p in container["ports"] if p["name"] == "grpc")["containerPort"]
    assert grpc_port == port
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": port}, probe
    # Liveness must not restart a server whose health is NOT_SERVING because PostgreSQL is
    # away (its running jobs go on): it only checks that the port accepts connections.
    assert container["livenessProbe"]["tcpSocket"]["port"] in ("grpc", port)


def test_names_referred_to_exist() -> None:
    spec = server_statefulset()["spec"]["template"]["spec"]
    assert named("ServiceAccount", spec["serviceAccountName"])["automountServiceAccountToken"] is False
    for volume in spec["volumes"]:
        if "configMap" in volume:
            named("ConfigMap", volume["configMap"]["name"])
    for _, template in pod_templates():
        for container in template["spec"]["containers"]:
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in named("Secret", ref["name"])["stringData"], ref
    # --config names the ConfigMap's key where the ConfigMap is mounted.
    container = server_container()
    config = Path(container["args"][container["args"].index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == config.parent)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert config.name in named("ConfigMap", volume["configMap"]["name"])["data"]


def test_the_servers_settings_load_and_take_their_identity_from_the_pod(tmp_path: Path) -> None:
    settings = server_settings(tmp_path)
    assert settings.server.instance_id == POD_NAME
    assert settings.server.host == "0.0.0.0"
    assert settings.cluster.advertise_address == f"{POD_IP}:{settings.server.port}"
    assert settings.jobs.store == secret_value("prorl-postgres", "url")
    assert settings.cluster.run_jobs is True
    env = container_environment(server_container())
    assert not [value for value in env.values() if "$(" in value], env
    # A PRORL_ variable that is not a setting would be ignored (one underscore) or refused.
    prorl = [name for name in env if name.startswith("PRORL_")]
    assert prorl and all(setting_of(name) for name in prorl), prorl
    # No Service variables (PRORL_POSTGRES_PORT=tcp://...) in the servers' environment.
    assert server_statefulset()["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_the_store_url_points_at_the_postgres_service_with_its_credentials() -> None:
    url = urlsplit(secret_value("prorl-postgres", "url"))
    postgres = named("StatefulSet", "prorl-postgres")["spec"]["template"]["spec"]["containers"][0]
    env = container_environment(postgres)
    service = named("Service", "prorl-postgres")
    assert url.scheme == "postgresql"
    assert (url.username, url.password) == (env["POSTGRES_USER"], env["POSTGRES_PASSWORD"])
    assert url.password == secret_value("prorl-postgres", "password")
    assert (url.hostname, url.port) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
    assert url.path == f"/{env['POSTGRES_DB']}"


def test_postgres_takes_every_servers_connections() -> None:
    """Each server holds up to 8 pooled connections and 1 listener."""
    args = named("StatefulSet", "prorl-postgres")["spec"]["template"]["spec"]["containers"][0]["args"]
    max_connections = int(next(a for a in args if a.startswith("max_connections=")).split("=")[1])
    replicas = server_statefulset()["spec"]["replicas"]
    assert max_connections >= 9 * replicas + 10
    # Room for scaling the servers out well beyond the default replicas.
    assert max_connections >= 9 * 20


def test_termination_grace_leaves_room_above_the_drain(tmp_path: Path) -> None:
    grace = server_statefulset()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= server_settings(tmp_path).server.shutdown_grace_s + 30


def test_the_sandboxes_fit_in_the_pods_memory(tmp_path: Path) -> None:
    sandbox = server_settings(tmp_path).sandbox
    limit = quantity_bytes(server_container()["resources"]["limits"]["memory"])
    assert sandbox.max_sandboxes > 0
    assert sandbox.max_sandboxes * sandbox.memory_mib * 2**20 < limit
    requests = server_container()["resources"]["requests"]
    assert {"cpu", "memory"} <= requests.keys()


def test_the_pod_gives_rootless_podman_what_it_needs(tmp_path: Path) -> None:
    """The sandbox user's storage and the state folder are volumes (overlay on the pod's own
    overlay root is refused), and the containers that run Podman may create namespaces."""
    spec = server_statefulset()["spec"]["template"]["spec"]
    state_dir = server_settings(tmp_path).sandbox.state_dir
    for container in [server_container(), *spec["initContainers"]]:
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/home/prorl/.local/share/containers" in mounts, container["name"]
        assert container["securityContext"]["privileged"] is True, container["name"]
    assert state_dir in {m["mountPath"] for m in server_container()["volumeMounts"]}


def test_the_image_provides_what_the_pod_runs() -> None:
    """The Containerfile installs the commands the manifests start and makes the sandbox
    user whose home the storage volume is mounted in."""
    text = CONTAINERFILE.read_text()
    init = server_statefulset()["spec"]["template"]["spec"]["initContainers"][0]
    assert f"/usr/local/bin/{init['command'][0]}" in text
    assert 'ENTRYPOINT ["prorl-server"]' in text and server_container()["args"][0] == "serve"
    assert "useradd --create-home" in text and " prorl" in text
    for package in ("podman", "runc", "uidmap", "catatonit", "util-linux"):
        assert re.search(rf"\b{package}\b", text), package
    for source in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, flags=re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), f"Containerfile copies {path}, which does not exist"
