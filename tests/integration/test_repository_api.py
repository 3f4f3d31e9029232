"""The repository API (Triton's extension) against a real `inferd serve`, through tritonclient's http and
grpc clients unchanged: the index, unload (then an infer is a 404 saying it is unloaded), load (then it
answers again); who may call (the admin token, a tenant with model_control = true; a plain tenant key
403, and it sees only its models); Triton's overrides refused (400); an unknown model 404; an unload
with requests in flight drains them (all 200); `--model-control explicit` serves only --load-model's.
Two servers in all."""

from __future__ import annotations

import json
import random
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc_grpc
import tritonclient.http as tc_http
from tritonclient.utils import InferenceServerException

from inferd.gateway.keys import key_digest, new_key
from tests.checked_load import wait_for
from tests.conftest import ServerProc, start_server

ADMIN = "admin-token-for-the-repository-test"
CONTROL, PLAIN = new_key(), new_key()
TENANTS = f"""
[tenants.ops]
api_key_sha256 = ["{key_digest(CONTROL)}"]
model_control = true

[tenants.plain]
models = ["sim"]
api_key_sha256 = ["{key_digest(PLAIN)}"]
"""
SIM = 'builtin = "sim"\nmax_wait_ms = 1\n[params]\nbase_ms = 2.0\n'
SLOW = 'builtin = "sim"\nmax_wait_ms = 1\nmax_batch_size = 2\n[params]\nbase_ms = 150.0\n'


def repository(root: Path) -> Path:
    repo = root / "models"
    for name, toml in (("sim", SIM), ("slow", SLOW)):
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(toml)
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("repository")
    (root / "inferd.toml").write_text(TENANTS)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("INFERD_ADMIN_TOKEN", ADMIN)
        s = start_server(root, "--model-repo", str(repository(root)), "--config", str(root / "inferd.toml"))
    yield s
    assert s.stop() in (0, -15)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}  # lower case: gRPC metadata keys are


def sim_input(cls: type) -> object:
    inp = cls("INPUT0", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b"hello"], dtype=object))
    return inp


def http_infer(server: ServerProc, model: str, key: str = CONTROL) -> object:
    client = tc_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        return client.infer(model, [sim_input(tc_http.InferInput)], headers=bearer(key))
    finally:
        client.close()


def states(index: list[dict]) -> dict[str, tuple[str, str]]:
    return {row["name"]: (row["state"], row["reason"]) for row in index}


def test_http_index_unload_infer_404_load_infer_200(server: ServerProc) -> None:
    client = tc_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    admin = bearer(ADMIN)
    assert states(client.get_model_repository_index(headers=admin)) == {"sim": ("READY", ""), "slow": ("READY", "")}
    assert http_infer(server, "sim").as_numpy("OUTPUT0") is not None

    client.unload_model("sim", headers=admin)
    assert states(client.get_model_repository_index(headers=admin))["sim"] == ("UNAVAILABLE", "unloaded")
    with pytest.raises(InferenceServerException) as refused:
        http_infer(server, "sim")
    assert refused.value.status() == "404" and "unloaded" in refused.value.message()
    assert not client.is_model_ready("sim", headers=bearer(CONTROL))
    with urllib.request.urlopen(f"{server.url}/v2/health/ready") as r:  # an unloaded model holds nothing down
        assert r.status == 200

    client.load_model("sim", headers=admin)
    assert states(client.get_model_repository_index(headers=admin))["sim"] == ("READY", "")
    assert http_infer(server, "sim").as_numpy("OUTPUT0") is not None
    client.close()


def test_grpc_index_unload_load_with_a_model_control_tenant(server: ServerProc) -> None:
    client = tc_grpc.InferenceServerClient(server.grpc_target)
    ops = bearer(CONTROL)
    index = client.get_model_repository_index(headers=ops, as_json=True)
    assert {m["name"] for m in index["models"]} == {"sim", "slow"}

    client.unload_model("sim", headers=ops)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("sim", [sim_input(tc_grpc.InferInput)], headers=ops)
    assert "NOT_FOUND" in str(refused.value.status()) and "unloaded" in refused.value.message()
    assert not client.is_model_ready("sim", headers=ops)
    rows = client.get_model_repository_index(headers=ops, as_json=True)["models"]
    assert {"name": "sim", "state": "UNAVAILABLE", "reason": "unloaded"}.items() <= next(
        r for r in rows if r["name"] == "sim"
    ).items()

    client.load_model("sim", headers=ops)
    assert client.infer("sim", [sim_input(tc_grpc.InferInput)], headers=ops).as_numpy("OUTPUT0") is not None
    client.close()


