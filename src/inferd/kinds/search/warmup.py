"""A shard replica's warm-up: one query through the index's read paths (BM25 and, when the index holds
vectors, the HNSW graph), run when a replica has built or loaded a shard and before it answers the
assignment (kinds/search/replica.py). The writer marks a replica serving only on that answer, and readers
hear of the shard only after it, so no search reaches a replica before its warm-up ends, and the first
search does not pay for first touches (a loaded snapshot's pages, the graph's lazy parts).

`INFERD_SEARCH_WARMUP_MS` (a test hook, like sim's INFERD_SIM_SLOWDOWN): the warm-up of the replica
process it is set for takes at least that long, as a large index's would.
"""

from __future__ import annotations

import os
import time

import numpy as np

from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.types import ShardQuery

HOOK = "INFERD_SEARCH_WARMUP_MS"
QUERY_TEXT = "the index warms up"


def warm_up(index: ShardIndex) -> float:
    """Run the warm-up query on `index` (on the shard's thread); returns its seconds."""
    start = time.perf_counter()
    vector = np.zeros(index.settings.dim, dtype="<f4")
    vector[0] = 1.0  # a unit vector, as the index's vectors are
    index.search(ShardQuery(text=QUERY_TEXT, vector=vector.tobytes(), k=10, mode="hybrid"))
    least_s = float(os.environ.get(HOOK, "0") or 0) / 1000.0
    remaining = least_s - (time.perf_counter() - start)
    if remaining > 0:
        time.sleep(remaining)
    return time.perf_counter() - start
