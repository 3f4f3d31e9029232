"""minilm through the real server: the openai client (float and base64) and tritonclient, checked
against sentence-transformers reference vectors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import tritonclient.http as triton

from tests.conftest import ROOT, ServerProc, start_server

REFERENCE = json.loads((ROOT / "tests" / "data" / "minilm_reference.json").read_text())["items"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tmp_path_factory.mktemp("minilm"), "--model", "minilm", "--model", "sim")
    yield s
    assert s.stop() in (0, -15)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(np.dot(a, b) / (na * nb))


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_openai_client_embeddings_match_reference(server: ServerProc, encoding: str) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    texts = [item["text"] for item in REFERENCE]
    if encoding == "float":
        resp = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
    else:  # the openai client asks for base64 by default and decodes it itself
        resp = client.embeddings.create(model="minilm", input=texts)
    assert [d.index for d in resp.data] == list(range(len(texts)))
    for item, datum in zip(REFERENCE, resp.data, strict=True):
        assert cosine(np.asarray(datum.embedding), np.asarray(item["embedding"])) >= 0.999, item["text"][:40]
    assert resp.usage.prompt_tokens == sum(item["tokens"] for item in REFERENCE)
    truncated = sum(item["truncated"] for item in REFERENCE)
    assert truncated >= 1
    assert resp.usage.model_dump().get("truncated_inputs") == truncated


def test_concurrent_embedding_callers_are_batched_and_correct(server: ServerProc) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    texts = [item["text"] for item in REFERENCE[:8]]

    def one(i: int) -> tuple[int, list[float]]:
        text = texts[i % len(texts)]
        return i, client.embeddings.create(model="minilm", input=text, encoding_format="float").data[
            0
        ].embedding

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(48)))
    for i, emb in results:
        ref = REFERENCE[i % len(texts)]["embedding"]
        assert cosine(np.asarray(emb), np.asarray(ref)) >= 0.999


def test_tritonclient_bytes_to_minilm(server: ServerProc) -> None:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    inp = triton.InferInput("TEXT", [2], "BYTES")
    inp.set_data_from_numpy(
        np.array([REFERENCE[0]["text"].encode(), REFERENCE[1]["text"].encode()], dtype=object)
    )
    result = client.infer(
        "minilm", [inp], outputs=[triton.InferRequestedOutput("EMBEDDING", binary_data=True)]
    )
    emb = result.as_numpy("EMBEDDING")
    assert emb.shape == (2, 384)
    assert cosine(emb[1], np.asarray(REFERENCE[1]["embedding"])) >= 0.999
    client.close()


def test_embeddings_bad_input_is_an_openai_error(server: ServerProc) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="does not produce embeddings"):
        client.embeddings.create(model="sim", input="x")
    with pytest.raises(openai.NotFoundError, match="unknown model"):
        client.embeddings.create(model="nope", input="x")
    with pytest.raises(openai.BadRequestError, match="input is empty"):
        client.embeddings.create(model="minilm", input=[])
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="minilm", input="x", dimensions=12)