def test_a_plain_tenant_sees_its_models_and_may_not_load_or_unload(server: ServerProc) -> None:
    client = tc_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    plain = bearer(PLAIN)
    assert [row["name"] for row in client.get_model_repository_index(headers=plain)] == ["sim"]
    for act in (client.unload_model, client.load_model):
        with pytest.raises(InferenceServerException) as refused:
            act("sim", headers=plain)
        assert refused.value.status() == "403" and "model_control" in refused.value.message()
    grpc_client = tc_grpc.InferenceServerClient(server.grpc_target)
    with pytest.raises(InferenceServerException) as refused:
        grpc_client.unload_model("sim", headers=plain)
    assert "PERMISSION_DENIED" in str(refused.value.status())
    grpc_client.close()
    with pytest.raises(InferenceServerException) as unauthenticated:  # no key at all: 401
        client.get_model_repository_index()
    assert unauthenticated.value.status() == "401"
    assert http_infer(server, "sim", PLAIN).as_numpy("OUTPUT0") is not None  # still served
    client.close()


def test_overrides_are_refused_and_an_unknown_model_is_404(server: ServerProc) -> None:
    client = tc_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    admin = bearer(ADMIN)
    with pytest.raises(InferenceServerException) as refused:
        client.load_model("sim", headers=admin, config=json.dumps({"max_batch_size": 4}))
    assert refused.value.status() == "400" and "config" in refused.value.message()
    body = json.dumps({"parameters": {"file:1/model.py": "cHJpbnQoKQ=="}}).encode()
    request = urllib.request.Request(f"{server.url}/v2/repository/models/sim/load", body, bear(ADMIN), method="POST")
    with pytest.raises(urllib.error.HTTPError) as file_refused:
        urllib.request.urlopen(request)
    assert file_refused.value.code == 400 and b"file:1/model.py" in file_refused.value.read()
    with pytest.raises(InferenceServerException) as unknown:
        client.load_model("nope", headers=admin)
    assert unknown.value.status() == "404"
    grpc_client = tc_grpc.InferenceServerClient(server.grpc_target)
    with pytest.raises(InferenceServerException) as grpc_refused:
        grpc_client.load_model("sim", headers=admin, config=json.dumps({"max_batch_size": 4}))
    assert "INVALID_ARGUMENT" in str(grpc_refused.value.status())
    grpc_client.close()
    client.close()


def admin_get(server: ServerProc, path: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(server.admin_url + path, headers=bearer(ADMIN))) as r:
        return json.loads(r.read())


def holds_work(server: ServerProc, model: str) -> bool:
    """The model has requests queued, or a batch running on a worker."""
    queued = admin_get(server, "/admin/models")["models"][model]["queued"]
    running = sum(w["load"] for w in admin_get(server, "/admin/workers")["workers"] if w["model"] == model)
    return queued + running > 0


def bear(key: str) -> dict[str, str]:
    return {**bearer(key), "Content-Type": "application/json"}


def test_unload_with_requests_in_flight_drains_them(server: ServerProc) -> None:
    """8 requests to a model that takes 150 ms a batch of 2, the unload sent while it holds some of them:
    every request it had accepted is answered 200 (drained: a version removed with work would fail it
    503); one that reached it after the unload is a 404 saying it is unloaded; the model answers 404 after."""
    answers: list[tuple[int, str]] = []
    started = threading.Barrier(9)

    def send() -> None:
        started.wait()
        try:
            http_infer(server, "slow")
            answers.append((200, ""))
        except InferenceServerException as exc:
            answers.append((int(exc.status() or 0), str(exc)))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait()
    wait_for(lambda: holds_work(server, "slow"), 30, "the model holding work")
    client = tc_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    client.unload_model("slow", headers=bearer(ADMIN))
    for t in threads:
        t.join()
    assert len(answers) == 8 and any(code == 200 for code, _ in answers), answers  # what it held: served
    refused = [(code, why) for code, why in answers if code != 200]
    assert all(code == 404 and "is unloaded" in why for code, why in refused), refused
    with pytest.raises(InferenceServerException) as later:
        http_infer(server, "slow")
    assert later.value.status() == "404"
    client.load_model("slow", headers=bearer(ADMIN))  # as the other tests found it
    client.close()


