"""`inferd serve --frontends 2`: two front-end processes on one port, sharing two local workers.

* /metrics answers for the whole server whichever front end takes the scrape;
* each worker, fed by both front ends at once, never holds more than 1 running + 1 staged batch (the
  high-water mark its heartbeat reports);
* SIGKILL one front end under checked load: only requests it held fail (a connection error), no answer
  is wrong or duplicated, the other front end goes on and the parent starts the killed one again;
* `POST /admin/reload` (the owner's admin API) reaches every front end before it is answered: a key
  required by the reloaded file is required at once whichever front end takes the request, also by a
  front end started again since;
* front ends with no local workers (remote ones only, none joined yet) open the port within seconds,
  not after the local workers' start timeout;
* both front ends serve the gRPC API on the one gRPC port (SO_REUSEPORT): connections spread over them
  and each answers ModelInfer with the sim digest.

Bounded: one server for the module, loads capped in count and time."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inferd.gateway.keys import key_digest, new_key
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.protos import grpc_service_pb2_grpc as pb_grpc
from inferd.models.sim import sim_digest
from tests.checked_load import Load, tally, wait_for
from tests.conftest import ServerProc, alive, child_pids, free_port, start_server
from tests.frontends_harness import ready_workers, scrape, two_frontends

CONFIG = """
[models.sim]
max_batch_size = 4
max_queue_size = 64
max_wait_ms = 2.0

[models.sim.params]
base_ms = 15.0
per_item_ms = 0.5
"""
"""Small batches, so that a front end often has a full batch to stage: two front ends that ignored the
worker's credits would hold up to 4 batches on it."""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("frontends")


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerProc]:
    with two_frontends(root, CONFIG) as proc:
        yield proc


def ok_requests(sample: dict[str, float], frontend: str) -> float:
    return sum(
        v
        for k, v in sample.items()
        if k.startswith("inferd_requests_total{") and f'frontend="{frontend}"' in k and 'outcome="ok"' in k
    )


def frontend_pids(server: ServerProc) -> tuple[int, int]:
    """(owner, other): the owner is the front end whose children are the workers."""
    pids = [p for p in child_pids(server.proc.pid) if alive(p)]
    assert len(pids) == 2, f"expected two front ends, found {pids}"
    owner = [p for p in pids if child_pids(p)]
    assert len(owner) == 1, f"one front end should run the workers: {pids}"
    return owner[0], next(p for p in pids if p != owner[0])


def test_metrics_cover_both_front_ends_and_a_shared_worker_keeps_its_batch_cap(server: ServerProc) -> None:
    with Load(server.url, "cap", clients=32, max_requests=2500, max_s=40) as load:
        load.finish(within_s=60)
    t = tally(load)
    assert t.misrouted == 0 and t.duplicated == 0 and t.lost == 0, t
    for _ in range(4):  # each scrape may land on either front end: every one holds both
        sample = scrape(server)
        assert sample['inferd_frontend_up{frontend="0"}'] == 1.0
        assert sample['inferd_frontend_up{frontend="1"}'] == 1.0
        assert ok_requests(sample, "0") > 0 and ok_requests(sample, "1") > 0
        assert ok_requests(sample, "0") + ok_requests(sample, "1") >= t.ok
    time.sleep(1.5)  # the workers' next heartbeat carries their high-water mark
    workers = ready_workers(server)
    assert all(w["credits"] is not None for w in workers), workers
    marks = [w["batch_high_water"] for w in workers]
    assert all(1 <= m <= 2 for m in marks), marks


def grpc_infer_on_a_new_connection(target: str, text: bytes) -> str:
    """ModelInfer of `text` on sim over a connection of its own (no subchannel shared with an earlier
    channel of this process): the kernel hands each new connection to either front end."""
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
        tensor = pb.ModelInferRequest.InferInputTensor(
            name="INPUT0", datatype="BYTES", shape=[1], contents=pb.InferTensorContents(bytes_contents=[text])
        )
        answer = stub.ModelInfer(pb.ModelInferRequest(model_name="sim", inputs=[tensor]), timeout=10)
    (raw,) = answer.raw_output_contents
    size = int.from_bytes(raw[:4], "little")  # one BYTES element: its length, then its bytes
    assert len(raw) == 4 + size
    return raw[4:].decode()


