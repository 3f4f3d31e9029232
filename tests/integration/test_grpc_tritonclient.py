"""tritonclient's gRPC client, sync and asyncio, against a real `inferd serve` (the sim and scale models
of examples/model_repo): the checks the REST suite makes, over Triton's GRPCInferenceService; and with
tenants configured, keys and quotas (a raw grpc stub reads the trailers). Two servers in all."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
import tritonclient.http as tc_http
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.utils import InferenceServerException

from inferd.gateway.keys import key_digest, new_key
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.protos import grpc_service_pb2_grpc as pb_grpc
from inferd.models.sim import sim_digest
from tests.conftest import ROOT, ServerProc, start_server

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
    s = start_server(tmp_path_factory.mktemp("grpc"), "--model-repo", str(ROOT / "examples" / "model_repo"))
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


def test_model_metadata_names_the_tensors_with_the_batch_dimension(client: tc.InferenceServerClient) -> None:
    meta = client.get_model_metadata("sim", as_json=True)
    assert meta["name"] == "sim"
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "BYTES", "shape": ["-1"]}]
    scale = client.get_model_metadata("scale", as_json=True)
    assert scale["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert [o["name"] for o in scale["outputs"]] == ["DOUBLED", "SUM"]


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
    assert {m["name"] for m in every} == {"sim", "scale"}


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


def test_the_repository_rpcs_are_unimplemented(client: tc.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.get_model_repository_index()
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"


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
