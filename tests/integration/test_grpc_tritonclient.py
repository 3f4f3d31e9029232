"""tritonclient's gRPC client, sync and asyncio, against a real `inferd serve` (the sim and scale models
of examples/model_repo): the checks the REST suite makes, over Triton's GRPCInferenceService."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tc_aio
import tritonclient.http as tc_http
from tritonclient.utils import InferenceServerException

from inferd.models.sim import sim_digest
from tests.conftest import ROOT, ServerProc, start_server


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
