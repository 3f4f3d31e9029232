"""The LLM kind's autoscaling demand (`Kind.autoscaling`, runtime/demand.py): its models scale on their
engines' pressure, KV use, time to first token and sequences waiting for admission. The recommendation
is a plain function of the observation; damping (windows, cooldowns, steps) is the Autoscaler's
(fleet/autoscaler.py), the same for every kind.

An LLM model's engine statistics are already the whole worker's (each engine reports its own totals to
every front end): the other front ends' loads add nothing, but while it has no ready worker, the
sequences they hold for one (kinds/llm/cold.py, in their reported loads: cluster/load.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from inferd.config.autoscaler import AutoscalerConfig
from inferd.runtime.contract import RuntimeStatistics
from inferd.runtime.demand import Autoscaling, Clamp, Observed, Recommendation
from inferd.runtime.frontend_load import FrontendLoads, ModelLoad


@dataclass(frozen=True, slots=True)
class LLMObservation:
    """An LLM model's fleet now: its engines' pressure, as the workers report it with every step."""

    ready_workers: int
    starting_workers: int
    running_seqs: int
    waiting_seqs: int
    """Waiting in the engines for admission, and held with no worker in service (kinds/llm/cold.py)."""
    kv_usage: float
    """Share of the ready workers' KV blocks in use, 0..1."""
    ttft_s: float | None
    """Recent time to first token (None: no token yet)."""

    def signals(self) -> dict[str, Any]:
        return {"running": self.running_seqs, "waiting": self.waiting_seqs, "kv_usage": round(self.kv_usage, 3)}


class LLMObserver:
    """An LLM model's observation: its engines' pressure, from its snapshot (nothing kept between looks)."""

    def observe(self, stats: RuntimeStatistics, starting: int, others: FrontendLoads | None) -> LLMObservation:
        d = stats.detail
        held = d.held
        if others is not None and stats.ready_workers == 0:  # no worker: what the others queue is held there
            held += others.total(ModelLoad(stats.name, stats.version)).queued_items
        return LLMObservation(
            ready_workers=stats.ready_workers,
            starting_workers=starting,
            running_seqs=d.running,
            waiting_seqs=d.waiting + held,
            kv_usage=d.kv_blocks_used / d.kv_blocks_total if d.kv_blocks_total else 0.0,
            ttft_s=d.ttft_s,
        )


class LLMDemand:
    """Grow when the engines are pressed (KV use over target, TTFT over target, or too many sequences
    waiting per worker), in proportion to the worst of them; shrink when one worker fewer would still
    sit below every target by scale_down_margin. With no sequence running, waiting or held, the recent
    TTFT is not load: an idle model scales down (to zero at `min_workers = 0`) after the down-window,
    not after the TTFT window (statistics.py TTFT_WINDOW_S) has forgotten its last first token."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config

    def recommend(self, obs: Observed, current: int, clamp: Clamp) -> Recommendation:
        if not isinstance(obs, LLMObservation):
            raise TypeError(f"LLM scaling needs an LLMObservation, got {type(obs).__name__}")
        cfg = self.config
        ready = obs.ready_workers
        busy = obs.running_seqs + obs.waiting_seqs > 0
        if ready == 0:
            need = 1 if busy else 0
            return Recommendation(clamp(max(need, current)), f"no ready worker; {obs.waiting_seqs} waiting")
        pressures = {
            f"KV use {obs.kv_usage:.2f} (target {cfg.target_kv_usage:.2f})": obs.kv_usage
            / cfg.target_kv_usage,
            f"{obs.waiting_seqs} waiting ({cfg.max_waiting_per_worker:g} per worker allowed)": obs.waiting_seqs
            / (cfg.max_waiting_per_worker * ready),
        }
        if obs.ttft_s is not None and busy:  # idle, past first tokens are no load (it may scale to zero)
            pressures[f"TTFT {obs.ttft_s:.2f} s (target {cfg.target_ttft_s:.2f} s)"] = (
                obs.ttft_s / cfg.target_ttft_s
            )
        source, worst = max(pressures.items(), key=lambda kv: kv[1])
        load = worst * ready
        need = max(1 if busy else 0, math.ceil(load - 1e-9))
        if need > current:
            return Recommendation(
                clamp(need), f"{source}: {load:.2f} workers of work; {need} keep it on target"
            )
        keep = max(need, math.ceil(load / (1.0 - cfg.scale_down_margin) - 1e-9))
        if keep < current:
            return Recommendation(clamp(keep), f"{source}: {keep} workers stay below target with margin")
        return Recommendation(clamp(current), f"{source}: within the hysteresis band at {current}")


LLM_AUTOSCALING = Autoscaling(LLMDemand, lambda clock: LLMObserver())