def test_both_front_ends_answer_grpc_on_the_one_grpc_port(server: ServerProc) -> None:
    before = scrape(server)
    calls = 0

    def both_answered() -> bool:
        nonlocal calls
        for _ in range(8):
            text = f"grpc-{calls}".encode()
            assert grpc_infer_on_a_new_connection(server.grpc_target, text) == sim_digest("sim", 1, text)
            calls += 1
        sample = scrape(server)
        return all(ok_requests(sample, fe) > ok_requests(before, fe) for fe in ("0", "1"))

    wait_for(both_answered, 60, "gRPC answers from both front ends")
    assert server.log().count(f"gRPC API on 127.0.0.1:{server.grpc_port}") >= 2  # each front end its listener


def test_sigkill_of_one_front_end_fails_only_its_own_requests(server: ServerProc) -> None:
    owner, victim = frontend_pids(server)
    clients = 8
    with Load(server.url, "kill", clients=clients, max_requests=1500, max_s=40) as load:
        wait_for(lambda: load.answered() >= 300, 30, "300 answers before the kill")
        os.kill(victim, signal.SIGKILL)
        killed_at = load.answered()
        load.finish(within_s=60)
    t = tally(load)
    assert t.misrouted == 0 and t.duplicated == 0, t
    # Each client has one request in flight; every request opens a new connection. Until the killed
    # process's listening socket is closed in its teardown, the kernel still hashes new connections to it
    # (SO_REUSEPORT), and those die with it too: at most one more per client, never an answer lost elsewhere.
    assert t.lost <= 2 * clients, f"only requests sent to the front end killed may fail: {t}"
    assert t.refused == 0, [(a.status, a.body) for a in load.answers if a.status != 200][:5]
    assert t.ok - killed_at >= 500, f"the server stopped answering after the kill: {t}"
    assert alive(owner)
    wait_for(lambda: len([p for p in child_pids(server.proc.pid) if alive(p)]) == 2, 20, "a new front end")
    wait_for(lambda: scrape(server).get('inferd_frontend_up{frontend="1"}') == 1.0, 20, "front end 1 back")


def statuses(server: ServerProc, n: int, key: str | None = None) -> list[int]:
    """The statuses of `n` sim inferences, each on a new connection (SO_REUSEPORT spreads them)."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["x"]}]})
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    out = []
    for _ in range(n):
        request = urllib.request.Request(
            f"{server.url}/v2/models/sim/infer", body.encode(), headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                out.append(r.status)
        except urllib.error.HTTPError as exc:
            out.append(exc.code)
    return out


def reload(server: ServerProc) -> dict:
    request = urllib.request.Request(f"{server.admin_url}/admin/reload", b"", method="POST")
    with urllib.request.urlopen(request, timeout=30) as r:  # the owner waits up to 10 s for the others
        return json.loads(r.read())


def test_admin_reload_reaches_every_front_end(server: ServerProc, root: Path) -> None:
    key = new_key()
    (root / "inferd.toml").write_text(CONFIG + f'\n[tenants.acme]\napi_key_sha256 = ["{key_digest(key)}"]\n')
    try:
        everywhere = {"count": 2, "reloaded": [0, 1], "refused": {}, "not_answered": [], "complete": True}
        assert reload(server)["frontends"] == everywhere
        # answered once both front ends took it: 20 requests on new connections at once, none let through
        assert set(statuses(server, 20)) == {401}
        assert set(statuses(server, 10, key)) == {200}
        # a front end started again after the reload reads the file as it is now, not as at start
        _, follower = frontend_pids(server)
        os.kill(follower, signal.SIGKILL)
        wait_for(lambda: not alive(follower), 10, "the follower gone")
        wait_for(
            lambda: len([p for p in child_pids(server.proc.pid) if alive(p)]) == 2, 20, "a new front end"
        )
        wait_for(
            lambda: scrape(server).get('inferd_frontend_up{frontend="1"}') == 1.0, 30, "front end 1 back"
        )
        assert set(statuses(server, 20)) == {401}
    finally:
        (root / "inferd.toml").write_text(CONFIG)
        answer = reload(server)
    assert answer["frontends"] == everywhere
    assert set(statuses(server, 20)) == {200}


def test_front_ends_without_local_workers_listen_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Remote workers only, none joined: /v2/health/live answers (readiness says 503) well before the
    120 s `worker_start_timeout_s` that front ends with local workers wait for them."""
    monkeypatch.setenv("INFERD_JOIN_TOKEN", new_key())
    args = ("--model", "sim", "--workers", "0", "--frontends", "2", "--worker-port", str(free_port()))
    server = start_server(tmp_path, *args, ready_timeout_s=40, ready_path="/v2/health/live")
    try:
        assert statuses(server, 1) == [503]  # no worker: refused, not hung
    finally:
        server.stop()
