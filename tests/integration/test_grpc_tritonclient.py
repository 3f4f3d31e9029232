"""tritonclient's gRPC client, sync and asyncio, against a real `inferd serve` (the sim and scale models
of examples/model_repo, and sim-llm): the checks the REST suite makes, over Triton's GRPCInferenceService; and with
tenants configured, keys and quotas (a raw grpc stub reads the trailers); TLS; and SIGTERM with a call in
flight. Four servers in all: two shared by the module's tests, one each for TLS and shutdown."""

from __future__ import annotations

import queue
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
import tritonclient.http as tc_http
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.utils import InferenceServerException

from inferd.gateway.keys import key_digest, new_key
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.protos import grpc_service_pb2_grpc as pb_grpc
from inferd.models.sim import sim_digest
from tests.conftest import ROOT, ServerProc, free_port, start_server

ALPHA, LIMITED = new_key(), new_key()
TENANTS = f"""
[tenants.alpha]
models = ["sim"]
api_key_sha256 = ["{key_digest(ALPHA)}"]

[tenants.limited]
models = ["sim"]
api_key_sha256 = ["{key_digest(LIMITED)}"]
requests_per_s = 0.01
burst = 1
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("grpc")
    (root / "inferd.toml").write_text("[models.scale.cache]\nenabled = true\n")  # one response cache for both edges
    repo = root / "models"  # examples/model_repo, and an LLM
    shutil.copytree(ROOT / "examples" / "model_repo", repo)
    (repo / "sim-llm").mkdir()
    (repo / "sim-llm" / "model.toml").write_text('builtin = "sim-llm"\n')
    s = start_server(root, "--model-repo", str(repo), "--config", str(root / "inferd.toml"))
    yield s
    assert s.stop() in (0, -15)


@pytest.fixture
def client(server: ServerProc) -> Iterator[tc.InferenceServerClient]:
    c = tc.InferenceServerClient(server.grpc_target)
    yield c
    c.close()


def texts_input(texts: list[bytes]) -> tc.InferInput:
    inp = tc.InferInput("INPUT0", [len(texts)], "BYTES")
    inp.set_data_from_numpy(np.array(texts, dtype=object))
    return inp


def test_health_and_readiness(client: tc.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("sim")
    assert client.is_model_ready("sim", "1")
    meta = client.get_server_metadata()
    assert meta.name == "inferd"
    assert list(meta.extensions) == ["model_repository", "schedule_policy", "model_configuration", "statistics"]
    assert client.get_model_config("sim").config.name == "sim"  # model_configuration
    assert client.get_inference_statistics("sim").model_stats  # statistics
    assert "sim" in {m.name for m in client.get_model_repository_index().models}  # model_repository


def test_model_metadata_names_the_tensors_with_the_batch_dimension(client: tc.InferenceServerClient) -> None:
    meta = client.get_model_metadata("sim", as_json=True)
    assert meta["name"] == "sim"
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "BYTES", "shape": ["-1"]}]
    scale = client.get_model_metadata("scale", as_json=True)
    assert scale["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert [o["name"] for o in scale["outputs"]] == ["DOUBLED", "SUM"]


def test_an_llm_presents_tritons_vllm_tensors(client: tc.InferenceServerClient) -> None:
    meta = client.get_model_metadata("sim-llm", as_json=True)
    assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == [
        ("text_input", "BYTES"), ("stream", "BOOL"), ("sampling_parameters", "BYTES"), ("exclude_input_in_output", "BOOL")
    ]
    assert meta["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": ["-1"]}]
    config = client.get_model_config("sim-llm", as_json=True)["config"]
    assert config["model_transaction_policy"] == {"decoupled": True}
    assert [i["name"] for i in config["input"] if i.get("optional")] == [
        "stream", "sampling_parameters", "exclude_input_in_output"
    ]


def test_model_config_is_triton_shaped(client: tc.InferenceServerClient) -> None:
    config = client.get_model_config("scale", as_json=True)["config"]
    assert config["name"] == "scale"
    assert config["backend"] == "inferd"
    assert config["max_batch_size"] == 64
    assert config["input"] == [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["4"]}]
    assert config["output"][1] == {"name": "SUM", "data_type": "TYPE_FP64"}  # a scalar per item: no dims
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "5000"
    sim = client.get_model_config("sim", as_json=True)["config"]
    assert sim["input"] == [{"name": "INPUT0", "data_type": "TYPE_STRING"}]


def test_infer_bytes_answers_the_sim_digest_rest_answers(server: ServerProc, client: tc.InferenceServerClient) -> None:
    texts = [b"alpha", b"beta", "gamma\u00e9".encode()]
    result = client.infer("sim", [texts_input(texts)], request_id="g-1")
    got = [x.decode() for x in result.as_numpy("OUTPUT0").tolist()]
    assert got == [sim_digest("sim", 1, t) for t in texts]
    response = result.get_response()
    assert response.id == "g-1"
    assert response.model_name == "sim" and response.model_version == "1"
    rest = tc_http.InferenceServerClient(server.url.removeprefix("http://"))
    inp = tc_http.InferInput("INPUT0", [3], "BYTES")
    inp.set_data_from_numpy(np.array(texts, dtype=object))
    rest_out = rest.infer("sim", [inp]).as_numpy("OUTPUT0").tolist()
    rest.close()
    assert [x.decode() if isinstance(x, bytes) else x for x in rest_out] == got


def test_infer_fp32_rows_keep_their_order(client: tc.InferenceServerClient) -> None:
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    inp = tc.InferInput("INPUT0", [3, 4], "FP32")
    inp.set_data_from_numpy(data)
    result = client.infer("scale", [inp], outputs=[tc.InferRequestedOutput("SUM")])
    assert result.as_numpy("DOUBLED") is None  # only the output asked for
    np.testing.assert_allclose(result.as_numpy("SUM"), data.sum(axis=1))
    both = client.infer("scale", [inp])
    np.testing.assert_allclose(both.as_numpy("DOUBLED"), data * 2)
    assert both.as_numpy("DOUBLED").dtype == np.float32


def test_unknown_model_is_not_found(client: tc.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.infer("nope", [texts_input([b"x"])])
    assert err.value.status() == "StatusCode.NOT_FOUND"
    assert "unknown model 'nope'" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.is_model_ready("nope")
    assert err.value.status() == "StatusCode.NOT_FOUND"


def test_a_version_asked_for_is_served_or_not_found(client: tc.InferenceServerClient) -> None:
    result = client.infer("sim", [texts_input([b"v1"])], model_version="1")
    assert result.get_response().model_version == "1"
    with pytest.raises(InferenceServerException) as err:
        client.infer("sim", [texts_input([b"v9"])], model_version="9")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    assert "9" in err.value.message()


def test_a_bad_shape_is_an_invalid_argument_naming_it(client: tc.InferenceServerClient) -> None:
    inp = tc.InferInput("INPUT0", [2, 3], "FP32")
    inp.set_data_from_numpy(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(InferenceServerException) as err:
        client.infer("scale", [inp])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "per-item shape must be [4]" in err.value.message()


async def test_the_asyncio_client_gets_the_same_answers(server: ServerProc) -> None:
    client = tc_aio.InferenceServerClient(server.grpc_target)
    try:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        assert await client.is_model_ready("sim")
        assert (await client.get_model_metadata("sim")).name == "sim"
        texts = [f"aio-{i}".encode() for i in range(5)]
        inp = tc_aio.InferInput("INPUT0", [5], "BYTES")
        inp.set_data_from_numpy(np.array(texts, dtype=object))
        result = await client.infer("sim", [inp])
        assert [x.decode() for x in result.as_numpy("OUTPUT0").tolist()] == [sim_digest("sim", 1, t) for t in texts]
    finally:
        await client.close()


def test_statistics_count_the_answered_requests(client: tc.InferenceServerClient) -> None:
    before = client.get_inference_statistics("sim", as_json=True)["model_stats"][0]
    for i in range(3):
        client.infer("sim", [texts_input([f"s{i}".encode()])])
    after = client.get_inference_statistics("sim", as_json=True)["model_stats"][0]
    assert after["name"] == "sim" and after["version"] == "1"
    assert int(after["inference_count"]) - int(before.get("inference_count", 0)) == 3
    ok = after["inference_stats"]["success"]
    assert int(ok["count"]) == int(after["inference_count"]) and int(ok["ns"]) > 0
    every = client.get_inference_statistics(as_json=True)["model_stats"]
    assert {m["name"] for m in every} == {"sim", "scale", "sim-llm"}


def test_the_metrics_count_grpc_calls_under_their_protocol(server: ServerProc, client: tc.InferenceServerClient) -> None:
    client.infer("sim", [texts_input([b"metrics"])])
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    grpc_ok = re.search(r'inferd_requests_total\{model="sim",outcome="ok",protocol="grpc",version="1"\} (\S+)', text)
    assert grpc_ok and float(grpc_ok.group(1)) >= 1
    assert 'inferd_request_duration_seconds_count{model="sim",outcome="ok",protocol="grpc",version="1"}' in text


def test_a_client_deadline_ends_the_call_deadline_exceeded(client: tc.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as err:  # admitted (nothing queued), but sim computes 20 ms
        client.infer("sim", [texts_input([b"slow"])], client_timeout=0.005)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert client.infer("sim", [texts_input([b"after"])], client_timeout=10).as_numpy("OUTPUT0") is not None


def test_the_smaller_of_the_deadline_and_parameters_timeout_wins(client: tc.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as err:  # 2 ms cannot hold a 20 ms batch, 30 s could
        client.infer("sim", [texts_input([b"t"])], client_timeout=30, timeout=2000)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "deadline" in err.value.message()
    with pytest.raises(InferenceServerException) as err:  # and the other way round
        client.infer("sim", [texts_input([b"t"])], client_timeout=0.002, timeout=30_000_000)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"


def test_health_check_answers_serving_for_the_server_and_each_model(server: ServerProc) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == serving
        assert health.Check(health_pb2.HealthCheckRequest(service="sim")).status == serving
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(server: ServerProc) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(answers).list_services_response.service}
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_the_shared_memory_rpcs_are_unimplemented_and_the_repository_index_answers(
    client: tc.InferenceServerClient,
) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.get_system_shared_memory_status()
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    index = client.get_model_repository_index(as_json=True)["models"]  # tests/integration/test_repository_api.py
    assert {m["name"] for m in index} == {"sim", "scale", "sim-llm"}


# ---- with tenants: keys and quotas -------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("grpc-keys")
    (root / "inferd.toml").write_text(TENANTS)
    s = start_server(
        root, "--model-repo", str(ROOT / "examples" / "model_repo"), "--config", str(root / "inferd.toml")
    )
    yield s
    assert s.stop() in (0, -15)


def sim_request(text: bytes = b"k") -> pb.ModelInferRequest:
    blob = len(text).to_bytes(4, "little") + text
    tensor = pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="BYTES", shape=[1])
    return pb.ModelInferRequest(model_name="sim", inputs=[tensor], raw_input_contents=[blob])


def test_a_call_without_a_key_is_unauthenticated_but_probes_stay_open(keyed: ServerProc) -> None:
    client = tc.InferenceServerClient(keyed.grpc_target)
    try:
        assert client.is_server_live() and client.is_server_ready()
        with pytest.raises(InferenceServerException) as err:
            client.infer("sim", [texts_input([b"x"])])
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
        assert "an API key is required" in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            client.is_model_ready("sim", headers={"authorization": "Bearer not-a-key"})
        assert err.value.status() == "StatusCode.UNAUTHENTICATED"
    finally:
        client.close()


def test_a_key_calls_its_models_and_no_other(keyed: ServerProc) -> None:
    client = tc.InferenceServerClient(keyed.grpc_target)
    try:
        for headers in ({"authorization": f"Bearer {ALPHA}"}, {"x-api-key": ALPHA}):
            result = client.infer("sim", [texts_input([b"keyed"])], headers=headers)
            assert result.as_numpy("OUTPUT0").tolist() == [sim_digest("sim", 1, "keyed").encode()]
        inp = tc.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 4), dtype=np.float32))
        with pytest.raises(InferenceServerException) as err:
            client.infer("scale", [inp], headers={"x-api-key": ALPHA})
        assert err.value.status() == "StatusCode.PERMISSION_DENIED"
        assert "may not call model 'scale'" in err.value.message()
    finally:
        client.close()


def test_a_models_health_needs_a_key_its_tenant_may_use_as_its_ready_route_does(keyed: ServerProc) -> None:
    """The server's health ("") is a probe's, open; a model's says which models are served and whether
    they are ready, as GET /v2/models/{name}/ready does: it needs a key, and the key's tenant sees only
    its own models."""
    serving = health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(keyed.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == serving
        for service in ("sim", "scale", "nope"):  # without a key, nothing is told about any model
            with pytest.raises(grpc.RpcError) as err:
                health.Check(health_pb2.HealthCheckRequest(service=service))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, service
            assert "an API key is required" in (err.value.details() or "")
        with pytest.raises(grpc.RpcError) as err:
            next(iter(health.Watch(health_pb2.HealthCheckRequest(service="sim"))))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        key = (("x-api-key", ALPHA),)
        assert health.Check(health_pb2.HealthCheckRequest(service="sim"), metadata=key).status == serving
        watch = health.Watch(health_pb2.HealthCheckRequest(service="sim"), metadata=key)
        assert next(iter(watch)).status == serving
        watch.cancel()
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="scale"), metadata=key)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="nope"), metadata=key)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "served models: ['sim']" in (err.value.details() or "")


def test_a_tenant_over_its_rate_is_resource_exhausted_with_retry_after(keyed: ServerProc) -> None:
    metadata = (("authorization", f"Bearer {LIMITED}"),)
    with grpc.insecure_channel(keyed.grpc_target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answer, call = stub.ModelInfer.with_call(sim_request(), metadata=metadata, timeout=10)
        assert answer.model_name == "sim"
        trailers = dict(call.trailing_metadata())
        assert trailers["x-inferd-model"] == "sim" and trailers["x-inferd-model-version"] == "1"
        assert int(trailers["x-inferd-batch-size"]) >= 1 and trailers["x-request-id"]
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(sim_request(), metadata=metadata, timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    refused = dict(err.value.trailing_metadata())
    assert int(refused["retry-after"]) >= 1
    assert float(refused["x-inferd-retry-after-ms"]) > 0
    assert "x-ratelimit-limit-requests" in refused
    assert refused["x-request-id"]


def metric(server: ServerProc, series: str) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_cancelled_call_is_withdrawn_and_counted_cancelled(server: ServerProc) -> None:
    cancelled = 'inferd_requests_total{model="sim",outcome="cancelled",protocol="grpc",version="1"}'
    depth = 'inferd_queue_depth{model="sim",version="1"}'
    cut = 'inferd_batch_size_sum{model="sim",version="1"}'  # items put in batches
    before = metric(server, cancelled)
    texts = [f"gone-{i}".encode() for i in range(400)]  # four batches of 100: the last wait while one runs
    request = pb.ModelInferRequest(
        model_name="sim",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="BYTES", shape=[400])],
        raw_input_contents=[b"".join(len(t).to_bytes(4, "little") + t for t in texts)],
    )
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(5):  # cancelled while its items wait (a try that ends first is tried again)
            cut_before = metric(server, cut)
            future = stub.ModelInfer.future(request, timeout=30)
            while not future.done() and metric(server, depth) == 0:
                time.sleep(0.002)
            if future.cancel():
                break
        assert future.cancelled()
        deadline = time.monotonic() + 10
        while metric(server, cancelled) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(server, cancelled) == before + 1
        assert stub.ModelInfer(sim_request(b"next"), timeout=10).model_name == "sim"
        assert metric(server, depth) == 0
        assert metric(server, cut) - cut_before < 400 + 1  # its waiting items were withdrawn, never run


# ---- TLS: the HTTP listener's certificate -------------------------------------------------------------
def test_grpc_speaks_tls_with_the_https_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    (tmp_path / "cert.pem").write_bytes(b"".join(b.bytes() for b in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(tmp_path / "key.pem")
    port, grpc_port, admin_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "inferd.cli.main", "serve", "--model", "sim", "--shutdown-grace-s", "0"),
            *("--port", str(port), "--grpc-port", str(grpc_port), "--admin-port", str(admin_port)),
            *("--ssl-certfile", str(tmp_path / "cert.pem"), "--ssl-keyfile", str(tmp_path / "key.pem")),
            *("--data-dir", str(tmp_path / "data")),
        ],
        stdout=open(tmp_path / "server.log", "wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    server = ServerProc(proc, port, tmp_path / "server.log", admin_port, grpc_port)
    roots = (tmp_path / "ca.pem").read_bytes()
    try:
        with grpc.secure_channel(server.grpc_target, grpc.ssl_channel_credentials(roots)) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="sim")
            deadline = time.monotonic() + 60
            while health.Check(request, wait_for_ready=True, timeout=60).status != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, f"sim not served over TLS within 60 s:\n{server.log()}"
                time.sleep(0.05)  # the gRPC API is up before the model's worker is ready
        client = tc.InferenceServerClient(server.grpc_target, ssl=True, root_certificates=str(tmp_path / "ca.pem"))
        result = client.infer("sim", [texts_input([b"over tls"])])
        assert result.as_numpy("OUTPUT0").tolist() == [sim_digest("sim", 1, "over tls").encode()]
        client.close()
        with grpc.insecure_channel(server.grpc_target) as plain:
            with pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert server.stop() in (0, -15), server.log()


def test_the_response_cache_answers_either_edge_from_the_other(server: ServerProc) -> None:
    data = np.array([[9.0, 8.0, 7.0, 6.0]], dtype=np.float32)
    rest = tc_http.InferenceServerClient(server.url.removeprefix("http://"))
    inp = tc_http.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(data, binary_data=True)
    outputs = [tc_http.InferRequestedOutput(name, binary_data=True) for name in ("DOUBLED", "SUM")]
    assert rest.infer("scale", [inp], outputs=outputs).get_response()["parameters"]["cache"] == "miss"
    rest.close()
    tensor = pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[1, 4])
    request = pb.ModelInferRequest(model_name="scale", inputs=[tensor], raw_input_contents=[data.tobytes()])
    with grpc.insecure_channel(server.grpc_target) as channel:
        answer, call = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer.with_call(request, timeout=10)
    assert dict(call.trailing_metadata())["x-inferd-cache"] == "hit"
    assert np.frombuffer(answer.raw_output_contents[0], dtype=np.float32).tolist() == (data * 2).ravel().tolist()


# ---- shutdown -----------------------------------------------------------------------------------------
def test_sigterm_lets_grpc_calls_in_flight_finish_before_the_runtimes_stop(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--model", "sim")
    texts = [f"drain-{i}".encode() for i in range(300)]  # three batches: still running at SIGTERM
    request = pb.ModelInferRequest(
        model_name="sim",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="BYTES", shape=[300])],
        raw_input_contents=[b"".join(len(t).to_bytes(4, "little") + t for t in texts)],
    )
    depth = 'inferd_queue_depth{model="sim",version="1"}'
    try:
        with grpc.insecure_channel(server.grpc_target) as channel:
            future = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer.future(request, timeout=30)
            while not future.done() and metric(server, depth) == 0:  # its items are queued
                time.sleep(0.002)
            assert not future.done()  # a batch or more of its work is left
            server.proc.send_signal(signal.SIGTERM)
            answer = future.result()
        got = [answer.raw_output_contents[0][4 + 36 * i : 36 * (i + 1)].decode() for i in range(300)]
        assert got == [sim_digest("sim", 1, t) for t in texts]
    finally:
        assert server.stop() in (0, -15), server.log()
    assert "gRPC API stopped" in server.log()


# ---- the listener's bound on calls at once ------------------------------------------------------------
def test_calls_past_the_bound_are_refused_resource_exhausted_before_they_run(tmp_path: Path) -> None:
    (tmp_path / "inferd.toml").write_text("[server]\ngrpc_max_concurrent_rpcs = 1\n")
    server = start_server(tmp_path, "--model", "sim", "--config", str(tmp_path / "inferd.toml"))
    try:
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            requests: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
            stream = stub.ModelStreamInfer(iter(requests.get, None), timeout=30)  # holds the one slot
            requests.put(sim_request(b"held"))
            assert next(stream).infer_response.model_name == "sim"  # the stream is running
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(sim_request(b"past"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            requests.put(None)  # the stream ends: its slot is free again
            assert list(stream) == []
            assert stub.ModelInfer(sim_request(b"after"), timeout=10).model_name == "sim"
    finally:
        server.stop()
