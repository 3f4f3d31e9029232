"""GET /admin/models rows' `fleet`: every served version's workers of the model, as every front end sees
them (worker id, zone, version, state), sorted by version then worker id."""

from __future__ import annotations

from types import SimpleNamespace

from inferd.runtime.admin_view import fleet_rows


def worker(worker_id: str, version: int, state: str = "ready", zone: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(worker_id=worker_id, version=version, state=state, zone=zone, model="sim")


def test_a_models_fleet_lists_every_versions_workers_sorted() -> None:
    v1 = SimpleNamespace(name="sim", version=1, workers=[worker("w-b", 1, "draining", "a"), worker("w-a", 1)])
    v2 = SimpleNamespace(name="sim", version=2, workers=[worker("w-c", 2, zone="b")])
    other = SimpleNamespace(name="echo", version=1, workers=[])
    fleets = fleet_rows([v2, other, v1])  # type: ignore[list-item]
    assert fleets == {
        "sim": [
            {"worker_id": "w-a", "zone": None, "version": 1, "state": "ready"},
            {"worker_id": "w-b", "zone": "a", "version": 1, "state": "draining"},
            {"worker_id": "w-c", "zone": "b", "version": 2, "state": "ready"},
        ],
        "echo": [],
    }
