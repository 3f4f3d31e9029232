"""The zones overlay (deploy/overlays/zones): routers and workers spread evenly over
topology.kubernetes.io/zone, and each pod started with `--zone` = the zone label of the node it landed
on, which an init container reads from the API server (the downward API carries no node labels). The
overlay renders and validates with the others (test_manifests.py, RENDERED); here: the spread, the zone's
path from the node to inferd's argv (the init container's script against a fake API server over TLS, the
shell wrapper run for real with a stand-in inferd), and that only the init container holds a credential."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.unit.test_manifests import DEPLOY, ZONE_NAME, ZONE_WRAPPER, container, find, render, selects

OVERLAY = "overlays/zones"
ZONES = 3  # the overlay's minimums: one router and one worker per zone
ZONE_KEY = "topology.kubernetes.io/zone"
SCRIPT = DEPLOY / OVERLAY / "node_zone.py"


def deployments() -> dict[str, dict[str, Any]]:
    docs = render(OVERLAY)
    return {name: find(docs, "Deployment", name) for name in ("inferd", "inferd-worker")}


def volumes(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}


def mounts(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in c.get("volumeMounts", [])}


@pytest.mark.parametrize("name", ["inferd", "inferd-worker"])
def test_routers_and_workers_spread_evenly_over_zones_and_one_per_zone_stays(name: str) -> None:
    docs = render(OVERLAY)
    deployment = find(docs, "Deployment", name)
    others = [d for d in deployments().values() if d is not deployment]
    spec = deployment["spec"]["template"]["spec"]
    (zone,) = [s for s in spec["topologySpreadConstraints"] if s["topologyKey"] == ZONE_KEY]
    assert zone["maxSkew"] == 1 and zone["whenUnsatisfiable"] == "DoNotSchedule"
    # a lost zone's nodes (tainted unreachable) stop counting: its pods' replacements go to the zones left
    assert zone["nodeTaintsPolicy"] == "Honor"
    assert "minDomains" not in zone  # it would hold the replacements pending while a zone is gone
    assert selects(zone["labelSelector"]["matchLabels"], deployment)
    assert not any(selects(zone["labelSelector"]["matchLabels"], d) for d in others)
    # the scheduler picks the zone: nothing pins the pods to one
    assert "affinity" not in spec
    assert "inferd/zone" not in deployment["spec"]["template"]["metadata"]["labels"]
    hpa = find(docs, "HorizontalPodAutoscaler", name)
    assert hpa["spec"]["minReplicas"] >= ZONES and deployment["spec"]["replicas"] >= ZONES


@pytest.mark.parametrize("name", ["inferd", "inferd-worker"])
def test_each_pod_starts_inferd_with_the_zone_its_init_container_read_from_its_node(name: str) -> None:
    deployment = deployments()[name]
    spec = deployment["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    main = container(deployment)
    assert init["image"] == main["image"]  # the inferd image's Python runs the script
    python, script, secrets, out = init["command"]
    assert python == "python" and Path(script).name == "node_zone.py"
    env = {e["name"]: e for e in init["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    by_name = volumes(deployment)
    # the script is deploy/overlays/zones/node_zone.py, through the generated ConfigMap
    (script_mount,) = [m for m in init["volumeMounts"] if m["mountPath"] == str(Path(script).parent)]
    config_map = find(render(OVERLAY), "ConfigMap", by_name[script_mount["name"]]["configMap"]["name"])
    assert config_map["data"]["node_zone.py"] == SCRIPT.read_text()
    # the zone file: an emptyDir the init container writes and inferd's container reads, at one path
    (out_mount,) = [m for m in init["volumeMounts"] if m["mountPath"] == str(Path(out).parent)]
    assert "emptyDir" in by_name[out_mount["name"]] and not out_mount.get("readOnly")
    assert mounts(main)[out_mount["name"]]["mountPath"] == out_mount["mountPath"]
    assert mounts(main)[out_mount["name"]]["readOnly"] is True
    assert main["command"] == ZONE_WRAPPER and f"< {out} &&" in ZONE_WRAPPER[2]
    assert not any(a.startswith("--zone") for a in main["args"])  # the wrapper's is the only one
    # otherwise the gpu overlay's container, whose args the zones overlay restates for workers
    gpu = container(find(render("overlays/gpu"), "Deployment", name))
    assert main["args"] == [a for a in gpu["args"] if a != "--zone=$(ZONE)"]
    # the API token and CA: a projected volume only the init container mounts
    (token_mount,) = [m for m in init["volumeMounts"] if m["mountPath"] == secrets]
    sources = by_name[token_mount["name"]]["projected"]["sources"]
    assert {"serviceAccountToken": {"path": "token", "expirationSeconds": 600}} in sources
    assert {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}} in sources
    assert token_mount["name"] not in mounts(main)
    assert spec["automountServiceAccountToken"] is False


def test_the_pods_account_may_only_read_nodes() -> None:
    docs = render(OVERLAY)
    accounts = {d["spec"]["template"]["spec"]["serviceAccountName"] for d in deployments().values()}
    (account,) = accounts
    namespace = find(docs, "ServiceAccount", account)["metadata"]["namespace"]
    assert find(docs, "ServiceAccount", account)["automountServiceAccountToken"] is False
    bindings = [
        b for b in docs
        if b["kind"] in ("ClusterRoleBinding", "RoleBinding")
        and {"kind": "ServiceAccount", "name": account, "namespace": namespace} in b["subjects"]
    ]
    (binding,) = bindings
    assert binding["roleRef"]["kind"] == "ClusterRole"
    role = find(docs, "ClusterRole", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]


def test_clients_reach_a_router_of_their_own_zone_first() -> None:
    service = find(render(OVERLAY), "Service", "inferd")
    assert service["spec"]["trafficDistribution"] == "PreferClose"
    assert selects(service["spec"]["selector"], deployments()["inferd"])


def run_wrapper(tmp_path: Path, zone_file: str | None) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The worker container's command and args run by sh, its zone directory moved under tmp_path, with a
    stand-in `inferd` on PATH that records its arguments, one a line."""
    c = container(deployments()["inferd-worker"])
    zone_dir = tmp_path / "zone"
    zone_dir.mkdir()
    if zone_file is not None:
        (zone_dir / "zone").write_text(zone_file)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "inferd"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do echo "$a"; done > {calls}\n')
    fake.chmod(0o755)
    argv = [part.replace("/run/inferd-zone", str(zone_dir)) for part in c["command"]] + c["args"]
    assert argv[0] == "/bin/sh"
    done = subprocess.run(
        argv, env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True, text=True, timeout=30, check=False
    )
    return done, calls


