"""`inferd plan llm`: the devices, front ends, cores, memory and cost an LLM workload needs, from one
device's profile (fleetsim/llm_profile.py), checked by simulating a slice of the plan token by token.

The arithmetic (docs/capacity.md explains each step). Per device, at r requests/s with prompts of P
tokens and outputs of O, a profile step_s = a + b x tokens + c x context, and continuous batching:
  - each request costs the device b x (P + O) of token work and c x (P + O x (P + O/2)) of context
    (its prefill attends over P, each of its O decodes over P + O/2 on average), so
    k = b (P + O) + c (P + O (P + O/2)) seconds per request beyond the steps' base;
  - steps are back to back, so the mean step s = a + r k s, i.e. s = a / (1 - r k), finite below r = 1/k;
  - Little's law: B = r O s sequences decode at once (<= max_num_seqs; B (P + O) tokens of KV <= the
    pool);
  - a token's gap is one step; the p99 step holds j99 new prompts (j99: the 99th percentile of a Poisson
    count of mean r s arrivals per step; prefill is capped at max_num_batched_tokens per step):
    ITL p99 ~ s99 = a + b (B + j99 P) + c (B (P + O/2) + j99 P);
  - TTFT p99 ~ 2 s99 + overhead + front-end CPU (wait for the step in progress, then the prefill step);
  - r is the largest rate with ITL p99 and TTFT p99 within the SLO, B and KV within the engine's budgets,
    and r <= max_utilisation / k (headroom for bursts);
  - then the simulation of a slice (CheckSlice): `slice_devices` devices at r each behind the plan's
    front ends per device (at least 2 where the plan has several), each device shared by every front
    end of the slice as the plan deploys them (or, partitioned, each front end's own), run with
    CHECK_SEEDS seeds: unless every seed's p99s are within 95% of the targets (CHECK_HEADROOM) with
    nothing refused or failed, r drops by 10% and the slice runs again (at most 4 rates).
Fleet: devices = ceil(rps / r); front ends = ceil(rps / (frontend_utilisation / cpu per request)) + 1
(cpu per request = frontend_s + P x frontend_prompt_token_s + O x frontend_token_s; the spare
survives the loss of one). Over N zones (--zones), each zone sized so that N - 1 carry the load
(fleetsim/zone_plan.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from inferd.fleetsim.llm_fleet import LLMFleetSpec, simulate_llm
from inferd.fleetsim.llm_profile import LLMProfile, poisson_quantile
from inferd.fleetsim.llm_report import LLMSimReport
from inferd.fleetsim.plan_schema import Cost, PlanReport, Resources
from inferd.fleetsim.zone_plan import ZoneSizing, size_zones, zone_step

ADJUST = 0.9
CHECK_HEADROOM = 0.95
"""The slice's p99s must come within this share of the targets: they move by a few % with the seed and
the routing's rendezvous scores (a 4-device slice at 28.7 req/s gave ITL p99s of 102.3 and 100.0 ms
against a 100 ms target with two sets of scores), and a plan should not rest on that noise."""
MAX_TRIES = 4
CHECK_SEEDS = 3
"""Runs of the slice at each rate, seeds 0, 1, 2 (arrivals and step noise): one seed's p99s moved by
a few % and its attainment by up to 12 points with the seed (docs/fleet-sim.md), so a rate holds only
if every seed holds, and the check reports the worst."""


@dataclass(frozen=True, slots=True)
class LLMTargets:
    rps: float
    prompt_tokens: int
    output_tokens: int
    ttft_p99_ms: float
    itl_p99_ms: float
    device_cost_per_hour: float | None = None
    max_utilisation: float = 0.85
    """Of a device's saturation rate 1/k."""
    frontend_utilisation: float = 0.7
    """Of a front end's CPU."""
    cores_per_device: int = 2
    """Host cores per device's worker process (its engine loop and device thread)."""
    frontend_memory_gib: float = 1.0


@dataclass(frozen=True, slots=True)
class DeviceAt:
    """One device's figures at `rate` requests/s."""

    rate: float
    k_s: float
    step_s: float
    decoding: float
    kv_tokens: float
    j99: int
    step99_s: float
    itl_p99_ms: float
    ttft_p99_ms: float


