"""The one JSON schema of `inferd plan ... --json` (plan llm, plan search): what to provision, what it
costs, why (the arithmetic, step by step), and how it was checked.

    {
      "schema": "inferd.plan/1",
      "kind": "llm" | "search",
      "inputs": {...},                  the workload and targets asked for
      "resources": {
        "devices": int,                 accelerators (0: none needed)
        "frontends": int,               front-end processes
        "processes": int,               every process: front ends, workers or replicas
        "cores": int | null,            CPU cores (null: the plan does not say)
        "memory_gib": float,            host memory
        "device_memory_gib": float      accelerator memory, summed
      },
      "cost": {"per_hour": float, "per_million_tokens": float | null, "note": str} | null,
      "reasoning": [str, ...],          each step of the arithmetic, in order
      "check": {...} | null,            a simulation of a slice of the plan, and whether the targets held;
                                        llm: {"simulated", "slice_devices", "slice_frontends",
                                        "shared_devices": bool (every device serves every front end of
                                        the slice; false: each front end its own), "seeds": int (runs
                                        per rate), "duration_s", "held", "headroom", "runs": [{
                                        "rate_per_device", "held", "ttft_p99_ms" and "itl_p99_ms" (the
                                        highest over its seeds), "slo_attainment" (the lowest),
                                        "rejected", "failed" and "unfinished" (summed), "per_seed": [{"seed", "held",
                                        figures}] (a rate stops at the first seed that misses)}]}
      "profile": {"name": str, "source": str},   where the per-device figures come from
      "details": {...},                 the kind's own intermediate numbers
      "zones": {...} | null             over how many zones the resources are, and what surviving the loss
                                        of one costs (null: the kind does not plan zones; search);
                                        llm (fleetsim/zone_plan.py): {"zones": int, "survives_zone_loss":
                                        bool, "devices_per_zone", "frontends_per_zone", "rps_per_zone",
                                        "rps_per_zone_one_lost" (null for 1 zone), "rate_per_device_all_up",
                                        "rate_per_device_one_lost", "no_loss_devices" and
                                        "no_loss_frontends" (the plan for no zone's loss), "headroom_devices",
                                        "headroom_frontends", "headroom_share" (of no_loss_devices),
                                        "headroom_cost_per_hour" (null unless priced)}
    }
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA = "inferd.plan/1"


@dataclass(frozen=True, slots=True)
class Resources:
    devices: int
    frontends: int
    processes: int
    cores: int | None
    memory_gib: float
    device_memory_gib: float = 0.0


@dataclass(frozen=True, slots=True)
class Cost:
    per_hour: float
    per_million_tokens: float | None
    note: str


@dataclass(frozen=True, slots=True)
class PlanReport:
    kind: str
    inputs: dict[str, Any]
    resources: Resources
    reasoning: list[str]
    profile: dict[str, str]
    details: dict[str, Any] = field(default_factory=dict)
    cost: Cost | None = None
    check: dict[str, Any] | None = None
    zones: dict[str, Any] | None = None
    schema: str = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def search_report(plan: Any) -> PlanReport:
    """`inferd plan search`'s plan (inferd.fleetsim.search_plan.SearchPlan) in the shared schema."""
    return plan.report()