def test_the_wrapper_execs_inferd_with_its_args_then_the_zone(tmp_path: Path) -> None:
    done, calls = run_wrapper(tmp_path, "zone-b\n")
    assert done.returncode == 0, done.stderr
    args = container(deployments()["inferd-worker"])["args"]
    assert calls.read_text().splitlines() == [*args, "--zone=zone-b"]


def test_the_wrapper_never_starts_inferd_without_a_zone(tmp_path: Path) -> None:
    done, calls = run_wrapper(tmp_path, None)
    assert done.returncode != 0 and not calls.exists()


# ---- node_zone.py against a fake API server ----------------------------------------------------------


class FakeApi:
    """An HTTPS server answering GET /api/v1/nodes/NAME with the node's labels; records the requests."""

    def __init__(self, nodes: dict[str, dict[str, str]], ca: trustme.CA) -> None:
        self.requests: list[tuple[str, str | None]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api.requests.append((self.path, self.headers.get("Authorization")))
                name = self.path.removeprefix("/api/v1/nodes/")
                if name not in nodes:
                    self.send_error(404)
                    return
                body = json.dumps({"kind": "Node", "metadata": {"name": name, "labels": nodes[name]}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(context)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[FakeApi, Path]]:
    ca = trustme.CA()
    fake = FakeApi(
        {"node-1": {ZONE_KEY: "zone-b", "kubernetes.io/hostname": "node-1"}, "node-2": {}, "node-3": {ZONE_KEY: "Zone_C"}},
        ca,
    )
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "token").write_text("the-token\n")
    ca.cert_pem.write_to_path(str(secrets / "ca.crt"))
    thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, secrets
    finally:
        fake.server.shutdown()
        fake.server.server_close()
        thread.join()


def run_script(api: tuple[FakeApi, Path], node: str, out: Path) -> subprocess.CompletedProcess[str]:
    fake, secrets = api
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "NODE_NAME": node,
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(fake.port),
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(secrets), str(out)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )


def test_node_zone_writes_the_nodes_zone_label_asked_with_the_token(
    api: tuple[FakeApi, Path], tmp_path: Path
) -> None:
    out = tmp_path / "zone"
    done = run_script(api, "node-1", out)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "zone-b\n" and ZONE_NAME.match(out.read_text().strip())
    assert api[0].requests == [("/api/v1/nodes/node-1", "Bearer the-token")]


@pytest.mark.parametrize(
    ("node", "says"),
    [
        ("node-2", "node node-2 has no topology.kubernetes.io/zone label: label it (kubectl label node node-2"),
        ("node-3", "node node-3: topology.kubernetes.io/zone='Zone_C' is not a DNS label"),
        ("node-9", "HTTP Error 404"),
    ],
)
def test_node_zone_refuses_a_node_without_a_valid_zone(
    api: tuple[FakeApi, Path], tmp_path: Path, node: str, says: str
) -> None:
    out = tmp_path / "zone"
    done = run_script(api, node, out)
    assert done.returncode != 0
    assert says in done.stderr
    assert not out.exists()  # inferd's wrapper then never starts (test_the_wrapper_never_starts_...)
