"""Search quality of the index library on the shared judged collections (nDCG@10, Recall@100).

Each collection goes into 2 shards (a document's shard: crc32(id) % 2) through log entries of 100 upserts;
each query asks both shards for 100 hits per kind, `fusion.merge` gathers each kind and `fusion.rrf` fuses
them for hybrid. Dense vectors are all-MiniLM-L6-v2 embeddings (inferd.models.minilm, L2-normalised;
cached under --cache). Run from the repository root:

    PYTHONPATH=src python benchmarks/search_quality_lib.py [--lexical-only] [--collections cranfield,cisi,med]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import zlib
from pathlib import Path

import numpy as np

from inferd.kinds.search import fusion
from inferd.kinds.search.analyzer import document_text
from inferd.kinds.search.quality import Collection, evaluate, load_collection
from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.types import IndexSettings, LogEntry, ShardQuery, Upsert

ROOT = Path(__file__).resolve().parents[1]
# ../shared/data/ir beside the checkout (or the nearest ancestor's shared/, for a worktree)
DATA = next(
    (p / "shared" / "data" / "ir" for p in ROOT.parents if (p / "shared" / "data" / "ir").is_dir()), ROOT
)
BASELINES = {"cranfield": (0.351, 0.705), "cisi": (0.350, 0.428), "med": (0.665, 0.773)}
SHARDS = 2
DEPTH = 100


def embed(texts: list[str], cache: Path, tag: str) -> np.ndarray:
    """MiniLM embeddings of `texts`, cached per chunk of 256 (an interrupted run resumes). Texts are
    embedded in length order so a batch pads to similar lengths."""
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16]
    path = cache / f"{tag}-{digest}.npy"
    if path.exists():
        return np.load(path)
    from inferd.models.minilm import MiniLMModel, minilm_config

    model = MiniLMModel(minilm_config())
    model.load()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = np.zeros((len(texts), 384), dtype=np.float32)
    cache.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(order), 256):
        rows = order[start : start + 256]
        part = cache / f"{tag}-{digest}-part{start}.npy"
        if part.exists():
            out[rows] = np.load(part)
            continue
        chunk = [texts[i] for i in rows]
        vectors = np.concatenate([model.embed(chunk[j : j + 32])[0] for j in range(0, len(chunk), 32)])
        np.save(part, vectors)
        out[rows] = vectors
    np.save(path, out)
    return out


def build(collection: Collection, vectors: np.ndarray | None) -> list[ShardIndex]:
    settings = IndexSettings(shards=SHARDS)
    shards = [ShardIndex(settings) for _ in range(SHARDS)]
    pending: list[list[Upsert]] = [[] for _ in range(SHARDS)]
    for i, doc in enumerate(collection.docs):
        vector = vectors[i].astype("<f4").tobytes() if vectors is not None else None
        pending[zlib.crc32(doc.id.encode()) % SHARDS].append(Upsert(doc=doc, vector=vector))
    for shard, ops in zip(shards, pending, strict=True):
        for start in range(0, len(ops), 100):
            shard.apply(LogEntry(seq=shard.applied_seq + 1, ops=list(ops[start : start + 100])))
    return shards


def run(collection: Collection, shards: list[ShardIndex], qvecs: np.ndarray | None) -> dict[str, dict]:
    runs: dict[str, dict[str, list[str]]] = {"lexical": {}, "dense": {}, "hybrid": {}}
    latency = []
    for i, (qid, text) in enumerate(collection.queries.items()):
        vector = qvecs[i].astype("<f4").tobytes() if qvecs is not None else None
        mode = "hybrid" if vector is not None else "lexical"
        query = ShardQuery(text=text, vector=vector, k=DEPTH, mode=mode)
        started = time.perf_counter()
        results = [s.search(query) for s in shards]
        lexical = fusion.merge([r.lexical for r in results], DEPTH)
        dense = fusion.merge([r.dense for r in results], DEPTH)
        hybrid = fusion.rrf(lexical, dense, DEPTH)
        latency.append(time.perf_counter() - started)
        runs["lexical"][qid] = [h.id for h in lexical]
        runs["dense"][qid] = [h.id for h in dense]
        runs["hybrid"][qid] = [h.id for h in hybrid]
    out = {
        kind: evaluate(r, collection) for kind, r in runs.items() if qvecs is not None or kind == "lexical"
    }
    out["latency_ms_mean"] = 1000 * float(np.mean(latency))  # type: ignore[assignment]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--collections", default="cranfield,cisi,med")
    parser.add_argument("--lexical-only", action="store_true")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "inferd" / "search-quality")
    args = parser.parse_args()
    report = {}
    for name in args.collections.split(","):
        collection = load_collection(args.data / name)
        vectors = qvecs = None
        if not args.lexical_only:
            texts = [document_text(d.title, d.text) for d in collection.docs]
            vectors = embed(texts, args.cache, f"{name}-docs")
            qvecs = embed(list(collection.queries.values()), args.cache, f"{name}-queries")
        shards = build(collection, vectors)
        result = run(collection, shards, qvecs)
        result["baseline"] = dict(
            zip(("ndcg@10", "recall@100"), BASELINES.get(name, (None, None)), strict=True)
        )
        report[name] = result
        print(name, json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