def test_a_file_override_over_the_body_limit_is_refused_by_name_not_413(server: ServerProc) -> None:
    """Triton's clients send a file override's whole file (base64) in the load's body: one over the
    route's 1 MiB body limit gets the same 400 naming it as a small one (a plain tenant: 403 first), on
    REST and gRPC; the model serves on."""
    files = {"file:1/model.onnx": b"\0" * (2 << 20)}  # 2 MiB: about 2.7 MiB of JSON (base64)
    client = tc_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    with pytest.raises(InferenceServerException) as refused:
        client.load_model("sim", headers=bearer(ADMIN), files=files)
    assert refused.value.status() == "400" and "file:1/model.onnx" in (refused.value.message() or "")
    with pytest.raises(InferenceServerException) as forbidden:
        client.load_model("sim", headers=bearer(PLAIN), files=files)
    assert forbidden.value.status() == "403"
    client.close()
    big = json.dumps({"parameters": {"priority": "x" * (2 << 20)}}).encode()  # no override: over the limit
    request = urllib.request.Request(f"{server.url}/v2/repository/models/sim/load", big, bear(ADMIN), method="POST")
    with pytest.raises(urllib.error.HTTPError) as too_large:
        urllib.request.urlopen(request)
    assert too_large.value.code == 413
    grpc_client = tc_grpc.InferenceServerClient(server.grpc_target)
    with pytest.raises(InferenceServerException) as grpc_refused:
        grpc_client.load_model("sim", headers=bearer(ADMIN), files=files)
    assert "INVALID_ARGUMENT" in str(grpc_refused.value.status()) and "file:1/model.onnx" in (grpc_refused.value.message() or "")
    grpc_client.close()
    assert http_infer(server, "sim").as_numpy("OUTPUT0") is not None


def read_response(reader: Any) -> tuple[int, bytes]:
    """One HTTP/1.1 response (status, body) from a socket's reader."""
    status = int(reader.readline().split()[1])
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, reader.read(length)


