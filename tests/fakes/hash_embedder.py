"""A tiny deterministic embedder for server tests of /v1/embeddings (no weights to load): each text's
vector is its SHA-256 digest's first 8 bytes, scaled to [0, 1)."""

from __future__ import annotations

import hashlib

import numpy as np

from inferd.models.base import Model

DIMS = 8


def embed(text: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(text).digest()[:DIMS], dtype=np.uint8).astype(np.float32) / 256


class HashEmbedder(Model):
    def predict_batch(self, inputs: list[bytes]) -> list[dict[str, object]]:
        return [{"EMBEDDING": embed(t), "TOKENS": len(t.split())} for t in inputs]
