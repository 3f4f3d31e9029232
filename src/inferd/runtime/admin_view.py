"""A kind's view in the admin API: where its models' rows go in GET /admin/models and the keys its
model and worker rows add to the ones every kind has (api/admin.py). A view only adds keys: the
common ones, their names and nesting, are the admin API's."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from inferd.runtime.contract import RuntimeStatistics, WorkerSnapshot


def plain(value: Any) -> Any:
    """A snapshot (dataclasses, tuples, enums) as JSON-ready values."""
    if is_dataclass(value) and not isinstance(value, type):
        return {k: plain(v) for k, v in asdict(value).items()}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if hasattr(value, "value") and not isinstance(value, int | float | str):
        return value.value
    return value


def detail_row(stats: RuntimeStatistics) -> dict[str, Any]:
    """A model of a kind with no view of its own: ready, and its kind's detail as it is."""
    return {"ready": stats.ready, "detail": plain(stats.detail)}


def fleet_rows(every: Iterable[RuntimeStatistics]) -> dict[str, list[dict[str, Any]]]:
    """Each model's workers, every served version's, as each row of GET /admin/models shows them under
    `fleet`: worker id, zone, version and state, sorted by version then worker id. Workers join every
    front end of the server, and name themselves, so every front end shows the same fleet."""
    fleets: dict[str, list[dict[str, Any]]] = {}
    for stats in every:
        fleets.setdefault(stats.name, []).extend(
            {"worker_id": w.worker_id, "zone": w.zone, "version": w.version, "state": w.state} for w in stats.workers
        )
    return {name: sorted(rows, key=lambda r: (r["version"], r["worker_id"])) for name, rows in fleets.items()}


def no_keys(worker: WorkerSnapshot, now: float) -> dict[str, Any]:
    return {}


@dataclass(frozen=True, slots=True)
class AdminView:
    section: str = "other_models"
    """The key of GET /admin/models its models' rows go under."""
    model_row: Callable[[RuntimeStatistics], dict[str, Any]] = detail_row
    """The keys a model's row adds, from its runtime's snapshot. A kind that queues in each front end
    (`Kind.queues_per_frontend`) has "queued" and "busy_ratio", which the owner of several front ends
    replaces with the whole server's."""
    worker_row: Callable[[WorkerSnapshot, float], dict[str, Any]] = no_keys
    """The keys a worker's row in GET /admin/workers adds (`now` on the server's clock)."""
