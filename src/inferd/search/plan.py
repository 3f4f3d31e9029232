"""`inferd plan search`: the fleet a search workload needs, from a saved bench-search profile.

The arithmetic (docs/search-capacity.md explains each step):
  bytes/doc   = dim x 4 (float32 vector) + hnsw_m x 2 x 4 (graph links at layer 0) + text_bytes (stored
                document and its postings, measured from the profile's index: a parameter here)
  docs/shard  = floor(shard_memory_bytes x fill / bytes/doc)
  shards      = ceil(docs / docs/shard)
  qps/replica = 1000 / the profile's p50 latency in ms (a replica runs one search at a time, and the
                p50 of an unsaturated run bounds its service time from above), scaled by how search cost grows with
                shard size: lexical ~ linear in postings, HNSW ~ log(docs): cost factor = (docs/shard /
                profiled docs/shard) ^ alpha, alpha = 0.5 by default (between the two)
  replicas    = ceil(qps / (qps/replica)) x (1 + headroom), at least 2 (one lost replica keeps serving)
  recall      = ef_search from the wanted recall (a table measured with HNSW at m = 32)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EF_FOR_RECALL = ((0.90, 64), (0.95, 128), (0.98, 256), (0.99, 512))
"""(recall@10 of HNSW against exact search, ef_search that reaches it) at m = 32, dim 384."""


@dataclass(frozen=True)
class Plan:
    docs: float
    qps: float
    dim: int
    recall: float
    ef_search: int
    bytes_per_doc: int
    docs_per_shard: int
    shards: int
    qps_per_replica: float
    replicas_per_shard: int
    replica_processes: int
    memory_tib: float
    profile: str

    def table(self) -> str:
        return "\n".join(f"{k:>20}: {v}" for k, v in asdict(self).items())


def plan_search(
    profile: dict[str, Any],
    docs: float,
    qps: float,
    dim: int,
    recall: float,
    shard_memory_gib: float = 64.0,
    fill: float = 0.7,
    text_bytes: int = 1024,
    hnsw_m: int = 32,
    alpha: float = 0.5,
    headroom: float = 0.3,
    profile_name: str = "",
) -> Plan:
    ef = next((ef for r, ef in EF_FOR_RECALL if r >= recall), EF_FOR_RECALL[-1][1])
    bytes_per_doc = dim * 4 + hnsw_m * 2 * 4 + text_bytes
    docs_per_shard = int(shard_memory_gib * 2**30 * fill // bytes_per_doc)
    shards = max(1, math.ceil(docs / docs_per_shard))
    state = profile.get("index_state", {})
    profiled_docs = max(1, state.get("documents", 1) / max(1, state.get("shards", 1)))
    p50_ms = float(profile.get("latency_ms", {}).get("p50", 0.0))
    if p50_ms <= 0:
        raise ValueError("the profile has no latency: run inferd bench-search --out PROFILE first")
    measured = 1000.0 / p50_ms  # a replica answers one query at a time: at most 1 / service time
    ef_factor = ef / max(1, state.get("settings", {}).get("ef_search", 128))
    per_replica = measured / ((docs_per_shard / profiled_docs) ** alpha) / ef_factor
    replicas = max(2, math.ceil(qps / per_replica * (1 + headroom)))
    return Plan(
        docs,
        qps,
        dim,
        recall,
        ef,
        bytes_per_doc,
        docs_per_shard,
        shards,
        round(per_replica, 3),
        replicas,
        shards * replicas,
        round(shards * replicas * shard_memory_gib / 1024, 1),
        profile_name,
    )


def load_profile(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