def device_at(profile: LLMProfile, t: LLMTargets, rate: float) -> DeviceAt:
    P, O = t.prompt_tokens, t.output_tokens  # noqa: E741  # the docstring's names
    a, b, c = profile.step_base_s, profile.per_token_s, profile.per_context_token_s
    k = b * (P + O) + c * (P + O * (P + O / 2))
    load = rate * k
    step = a / (1 - load) if load < 1 else math.inf
    decoding = rate * O * step
    budget = int(profile.scheduler.get("max_num_batched_tokens", 2048))
    j99 = poisson_quantile(rate * step, 0.99) if math.isfinite(step) else 0
    prefill = min(j99 * P, max(0.0, budget - decoding))
    step99 = a + b * (decoding + prefill) + c * (decoding * (P + O / 2) + prefill)
    ttft = 2 * step99 + profile.overhead_s + profile.frontend_s
    return DeviceAt(rate, k, step, decoding, decoding * (P + O), j99, step99, 1000 * step99, 1000 * ttft)


def fits(profile: LLMProfile, t: LLMTargets, d: DeviceAt) -> str | None:
    """None when the device meets every target at d.rate, else the first one it misses."""
    if d.rate * d.k_s > t.max_utilisation:
        return f"utilisation {d.rate * d.k_s:.2f} > {t.max_utilisation}"
    if d.decoding > int(profile.scheduler.get("max_num_seqs", 128)):
        return "max_num_seqs"
    if d.kv_tokens > profile.kv_tokens():
        return "KV cache"
    if d.itl_p99_ms > t.itl_p99_ms:
        return "ITL p99"
    if d.ttft_p99_ms > t.ttft_p99_ms:
        return "TTFT p99"
    return None


def max_rate(profile: LLMProfile, t: LLMTargets) -> tuple[DeviceAt, str]:
    """The largest per-device rate that fits (bisection), and the target that binds just above it."""
    lo, hi = 0.0, 1.0 / device_at(profile, t, 0.0).k_s
    for _ in range(60):
        mid = (lo + hi) / 2
        if fits(profile, t, device_at(profile, t, mid)) is None:
            lo = mid
        else:
            hi = mid
    binding = fits(profile, t, device_at(profile, t, hi)) or "none"
    return device_at(profile, t, lo), binding


@dataclass(frozen=True, slots=True)
class CheckSlice:
    """The part of the fleet the check simulates: `devices` devices behind `frontends` front ends, each
    device serving every front end (`shared`) or only its own (device d is front end d % frontends'),
    `seeds` runs of `duration_s` virtual seconds (arrivals and step noise from seeds 0, 1, ...)."""

    devices: int = 4
    frontends: int = 1
    shared: bool = True
    seeds: int = CHECK_SEEDS
    duration_s: float = 40.0


def slice_frontends(slice_devices: int, frontends: int, devices: int) -> int:
    """The plan's front ends per device scaled to the slice, rounded, but at least 2 where the plan has
    several (so the slice's devices are shared by, or split among, more than one) and at most one per
    device (a partitioned front end needs a device of its own)."""
    scaled = round(slice_devices * frontends / max(1, devices))
    return max(1, min(slice_devices, frontends, max(2, scaled)))


def simulate_slice(
    profile: LLMProfile, t: LLMTargets, rate: float, s: CheckSlice, seed: int = 0
) -> LLMSimReport:
    """The slice at `rate` requests/s per device, Poisson, fixed lengths, arrivals round-robin over
    its front ends."""
    rng = np.random.default_rng(seed)
    total = rate * s.devices
    gaps = rng.exponential(1.0 / total, int(total * s.duration_s * 1.2) + 16)
    times = np.cumsum(gaps)
    times = times[times < s.duration_s]
    n = times.size
    warmup = min(10.0, s.duration_s / 4)
    spec = LLMFleetSpec(
        profile, s.devices, times, np.full(n, t.prompt_tokens), np.full(n, t.output_tokens),
        frontends=s.frontends, warmup_s=warmup, slo={"ttft_ms": t.ttft_p99_ms, "itl_ms": t.itl_p99_ms},
        seed=seed, shared_devices=s.shared,
    )  # fmt: skip
    return simulate_llm(spec)


