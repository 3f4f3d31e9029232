"""Putting hit lists together: `merge` gathers one kind of list across shards by score, `rrf` fuses the
lexical and the dense list by reciprocal rank (scores of different kinds do not compare).

Ties go to the lower document id, so the order never depends on which shard answered first.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain

from inferd.kinds.search.types import ShardHit

DEFAULT_WEIGHTS: Mapping[str, float] = {"lexical": 1.0, "dense": 1.0}


def _order(hit: ShardHit) -> tuple[float, str]:
    return (-hit.score, hit.id)


def merge(lists: list[list[ShardHit]], k: int) -> list[ShardHit]:
    """The k best hits of several lists of one kind (one per shard), by score; an id seen twice (a document
    moving between shards during a reshard) keeps its best hit."""
    seen: set[str] = set()
    out: list[ShardHit] = []
    for hit in sorted(chain.from_iterable(lists), key=_order):  # one sort: cheaper than a k-way merge
        if hit.id in seen:
            continue
        seen.add(hit.id)
        out.append(hit)
        if len(out) == k:
            break
    return out


def rrf(
    lexical: list[ShardHit],
    dense: list[ShardHit],
    k: int,
    rrf_k: int = 60,
    weights: Mapping[str, float] = DEFAULT_WEIGHTS,
) -> list[ShardHit]:
    """Reciprocal rank fusion: score(d) = sum over lists of weight / (rrf_k + rank of d), rank from 1.
    The hits carry the fused score; the title comes from whichever list had the document."""
    if rrf_k < 0:
        raise ValueError(f"rrf_k must be >= 0, got {rrf_k}")
    scores: dict[str, float] = {}
    titles: dict[str, str] = {}
    for kind, hits in (("lexical", lexical), ("dense", dense)):
        weight = float(weights.get(kind, 1.0))
        for rank, hit in enumerate(hits, start=1):
            scores[hit.id] = scores.get(hit.id, 0.0) + weight / (rrf_k + rank)
            titles.setdefault(hit.id, hit.title)
    top = sorted(scores.items(), key=_by_score)[:k]  # hits made for the k kept only
    return [ShardHit(id=i, score=s, title=titles[i]) for i, s in top]


def _by_score(item: tuple[str, float]) -> tuple[float, str]:
    return (-item[1], item[0])
