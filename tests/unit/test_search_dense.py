"""DenseIndex: fresh buffer + HNSW graph, tombstones, filtered graph walks that still return k."""

from __future__ import annotations

import numpy as np

from inferd.kinds.search.dense import DenseIndex

DIM = 16


def unit_vectors(n: int, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def exact_top(vectors: np.ndarray, live: np.ndarray, q: np.ndarray, k: int) -> list[int]:
    scores = np.where(live, vectors @ q, -np.inf)
    return np.argsort(-scores, kind="stable")[:k].tolist()


def test_new_vectors_are_found_before_and_after_they_move_into_the_graph():
    vectors = unit_vectors(300)
    index = DenseIndex(DIM, fresh_limit=64)
    for slot, v in enumerate(vectors):
        index.add(slot, v)
        if slot in (10, 64, 299):
            slots, scores = index.search(v, 1)
            assert slots.tolist() == [slot] and abs(scores[0] - 1.0) < 1e-5
    assert index.statistics()["graph"] == 256 and index.statistics()["fresh"] == 44


def test_removed_vectors_never_come_back_and_a_rebuild_drops_them():
    vectors = unit_vectors(400, seed=1)
    index = DenseIndex(DIM, fresh_limit=50, rebuild_fraction=0.9)
    for slot, v in enumerate(vectors):
        index.add(slot, v)
    live = np.ones(400, dtype=bool)
    for slot in range(0, 400, 3):
        index.remove(slot)
        live[slot] = False
    q = vectors[3]
    found = index.search(q, 20)[0].tolist()
    assert not set(found) & set(range(0, 400, 3))
    assert len(set(found) & set(exact_top(vectors, live, q, 20))) >= 18
    index.rebuild()
    assert index.statistics() == {
        "live": int(live.sum()),
        "graph": int(live.sum()),
        "graph_dead": 0,
        "fresh": 0,
    }
    assert index.search(q, 20)[0].tolist() == found


def test_a_filtered_graph_walk_returns_k_matching_vectors():
    vectors = unit_vectors(2000, seed=2)
    index = DenseIndex(DIM, fresh_limit=4096, exact_limit=0)  # no exact shortcut: the graph walk filters
    for slot, v in enumerate(vectors):
        index.add(slot, v)
    index.flush()
    for every in (2, 50, 700):
        allowed = np.zeros(2000, dtype=bool)
        allowed[::every] = True
        want = min(10, int(allowed.sum()))
        slots, _ = index.search(vectors[1], 10, allowed)
        assert len(slots) == want and allowed[slots].all(), every


def test_slots_can_be_renumbered_without_touching_the_graph():
    vectors = unit_vectors(100, seed=3)
    index = DenseIndex(DIM, fresh_limit=40)
    for slot, v in enumerate(vectors):
        index.add(slot, v)
    for slot in range(50):
        index.remove(slot)
    new_slot = np.where(np.arange(100) >= 50, np.arange(100) - 50, -1)
    index.renumber(new_slot)
    slots, _ = index.search(vectors[70], 1)
    assert slots.tolist() == [20]


def test_state_round_trips():
    vectors = unit_vectors(120, seed=4)
    index = DenseIndex(DIM, fresh_limit=50)
    for slot, v in enumerate(vectors):
        index.add(slot, v)
    index.remove(7)
    copy = DenseIndex(DIM)
    copy.load_state(index.state())
    for q in vectors[:5]:
        assert copy.search(q, 10)[0].tolist() == index.search(q, 10)[0].tolist()