def holds(t: LLMTargets, r: LLMSimReport) -> bool:
    return (
        r.ttft_p99_ms is not None
        and r.itl_p99_ms is not None
        and r.ttft_p99_ms <= CHECK_HEADROOM * t.ttft_p99_ms
        and r.itl_p99_ms <= CHECK_HEADROOM * t.itl_p99_ms
        and r.rejected == 0
        and r.failed == 0
        and r.unfinished == 0
    )


def check_rate(profile: LLMProfile, t: LLMTargets, rate: float, s: CheckSlice) -> dict:
    """One rate, seed after seed: held only if every seed holds (the first that misses ends it). The
    run's figures are the worst over the seeds run: the highest p99s, the lowest attainment."""
    seeds = []
    for seed in range(s.seeds):
        sim = simulate_slice(profile, t, rate, s, seed)
        seeds.append({"seed": seed, "held": holds(t, sim), **_sim_fields(sim)})
        if not seeds[-1]["held"]:
            break
    return {
        "rate_per_device": round(rate, 3),
        "held": all(r["held"] for r in seeds),
        "ttft_p99_ms": _worst(max, [r["ttft_p99_ms"] for r in seeds]),
        "itl_p99_ms": _worst(max, [r["itl_p99_ms"] for r in seeds]),
        "slo_attainment": _worst(min, [r["slo_attainment"] for r in seeds]),
        "rejected": sum(r["rejected"] for r in seeds),
        "failed": sum(r["failed"] for r in seeds),
        "unfinished": sum(r["unfinished"] for r in seeds),
        "per_seed": seeds,
    }


def _worst(pick: Callable[[list[float]], float], values: list[float | None]) -> float | None:
    """None when a seed measured nothing (no request in its window)."""
    known = [v for v in values if v is not None]
    return pick(known) if len(known) == len(values) else None


def checked_rate(profile: LLMProfile, t: LLMTargets, d: DeviceAt, s: CheckSlice) -> tuple[DeviceAt, dict]:
    """Simulate the slice at d.rate; lower the rate by 10% until the SLOs hold (at most MAX_TRIES rates)."""
    runs = []
    for tried in range(1, MAX_TRIES + 1):
        runs.append(check_rate(profile, t, d.rate, s))
        if runs[-1]["held"] or tried == MAX_TRIES:  # the plan is sized on a rate simulated, held or not
            break
        d = device_at(profile, t, d.rate * ADJUST)
    return d, {
        "simulated": True,
        "slice_devices": s.devices,
        "slice_frontends": s.frontends,
        "shared_devices": s.shared,
        "seeds": s.seeds,
        "duration_s": s.duration_s,
        "held": runs[-1]["held"],
        "headroom": CHECK_HEADROOM,
        "runs": runs,
    }


def _sim_fields(sim: LLMSimReport) -> dict:
    keys = ("throughput_rps", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
            "itl_p99_ms", "slo_attainment", "requests", "rejected", "failed", "unfinished",
            "mean_step_ms")  # fmt: skip
    return {k: getattr(sim, k) for k in keys}


