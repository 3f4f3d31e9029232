"""The built-in `minilm` model against sentence-transformers reference vectors.

Needs the ONNX export (scripts/setup or scripts/setup-minilm run it); skipped only when it is missing.
tests/data/minilm_reference.json comes from `benchmarks/minilm_runtimes.py reference`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from inferd.models.minilm import MiniLMModel, minilm_config
from inferd.models.minilm_export import default_export_dir, is_exported

REFERENCE = json.loads((Path(__file__).parent.parent / "data" / "minilm_reference.json").read_text())
ITEMS = REFERENCE["items"]
EXPORT_DIR = default_export_dir(None)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def model() -> MiniLMModel:
    if not is_exported(EXPORT_DIR):
        pytest.skip(
            f"MiniLM ONNX export missing at {EXPORT_DIR}: run `scripts/setup-minilm .venv/bin/python` "
            "(or `python -m inferd.models.minilm_export`)"
        )
    m = MiniLMModel(minilm_config(params={"intra_op_threads": 2}))
    m.load()
    return m


def test_config_declares_the_outputs() -> None:
    config = minilm_config()
    assert config.implementation == "inferd.models.minilm:MiniLMModel"
    assert config.platform == "onnxruntime"
    assert [(t.name, t.datatype, t.shape) for t in config.inputs] == [("TEXT", "BYTES", ())]
    assert [(t.name, t.datatype, t.shape) for t in config.outputs] == [
        ("EMBEDDING", "FP32", (384,)),
        ("TOKENS", "INT32", ()),
        ("TRUNCATED", "BOOL", ()),
    ]
    assert minilm_config("m2", max_batch_size=8, params={"cache_dir": "/x"}).params["cache_dir"] == "/x"


def test_missing_export_says_how_to_make_it(tmp_path: Path) -> None:
    m = MiniLMModel(minilm_config(params={"model_dir": str(tmp_path / "nowhere")}))
    with pytest.raises(RuntimeError, match=r"scripts/setup.*inferd\.models\.minilm_export"):
        m.load()


@pytest.mark.parametrize("item", ITEMS, ids=[f"{i}:{it['text'][:20]!r}" for i, it in enumerate(ITEMS)])
def test_matches_sentence_transformers(model: MiniLMModel, item: dict) -> None:
    [out] = model.predict_batch([item["text"].encode()])
    emb = out["EMBEDDING"]
    assert emb.dtype == np.float32 and emb.shape == (384,)
    assert abs(float(np.linalg.norm(emb)) - 1.0) < 1e-5
    assert cosine(emb, item["embedding"]) >= 0.999
    assert out["TOKENS"] == item["tokens"]
    assert out["TRUNCATED"] is item["truncated"]


def test_batch_equals_single_items(model: MiniLMModel) -> None:
    texts = [it["text"].encode() for it in ITEMS]
    batch = model.predict_batch(texts)
    assert len(batch) == len(texts)
    for text, got in zip(texts, batch, strict=True):
        [single] = model.predict_batch([text])
        assert cosine(got["EMBEDDING"], single["EMBEDDING"]) >= 0.99999
        assert got["TOKENS"] == single["TOKENS"]
        assert got["TRUNCATED"] == single["TRUNCATED"]


def test_long_input_is_truncated_at_256(model: MiniLMModel) -> None:
    long_item = next(it for it in ITEMS if it["truncated"])
    short, long_, edge, over = model.predict_batch(
        [b"short", long_item["text"].encode(), b"word " * 254, b"word " * 255]
    )
    assert (long_["TOKENS"], long_["TRUNCATED"]) == (256, True)
    assert (short["TOKENS"], short["TRUNCATED"]) == (3, False)
    assert (edge["TOKENS"], edge["TRUNCATED"]) == (256, False)  # 254 words + [CLS] + [SEP] fit exactly
    assert (over["TOKENS"], over["TRUNCATED"]) == (256, True)


def test_invalid_utf8_names_the_item(model: MiniLMModel) -> None:
    with pytest.raises(ValueError, match=r"item 2: TEXT is not valid UTF-8"):
        model.predict_batch([b"fine", "caf\u00e9".encode(), b"bad \xff\xfe bytes"])


def test_warmup_and_empty_batch(model: MiniLMModel) -> None:
    warm = model.warmup_inputs()
    assert 1 <= len(warm) <= 4
    assert len(model.predict_batch(warm)) == len(warm)
    assert model.predict_batch([]) == []
