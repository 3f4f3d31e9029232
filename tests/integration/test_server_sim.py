"""The real server and worker processes over real HTTP, with the `sim` model at its defaults."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import tritonclient.http as triton

from inferd.models.sim import sim_digest
from tests.conftest import ROOT, ServerProc, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tmp_path_factory.mktemp("sim"), "--model-repo", str(ROOT / "examples" / "model_repo"))
    yield s
    assert s.stop() in (0, -15)  # uvicorn re-raises SIGTERM after a graceful drain


def infer_body(rid: str, texts: list[str]) -> dict:
    return {
        "id": rid,
        "inputs": [{"name": "INPUT0", "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
    }


async def test_concurrent_callers_each_get_their_own_result(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:

        async def call(i: int) -> tuple[dict, dict]:
            text = f"caller-{i}"
            async with http.post(f"{server.url}/v2/models/sim/infer", json=infer_body(f"r{i}", [text])) as r:
                assert r.status == 200, await r.text()
                return await r.json(), {k.lower(): v for k, v in r.headers.items()}

        replies = await asyncio.gather(*(call(i) for i in range(300)))
    sizes = []
    for i, (body, headers) in enumerate(replies):
        assert body["id"] == f"r{i}"
        assert body["outputs"][0]["data"] == [sim_digest("sim", 1, f"caller-{i}")]
        assert int(headers["x-inferd-attempts"]) == 1
        sizes.append(int(headers["x-inferd-batch-size"]))
        assert float(headers["x-inferd-compute-ms"]) >= 20.0
        assert body["parameters"]["batch_size"] == sizes[-1]
    assert max(sizes) > 10, f"300 concurrent callers should share batches, got sizes {sorted(set(sizes))}"
    assert max(sizes) <= 100


async def test_multi_row_request_keeps_row_order(server: ServerProc) -> None:
    texts = [f"row-{i}" for i in range(250)]  # more rows than one batch holds
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/v2/models/sim/infer", json=infer_body("multi", texts)) as r:
            assert r.status == 200
            body = await r.json()
    assert body["outputs"][0]["shape"] == [250]
    assert body["outputs"][0]["data"] == [sim_digest("sim", 1, t) for t in texts]


def test_tritonclient_json_and_binary_bytes(server: ServerProc) -> None:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("sim")
    meta = client.get_model_metadata("sim")
    assert meta["inputs"][0] == {"name": "INPUT0", "datatype": "BYTES", "shape": [-1]}
    data = np.array([b"alpha", b"beta", "gamma\u00e9".encode()], dtype=object)
    for binary in (False, True):
        inp = triton.InferInput("INPUT0", [3], "BYTES")
        inp.set_data_from_numpy(data, binary_data=binary)
        out = triton.InferRequestedOutput("OUTPUT0", binary_data=binary)
        result = client.infer("sim", [inp], outputs=[out], request_id=f"tc-{binary}")
        got = [x.decode() if isinstance(x, bytes) else x for x in result.as_numpy("OUTPUT0").tolist()]
        assert got == [sim_digest("sim", 1, x) for x in data]
        assert result.get_response()["id"] == f"tc-{binary}"
    client.close()


def test_tritonclient_fp32_user_model_binary_and_json(server: ServerProc) -> None:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for binary in (False, True):
        inp = triton.InferInput("INPUT0", [3, 4], "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        outs = [
            triton.InferRequestedOutput("DOUBLED", binary_data=binary),
            triton.InferRequestedOutput("SUM", binary_data=binary),
        ]
        result = client.infer("scale", [inp], outputs=outs)
        np.testing.assert_array_equal(result.as_numpy("DOUBLED"), x * 2)
        np.testing.assert_allclose(result.as_numpy("SUM"), x.sum(axis=1))
    # default outputs, all binary via the request-level parameter
    inp = triton.InferInput("INPUT0", [3, 4], "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    result = client.infer("scale", [inp])
    np.testing.assert_array_equal(result.as_numpy("DOUBLED"), x * 2)
    client.close()


async def test_metrics_exposes_batching_signals(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/v2/models/sim/infer", json=infer_body("m", ["x"])) as r:
            assert r.status == 200
        async with http.get(f"{server.url}/metrics") as r:
            text = await r.text()
    for name in (
        "inferd_queue_depth",
        "inferd_batch_size_bucket",
        "inferd_batch_fill_ratio_bucket",
        "inferd_device_busy_ratio",
        "inferd_queue_wait_seconds_bucket",
        "inferd_batch_compute_seconds_bucket",
        "inferd_request_duration_seconds_bucket",
        "inferd_requests_total",
        "inferd_workers",
        'inferd_worker_batches_total{model="sim",version="1",worker="sim-0"}',
        'inferd_queue_depth_by_priority{model="sim",priority="bulk",version="1"}',
    ):
        assert name in text, name
    ok = re.search(r'inferd_requests_total\{model="sim",outcome="ok",protocol="http",version="1"\} (\d+)', text)
    assert ok and int(float(ok.group(1))) >= 1


async def test_metadata_and_openapi(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/v2") as r:
            assert (await r.json())["extensions"] == ["binary_tensor_data", "model_repository", "schedule_policy"]
        async with http.post(f"{server.url}/v2/repository/index", json={}) as r:  # model_repository's route
            assert r.status == 200 and {row["name"] for row in await r.json()} >= {"sim"}
        async with http.get(f"{server.url}/v2/models/sim/versions/1/ready") as r:
            assert r.status == 200
        async with http.get(f"{server.url}/v2/models/sim/versions/7/ready") as r:
            assert r.status == 404
        async with http.get(f"{server.url}/openapi.json") as r:
            doc = await r.json()
        async with http.get(f"{server.url}/v1/models") as r:
            models = await r.json()
    assert doc["openapi"].startswith("3.1")
    assert "/v2/models/{model}/infer" in doc["paths"] and "/v1/embeddings" in doc["paths"]
    assert "/v1/chat/completions" in doc["paths"] and "ChatRequest" in doc["components"]["schemas"]
    assert {m["id"] for m in models["data"]} == {"scale", "sim"}


def test_repo_example_exists() -> None:
    assert (Path(ROOT) / "examples" / "model_repo" / "scale" / "1" / "model.py").is_file()