def plan_llm(
    profile: LLMProfile,
    t: LLMTargets,
    check: bool = True,
    slice_devices: int = 4,
    duration_s: float = 40.0,
    shared_devices: bool = True,
    seeds: int = CHECK_SEEDS,
    zones: int = 1,
) -> PlanReport:
    """`shared_devices`: the deployment planned (and simulated by the check): every worker joins every
    front end; False: each front end has its own devices. `zones`: over how many zones, each sized so
    that the others carry the load when it is lost (1: no zone's loss planned for)."""
    if check and (seeds < 1 or slice_devices < 1):
        raise ValueError("the check needs at least one seed and one device")
    if zones < 1:
        raise ValueError(f"zones must be at least 1, not {zones}")
    analytic, binding = max_rate(profile, t)
    if analytic.rate <= 0:
        raise ValueError(f"one device cannot meet the targets at any rate (binding: {binding})")
    fe_cpu = profile.frontend_cpu_s(t.prompt_tokens, t.output_tokens)
    fe_rps = t.frontend_utilisation / fe_cpu
    frontends = math.ceil(t.rps / fe_rps) + 1
    d, sim = analytic, None
    if check:
        fe_slice = slice_frontends(slice_devices, frontends, math.ceil(t.rps / analytic.rate))
        s = CheckSlice(slice_devices, fe_slice, shared_devices, seeds, duration_s)
        d, sim = checked_rate(profile, t, analytic, s)
    z = size_zones(t.rps, d.rate, fe_rps, zones, shared_devices)
    devices, frontends = z.devices, z.frontends
    cores = frontends + devices * t.cores_per_device
    memory = frontends * t.frontend_memory_gib + devices * profile.host_memory_gib
    out_tps = t.rps * t.output_tokens
    cost = None
    if t.device_cost_per_hour:
        per_hour = devices * t.device_cost_per_hour
        cost = Cost(
            round(per_hour, 2),
            round(per_hour / (out_tps * 3600) * 1e6, 4),
            "devices only, per million output tokens; front-end cores and memory not priced",
        )
    deployment = _deployment(t.rps, d.rate, z.no_loss_devices, z.no_loss_frontends, shared_devices)
    reasoning = _reasoning(profile, t, analytic, binding, d, z, fe_cpu, fe_rps, cores, memory, cost, sim)
    reasoning[-2:-2] = [deployment, zone_step(z, t.device_cost_per_hour)]  # after the front ends
    return PlanReport(
        kind="llm",
        inputs={
            "rps": t.rps,
            "prompt_tokens": t.prompt_tokens,
            "output_tokens": t.output_tokens,
            "ttft_p99_ms": t.ttft_p99_ms,
            "itl_p99_ms": t.itl_p99_ms,
            "device_cost_per_hour": t.device_cost_per_hour,
            "zones": zones,
        },
        resources=Resources(
            devices,
            frontends,
            frontends + devices,
            cores,
            round(memory, 1),
            round(devices * profile.device_memory_gib, 1),
        ),
        reasoning=reasoning,
        profile={"name": profile.name, "source": profile.source},
        details={
            "rate_per_device": round(d.rate, 3),
            "analytic_rate_per_device": round(analytic.rate, 3),
            "binding_target": binding,
            "mean_step_ms": round(1000 * d.step_s, 3),
            "decoding_per_device": round(d.decoding, 1),
            "itl_p99_ms_estimate": round(d.itl_p99_ms, 2),
            "ttft_p99_ms_estimate": round(d.ttft_p99_ms, 2),
            "output_tokens_per_s": out_tps,
            "output_tokens_per_s_per_device": round(d.rate * t.output_tokens, 1),
            "frontend_rps_each": round(fe_rps, 1),
            "shared_devices": shared_devices,
        },
        cost=cost,
        check=sim,
        zones=z.to_dict(t.device_cost_per_hour),
    )