def send_head(port: int, model: str, body: bytes, key: str | None = None) -> tuple[socket.socket, Any]:
    """An infer of `model` whose body is not sent yet: once the server asks for it (100 Continue), the
    model (and its fallback) were resolved; the socket and its reader."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    reader = sock.makefile("rb")
    sock.sendall(
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n{auth}\r\n".encode()
    )
    assert reader.readline().startswith(b"HTTP/1.1 100") and reader.readline() == b"\r\n"
    return sock, reader


def body_after_the_unload_began(
    client: Any, unloader: threading.Thread, sock: socket.socket, reader: Any, body: bytes, headers: dict | None = None
) -> tuple[int, bytes]:
    """Once the index says the unload began (the model's queue empty, nothing running), and the unload
    had a second to end without the request: the request's body, then its response (status, body)."""
    unloader.start()
    wait_for(
        lambda: states(client.get_model_repository_index(headers=headers))["sim"] == ("UNAVAILABLE", "unloaded"),
        30, "the unload begun",
    )
    unloader.join(timeout=1.0)  # an unload that does not wait for the request ends meanwhile
    sock.sendall(body)
    try:
        return read_response(reader)
    finally:
        sock.close()


def test_a_request_past_the_check_still_sending_its_body_is_answered_by_the_model(server: ServerProc) -> None:
    """A request whose model was resolved (the server asked for its body: 100 Continue) before the unload
    began, and whose body comes only after the unload found the model's queue empty and nothing running:
    the model answers it (200; the unload waits for it), never a 503 for a version removed under it."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["hello"]}]}).encode()
    admin = bearer(ADMIN)
    client = tc_http.InferenceServerClient(f"127.0.0.1:{server.port}")
    sock, reader = send_head(server.port, "sim", body, CONTROL)  # past the check
    unloaded: list[bool] = []

    def unload() -> None:
        control = tc_http.InferenceServerClient(f"127.0.0.1:{server.port}", network_timeout=120.0)
        control.unload_model("sim", headers=admin)
        unloaded.append(True)
        control.close()

    unloader = threading.Thread(target=unload)
    status, answer = body_after_the_unload_began(client, unloader, sock, reader, body, admin)
    assert status == 200 and b"OUTPUT0" in answer, (status, answer)
    unloader.join()
    assert unloaded == [True]
    with pytest.raises(InferenceServerException) as later:
        http_infer(server, "sim")
    assert later.value.status() == "404" and "is unloaded" in (later.value.message() or "")
    client.load_model("sim", headers=admin)  # as the other tests found it
    client.close()


PRIMARY = 'builtin = "sim"\nworkers = 0\nmax_wait_ms = 1\n[traffic]\nfallback = "sim"\n'


def test_a_request_handed_to_a_fallback_being_unloaded_is_answered_by_it(tmp_path: Path) -> None:
    """A model with no worker hands its request to its fallback before the body is read; the fallback is
    unloaded while the body is still on its way: the fallback answers it (200, flagged), never 503."""
    repo = tmp_path / "models"
    for name, toml in (("sim", SIM), ("primary", PRIMARY)):
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(toml)
    s = start_server(tmp_path, "--model-repo", str(repo), ready_path="/v2/health/live")
    client = tc_http.InferenceServerClient(f"127.0.0.1:{s.port}")
    try:
        wait_for(lambda: client.is_model_ready("sim"), 60, "sim ready")
        body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}).encode()
        sock, reader = send_head(s.port, "primary", body)
        unloader = threading.Thread(target=lambda: tc_http.InferenceServerClient(f"127.0.0.1:{s.port}").unload_model("sim"))
        status, answer = body_after_the_unload_began(client, unloader, sock, reader, body)
        assert status == 200 and b"OUTPUT0" in answer, (status, answer)
        unloader.join()
        assert "model sim: unloaded" in s.log()
    finally:
        client.close()
        assert s.stop() in (0, -15)


def test_explicit_serves_only_the_load_model_ones_at_start(tmp_path: Path) -> None:
    repo = repository(tmp_path)
    s = start_server(tmp_path, "--model-repo", str(repo), "--model-control", "explicit", "--load-model", "sim")
    try:
        client = tc_http.InferenceServerClient(f"127.0.0.1:{s.port}")
        assert states(client.get_model_repository_index()) == {
            "sim": ("READY", ""),
            "slow": ("UNAVAILABLE", "not loaded"),
        }
        with pytest.raises(InferenceServerException) as refused:
            client.infer("slow", [sim_input(tc_http.InferInput)])
        assert refused.value.status() == "404" and "not loaded" in refused.value.message()
        clients = [tc_http.InferenceServerClient(f"127.0.0.1:{s.port}") for _ in range(2)]
        loads = [threading.Thread(target=c.load_model, args=("slow",)) for c in clients]
        for t in loads:  # the second joins the first's load
            t.start()
        while states(client.get_model_repository_index())["slow"][0] != "LOADING":  # its worker starts
            assert any(t.is_alive() for t in loads), "the load ended before the index said LOADING"
        with urllib.request.urlopen(f"{s.url}/v2/health/ready") as r:  # a model loading holds nothing down
            assert r.status == 200
        for t in loads:
            t.join()
        assert client.infer("slow", [sim_input(tc_http.InferInput)]).as_numpy("OUTPUT0") is not None
        assert s.log().count("model slow: loaded") == 1
        client.close()
    finally:
        assert s.stop() in (0, -15)


POOLED = 'builtin = "sim"\npool = "p"\nmemory_mb = 60\nmax_wait_ms = 1\n[params]\nbase_ms = 2.0\nmemory_mb = 20\n'
POOLS = "[pools.p]\nworkers = 1\nmemory_budget_mb = 300\nmin_resident_s = 0.1\n"


def test_a_pooled_model_unloads_from_its_pool_loads_ready_at_once_and_too_big_is_400(tmp_path: Path) -> None:
    (tmp_path / "models" / "pooled").mkdir(parents=True)
    (tmp_path / "models" / "pooled" / "model.toml").write_text(POOLED)
    (tmp_path / "inferd.toml").write_text(POOLS)
    s = start_server(tmp_path, "--model-repo", str(tmp_path / "models"), "--config", str(tmp_path / "inferd.toml"))
    client = tc_http.InferenceServerClient(f"127.0.0.1:{s.port}")
    try:
        assert client.infer("pooled", [sim_input(tc_http.InferInput)]).as_numpy("OUTPUT0") is not None
        client.unload_model("pooled")
        with pytest.raises(InferenceServerException) as refused:
            client.infer("pooled", [sim_input(tc_http.InferInput)])
        assert refused.value.status() == "404" and "unloaded" in refused.value.message()
        assert "told to unload it" in s.log()

        client.load_model("pooled")  # served on demand: READY at once, loaded by the pool on its first request
        assert states(client.get_model_repository_index()) == {"pooled": ("READY", "")}
        assert client.infer("pooled", [sim_input(tc_http.InferInput)]).as_numpy("OUTPUT0") is not None

        client.unload_model("pooled")
        (tmp_path / "models" / "pooled" / "model.toml").write_text(POOLED.replace("memory_mb = 60", "memory_mb = 500"))
        with pytest.raises(InferenceServerException) as too_big:
            client.load_model("pooled")
        assert too_big.value.status() == "400"
        assert "500" in too_big.value.message() and "300" in too_big.value.message()
    finally:
        client.close()
        assert s.stop() in (0, -15)



def answered(server: ServerProc, model: str) -> dict[str, float]:
    """Front end -> its requests of `model` answered ok, from one /metrics scrape."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("inferd_requests_total{") and f'model="{model}"' in line and 'outcome="ok"' in line:
                labels, _, value = line.rpartition(" ")
                frontend = labels.split('frontend="')[1].split('"')[0]
                out[frontend] = out.get(frontend, 0.0) + float(value)
    return out


def codes_of(server: ServerProc, model: str, count: int) -> list[tuple[int, str]]:
    """`count` infers, each on a new connection (either front end takes it): (status, message) each."""
    out = []
    for _ in range(count):
        try:
            http_infer(server, model)
            out.append((200, ""))
        except InferenceServerException as exc:
            out.append((int(exc.status() or 0), exc.message() or ""))
    return out


def extra_connection(server: ServerProc) -> None:
    """One more connection, or none, at random (the next goes to either front end)."""
    if random.random() < 0.5:
        with urllib.request.urlopen(f"{server.url}/v2/health/live", timeout=5) as r:
            assert r.status == 200


def test_with_two_front_ends_an_unload_and_a_load_reach_both(tmp_path: Path) -> None:
    """`--frontends 2`: an unload asked of either front end makes both answer 404 "unloaded" (the
    follower logs it, and stops serving the model); a load makes both answer 200 (each counts answers of
    its own). Each control call goes on a new connection, so either front end takes it: the calls are
    repeated until one was forwarded from the follower to the owner (each pair: 3 in 4; the kernel may
    deal connections out in turn, so a random extra connection comes before each call). Explicit mode:
    a model not loaded at start, loaded, is answered by both."""
    repo = str(repository(tmp_path))
    s = start_server(tmp_path, "--model-repo", repo, "--frontends", "2", "--model-control", "explicit", "--load-model", "sim")
    try:
        for _ in range(8):
            before = answered(s, "sim")
            extra_connection(s)
            tc_http.InferenceServerClient(f"127.0.0.1:{s.port}").unload_model("sim")
            refused = codes_of(s, "sim", 16)
            assert all(code == 404 and "is unloaded: load it" in why for code, why in refused), refused
            index = tc_http.InferenceServerClient(f"127.0.0.1:{s.port}").get_model_repository_index()
            assert states(index)["sim"] == ("UNAVAILABLE", "unloaded")
            extra_connection(s)
            tc_http.InferenceServerClient(f"127.0.0.1:{s.port}").load_model("sim")
            for _ in range(100):  # until both front ends answered some (each request on a new connection)
                assert codes_of(s, "sim", 4) == [(200, "")] * 4
                now = answered(s, "sim")
                if all(now.get(f, 0.0) > before.get(f, 0.0) for f in ("0", "1")):
                    break
            assert all(now.get(f, 0.0) > before.get(f, 0.0) for f in ("0", "1")), (before, now)
            if "forwarded here by another front end" in s.log():
                break
        client = tc_http.InferenceServerClient(f"127.0.0.1:{s.port}")
        assert states(client.get_model_repository_index())["slow"] == ("UNAVAILABLE", "not loaded")
        client.load_model("slow")
        for _ in range(40):  # until both front ends answered some
            assert codes_of(s, "slow", 1) == [(200, "")]
            if set(answered(s, "slow")) == {"0", "1"}:
                break
        assert set(answered(s, "slow")) == {"0", "1"}
        log = s.log()
        assert "forwarded here by another front end" in log
        assert "model sim: unloaded by the server (unloaded): its new requests are refused here" in log
        assert "model sim: loaded by the server: served here too" in log
    finally:
        assert s.stop() in (0, -15)
