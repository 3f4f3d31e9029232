"""The analyzer: lowercase `[a-z0-9]+` tokens, a stop list removed, no stemming.

This is the analyzer of the shared BM25 baselines (docs/search.md). The stop lists are the ones bm25s
ships: `en_plus` is NLTK's 179-word English list (bm25s.stopwords.STOPWORDS_EN_PLUS), `en` the 33-word
Lucene list; `none` keeps every token.
"""

from __future__ import annotations

import re
from functools import cache

from bm25s.stopwords import STOPWORDS_EN, STOPWORDS_EN_PLUS

_TOKEN = re.compile(r"[a-z0-9]+")
STOP_LISTS: dict[str, tuple[str, ...]] = {
    "en_plus": tuple(STOPWORDS_EN_PLUS),
    "en": tuple(STOPWORDS_EN),
    "none": (),
}


@cache
def stop_set(name: str) -> frozenset[str]:
    """The stop words of a named list; an unknown name is a ValueError that lists the known ones."""
    try:
        return frozenset(STOP_LISTS[name])
    except KeyError:
        raise ValueError(f"unknown stop list {name!r}; known: {sorted(STOP_LISTS)}") from None


def tokenize(text: str, stopwords: str = "en_plus") -> list[str]:
    """The index terms of `text`, in order, repeats kept."""
    stop = stop_set(stopwords)
    return [t for t in _TOKEN.findall(text.lower()) if t not in stop]


def document_text(title: str, text: str) -> str:
    """What a document indexes: its title and its text together."""
    return f"{title} {text}" if title else text