def _reasoning(
    profile: LLMProfile, t: LLMTargets, analytic: DeviceAt, binding: str, d: DeviceAt, z: ZoneSizing,
    fe_cpu: float, fe_rps: float, cores: int, memory: float, cost: Cost | None, sim: dict | None,
) -> list[str]:  # fmt: skip
    """The devices and front-end steps say the plan for no zone's loss; the zones' step (inserted after
    them) the fleet over the zones, which the cores, memory and cost steps count."""
    devices, frontends = z.no_loss_devices, z.no_loss_frontends
    P, O = t.prompt_tokens, t.output_tokens  # noqa: E741  # the docstring's names
    a, b, c = profile.step_base_s, profile.per_token_s, profile.per_context_token_s
    steps = [
        f"profile {profile.name}: step_s = {a * 1000:.3f} ms + {b * 1e6:.3f} us x tokens + "
        f"{c * 1e9:.2f} ns x context tokens ({profile.source.split(':')[0]})",
        f"k = b (P + O) + c (P + O (P + O/2)) = {b * 1e6:.3f}us x {P + O} + {c * 1e9:.2f}ns x "
        f"{P + O * (P + O / 2):,.0f} = {analytic.k_s * 1000:.3f} ms of device time per request; "
        f"saturation 1/k = {1 / analytic.k_s:.1f} req/s per device",
        f"largest rate meeting every target: r = {analytic.rate:.2f} req/s per device (next binding: "
        f"{binding}); there the mean step s = a / (1 - r k) = {analytic.step_s * 1000:.2f} ms, "
        f"B = r O s = {analytic.decoding:.1f} decoding sequences, j99 = {analytic.j99} prompts in the p99 step, "
        f"ITL p99 ~ {analytic.itl_p99_ms:.1f} ms (<= {t.itl_p99_ms:g}), TTFT p99 ~ {analytic.ttft_p99_ms:.1f} ms "
        f"(<= {t.ttft_p99_ms:g})",
    ]
    if sim is None:
        steps.append("not checked by simulation (--no-check): the rate is the arithmetic's alone")
    else:
        what = (
            f"the simulated slice ({sim['slice_devices']} devices "
            f"{'shared by' if sim['shared_devices'] else 'split among'} {sim['slice_frontends']} front "
            f"end(s), {sim['seeds']} seed(s))"
        )
        steps.append(
            f"{what} missed an SLO at that rate: lowered to r = {d.rate:.2f} req/s per device"
            if d.rate != analytic.rate
            else f"{what} met the SLOs at that rate"
        )
    steps += [
        f"devices = ceil({t.rps:g} / {d.rate:.2f}) = {math.ceil(t.rps / d.rate):,}"
        + (
            ""
            if devices == math.ceil(t.rps / d.rate)
            else f", {frontends} front ends x {devices // frontends} "
            f"for an even split (partitioned) = {devices:,}"
        )
        + f" ({t.rps * O / devices:,.0f} output tokens/s each, {t.rps * O:,.0f} in all)",
        f"front-end CPU per request = {profile.frontend_s * 1e6:.1f} us + {P} x "
        f"{profile.frontend_prompt_token_s * 1e6:.2f} us per prompt token + {O} x "
        f"{profile.frontend_token_s * 1e6:.2f} us per streamed token = {fe_cpu * 1e6:.1f} us; at "
        f"{t.frontend_utilisation:.0%} CPU one front end takes {fe_rps:,.0f} req/s; "
        f"front ends = ceil({t.rps:g} / {fe_rps:,.0f}) + 1 spare = {frontends}",
        f"cores = {z.frontends} front ends x 1 + {z.devices:,} devices x {t.cores_per_device} = {cores:,}; "
        f"host memory = {z.frontends} x {t.frontend_memory_gib:g} GiB + {z.devices:,} x "
        f"{profile.host_memory_gib:g} GiB = {memory:,.0f} GiB",
    ]
    if cost is not None:
        steps.append(
            f"cost = {z.devices:,} x {t.device_cost_per_hour:g}/h = {cost.per_hour:,.2f}/h; per million output "
            f"tokens = {cost.per_hour:,.2f} / ({t.rps * O:,.0f} x 3600) x 1e6 = {cost.per_million_tokens}"
        )
    else:
        steps.append("cost: pass --device-cost-per-hour to price the plan")
    return steps


def _deployment(rps: float, rate: float, devices: int, frontends: int, shared: bool) -> str:
    """The deployment the plan assumes, and what partitioning the devices unevenly would do."""
    if shared:
        return (
            "deployment: every worker joins every front end (`inferd worker --connect` listing them all, "
            "as the local workers of `inferd serve --frontends N` do), so each device takes its share of "
            "every front end's requests whatever the ratio, and losing a front end loses no device"
        )
    need = math.ceil(rps / rate)
    return (
        f"deployment (partitioned): each front end has its own {devices // frontends:,} device(s), an even "
        f"split at {rps / devices:.2f} req/s each (<= r): {devices - need:,} more than the {need:,} shared "
        "devices would need (--shared-devices), and a front end lost takes its devices with it"
    )
