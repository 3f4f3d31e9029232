"""Fusion of hit lists and parsing of filters."""

from __future__ import annotations

import pytest

from inferd.kinds.search import fusion
from inferd.kinds.search.filters import parse_filter
from inferd.kinds.search.types import FieldCondition, InvalidFilter, ShardHit

FIELDS = {"lang": "keyword", "year": "int", "price": "float", "open": "bool"}


def hits(*pairs: tuple[str, float]) -> list[ShardHit]:
    return [ShardHit(id=i, score=s, title=f"t{i}") for i, s in pairs]


def test_merge_takes_the_best_k_across_shards_with_ties_to_the_lower_id():
    a = hits(("a", 3.0), ("c", 1.0))
    b = hits(("b", 3.0), ("d", 2.0), ("e", 0.5))
    assert [h.id for h in fusion.merge([a, b], 4)] == ["a", "b", "d", "c"]
    assert [h.id for h in fusion.merge([b, a], 4)] == ["a", "b", "d", "c"]
    assert [h.id for h in fusion.merge([hits(("x", 1.0)), hits(("x", 2.0))], 5)] == ["x"]
    assert fusion.merge([], 3) == []


def test_rrf_sums_weighted_reciprocal_ranks():
    lexical = hits(("a", 9.0), ("b", 8.0))
    dense = hits(("b", 0.9), ("c", 0.8))
    fused = fusion.rrf(lexical, dense, 3, rrf_k=60)
    assert [h.id for h in fused] == ["b", "a", "c"]
    assert fused[0].score == pytest.approx(1 / 62 + 1 / 61)
    only_dense = fusion.rrf(lexical, dense, 3, weights={"lexical": 0.0, "dense": 1.0})
    assert [h.id for h in only_dense][:2] == ["b", "c"]


def test_filters_parse_both_forms():
    parsed = parse_filter({"lang": "en", "year": {"in": [2001, 2002]}, "price": 3, "open": False}, FIELDS)
    assert parsed.conditions == (
        FieldCondition(field="lang", values=("en",)),
        FieldCondition(field="year", values=(2001, 2002)),
        FieldCondition(field="price", values=(3.0,)),
        FieldCondition(field="open", values=(False,)),
    )


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"colour": "red"}, "unknown field 'colour'"),
        ({"year": "2001"}, "'year' is int"),
        ({"year": True}, "'year' is int"),
        ({"open": 1}, "'open' is bool"),
        ({"lang": {"eq": "en"}}, '{"in": [values]}'),
        ({"lang": ["en"]}, "wrapped"),
        (["lang"], "must be an object"),
    ],
)
def test_bad_filters_name_the_problem(raw, words):
    with pytest.raises(InvalidFilter) as error:
        parse_filter(raw, FIELDS)
    assert words in error.value.message
