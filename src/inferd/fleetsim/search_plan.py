"""`inferd plan search`: the fleet a search workload needs, from a shard profile measured on shards of
realistic size (kinds/search/shard_profile.py; the bundled one is kinds/search/profiles/shards.json).

For each candidate shard size n (documents per shard; a geometric grid, kept where one shard fits a
host's memory) the arithmetic is (docs/search-capacity.md explains each step):

  n             <= max_extrapolation (10) x the largest profiled shard
  ef_search     = the smallest profiled ef whose recall@10 reaches the target at n (interpolated between the
                  profiled sizes; beyond them a + b ln n through the two largest)
  call CPU (ms) = per-call overhead (worker protocol, from the HTTP runs)
                  + lexical a + b n  (hybrid, lexical)  + dense a + b ln n at ef (hybrid, dense),
                  dense scaled by dim / profiled dim
  shard memory  = a + b n bytes (the profile's resident memory per document; 4 bytes a dimension more or
                  less when the wanted dim differs from the profiled one)
  shards        = ceil(docs / n)
  replicas      = max(2, ceil(qps x call CPU x (1 + headroom)))   a replica searches one query at a time on
                  one core, and every search visits every shard
  hosts         = ceil(shards x replicas / replicas per host) + front-end hosts, where replicas per host =
                  min(host cores, floor(host memory x fill / shard memory))
  front end     = qps x (base + per shard x shards) ms of CPU, x (1 + headroom)

and the plan is the candidate with the fewest hosts (ties: fewer shards), among those whose call CPU (the
shard call's service time: one thread) stays under `max_call_ms`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from inferd.config import ConfigError
from inferd.fleetsim.plan_schema import PlanReport, Resources
from inferd.kinds.search.shard_profile import SCHEMA as PROFILE_SCHEMA

BUNDLED = "shards.json"
GIB = 2**30


@dataclass(frozen=True)
class SearchTargets:
    docs: float
    qps: float
    dim: int = 384
    recall: float = 0.95
    mode: str = "hybrid"
    host_memory_gib: float = 512.0
    host_cores: int = 64
    fill: float = 0.7
    headroom: float = 0.3
    max_call_ms: float = 100.0
    docs_per_shard: int | None = None
    """Fix the shard size instead of choosing it."""
    ef_search: int | None = None
    """Fix ef_search (one the profile measured) instead of choosing it from the recall fit."""
    max_extrapolation: float = 10.0
    """Shards of at most this many times the largest profiled one are considered."""


@dataclass(frozen=True)
class ShardCosts:
    """The profile's fitted costs, as functions of the documents per shard."""

    profile: dict[str, Any]
    name: str

    @classmethod
    def from_profile(cls, profile: dict[str, Any], name: str) -> ShardCosts:
        if profile.get("schema") != PROFILE_SCHEMA:
            raise ConfigError(
                f"{name} is not a shard profile (schema {profile.get('schema')!r}, wanted {PROFILE_SCHEMA!r}): "
                "make one with `inferd bench-search --shard-profile --save-profile FILE`"
            )
        return cls(profile, name)

    @property
    def spec(self) -> dict[str, Any]:
        return self.profile["spec"]

    @property
    def efs(self) -> list[int]:
        return sorted(int(ef) for ef in self.profile["fit"]["dense"])

    @property
    def largest(self) -> int:
        return max(self.spec["sizes"])

    def lexical_ms(self, n: float) -> float:
        f = self.profile["fit"]["lexical_cpu_us"]
        return max(0.0, f["a"] + f["b_per_doc"] * n) / 1000

    def dense_ms(self, n: float, ef: int, dim: int) -> float:
        f = self.profile["fit"]["dense"][str(ef)]["cpu_us"]
        return max(0.0, f["a"] + f["b_per_ln_doc"] * math.log(n)) / 1000 * dim / self.spec["dim"]

    def recall(self, n: float, ef: int) -> float:
        """Recall@10 at n documents a shard: interpolated (in ln n) between the profiled sizes, and beyond
        the largest one the fit through the two largest, never above the largest's measurement (recall
        falls with n at a fixed ef on real data; on a mixture it can rise while its clusters fill)."""
        rows = sorted(self.profile["rows"], key=lambda r: r["docs"])
        measured = [float(r["dense"][str(ef)]["recall@10"]) for r in rows]
        if n <= rows[-1]["docs"]:
            return float(np.interp(math.log(n), [math.log(r["docs"]) for r in rows], measured))
        f = self.profile["fit"]["dense"][str(ef)]["recall@10"]
        return min(measured[-1], f["a"] + f["b_per_ln_doc"] * math.log(n))

    def bytes_per_doc(self, dim: int) -> float:
        """Measured at the profile's dim; a float32 vector more or less per dimension of difference."""
        return self.profile["fit"]["memory_bytes"]["b_per_doc"] + 4 * (dim - self.spec["dim"])

    def shard_bytes(self, n: float, dim: int) -> float:
        return self.profile["fit"]["memory_bytes"]["a"] + n * self.bytes_per_doc(dim)

    def http(self, key: str) -> float:
        return float(self.profile["http"][key])


@dataclass(frozen=True)
class Candidate:
    docs_per_shard: int
    ef_search: int
    recall: float
    call_ms: float
    lexical_ms: float
    dense_ms: float
    shard_gib: float
    shards: int
    replicas_per_shard: int
    replica_processes: int
    replicas_per_host: int
    replica_hosts: int
    frontend_cpu_ms: float
    frontend_cores: int
    frontend_hosts: int

    @property
    def hosts(self) -> int:
        return self.replica_hosts + self.frontend_hosts

    @property
    def cores(self) -> int:
        return self.replica_processes + self.frontend_cores

    @property
    def memory_gib(self) -> float:
        return self.replica_processes * self.shard_gib


@dataclass(frozen=True)
class SearchPlan:
    targets: SearchTargets
    chosen: Candidate
    considered: list[Candidate] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    profile: str = ""

    def report(self) -> PlanReport:
        c, t = self.chosen, self.targets
        return PlanReport(
            kind="search",
            inputs={"docs": t.docs, "qps": t.qps, "dim": t.dim, "recall": t.recall, "mode": t.mode},
            resources=Resources(
                devices=0,
                frontends=c.frontend_cores,
                processes=c.replica_processes + c.frontend_cores,
                cores=c.cores,
                memory_gib=round(c.memory_gib, 1),
            ),
            reasoning=self.reasoning,
            profile={"name": self.profile, "source": "measured: inferd bench-search --shard-profile"},
            details={
                "chosen": candidate_dict(c),
                "hosts": c.hosts,
                "considered": [candidate_dict(x) for x in self.considered],
                "targets": t.__dict__,
            },
        )


def candidate_dict(c: Candidate) -> dict[str, Any]:
    return c.__dict__ | {"hosts": c.hosts, "cores": c.cores, "memory_gib": round(c.memory_gib, 1)}


def candidate(costs: ShardCosts, t: SearchTargets, n: int) -> Candidate | None:
    """The fleet at n documents per shard; None when one shard does not fit a host."""
    ef = t.ef_search or next((ef for ef in costs.efs if costs.recall(n, ef) >= t.recall), costs.efs[-1])
    lexical = costs.lexical_ms(n) if t.mode in ("hybrid", "lexical") else 0.0
    dense = costs.dense_ms(n, ef, t.dim) if t.mode in ("hybrid", "dense") else 0.0
    call_ms = costs.http("call_overhead_cpu_ms") + lexical + dense
    shard_gib = costs.shard_bytes(n, t.dim) / GIB
    per_host = min(t.host_cores, math.floor(t.host_memory_gib * t.fill / shard_gib))
    if per_host < 1:
        return None
    shards = math.ceil(t.docs / n)
    replicas = max(2, math.ceil(t.qps * call_ms / 1000 * (1 + t.headroom)))
    frontend_ms = costs.http("frontend_cpu_ms_base") + costs.http("frontend_cpu_ms_per_shard") * shards
    frontend_cores = math.ceil(t.qps * frontend_ms / 1000 * (1 + t.headroom))
    return Candidate(
        n,
        ef,
        round(costs.recall(n, ef), 4),
        round(call_ms, 3),
        round(lexical, 3),
        round(dense, 3),
        round(shard_gib, 2),
        shards,
        replicas,
        shards * replicas,
        per_host,
        math.ceil(shards * replicas / per_host),
        round(frontend_ms, 3),
        frontend_cores,
        math.ceil(frontend_cores / t.host_cores),
    )


def sizes(t: SearchTargets, smallest: int, largest: int) -> list[int]:
    """Candidate documents per shard: ~8 a decade from `smallest` to the whole corpus or
    max_extrapolation x the largest profiled size, whichever is less."""
    if t.docs_per_shard is not None:
        return [t.docs_per_shard]
    top = max(smallest, min(int(t.docs), int(largest * t.max_extrapolation)))
    steps = int(math.log10(top / smallest) * 8) + 1
    return sorted({int(float(f"{smallest * 10 ** (i / 8):.2g}")) for i in range(steps)} | {top})


def plan_search(profile: dict[str, Any], targets: SearchTargets, profile_name: str = "") -> SearchPlan:
    costs = ShardCosts.from_profile(profile, profile_name)
    if targets.ef_search is not None and targets.ef_search not in costs.efs:
        raise ConfigError(f"ef_search {targets.ef_search} was not profiled; profiled: {costs.efs}")
    if targets.mode not in ("hybrid", "lexical", "dense"):
        raise ConfigError(f"mode must be hybrid, lexical or dense, not {targets.mode!r}")
    considered = [
        c
        for n in sizes(targets, min(costs.spec["sizes"]), costs.largest)
        if (c := candidate(costs, targets, n))
    ]
    fitting = [c for c in considered if c.call_ms <= targets.max_call_ms] or considered
    if not fitting:
        raise ConfigError(f"no shard of even {min(costs.spec['sizes']):,} documents fits a host's memory")
    chosen = min(fitting, key=lambda c: (c.hosts, c.shards))
    return SearchPlan(
        targets, chosen, considered, reasoning(costs, targets, chosen, considered), profile_name
    )


def reasoning(costs: ShardCosts, t: SearchTargets, c: Candidate, considered: list[Candidate]) -> list[str]:
    s, fit = costs.spec, costs.profile["fit"]
    lex, mem = fit["lexical_cpu_us"], fit["memory_bytes"]
    dense = fit["dense"][str(c.ef_search)]
    scale = c.docs_per_shard / costs.largest
    steps = [
        f"profile {costs.name}: shards of {', '.join(f'{n:,}' for n in s['sizes'])} synthetic documents built "
        f"in process ({costs.profile.get('measured_on', '?')}), dim {s['dim']}, HNSW m {s['hnsw_m']} / "
        f"ef_construction {s['ef_construction']}; fits: lexical {lex['a']:.0f} + {lex['b_per_doc'] * 1e3:.4f} "
        f"x docs/1000 us, memory {mem['a'] / 2**20:.0f} MiB + {mem['b_per_doc']:.0f} B x docs",
        f"shard size: {len(considered)} sizes tried, {considered[0].docs_per_shard:,} to "
        f"{considered[-1].docs_per_shard:,} documents; the fewest hosts (call CPU <= {t.max_call_ms:g} ms) at "
        f"{c.docs_per_shard:,} documents a shard"
        + (f" ({scale:.1f}x the largest profiled shard: an extrapolation)" if scale > 1.5 else ""),
        f"ef_search {c.ef_search}: recall@10 {dense['recall@10']['a']:.3f} + {dense['recall@10']['b_per_ln_doc']:.4f}"
        f" x ln({c.docs_per_shard:,}) = {c.recall} >= {t.recall}"
        if c.recall >= t.recall
        else f"ef_search {c.ef_search}: its fitted recall@10 {c.recall} misses {t.recall}",
        f"call CPU = {costs.http('call_overhead_cpu_ms')} ms overhead + {c.lexical_ms} ms lexical + {c.dense_ms} "
        f"ms dense (HNSW {dense['cpu_us']['a']:.0f} + {dense['cpu_us']['b_per_ln_doc']:.1f} x ln n us at dim "
        f"{s['dim']}, x {t.dim}/{s['dim']}) = {c.call_ms} ms ({t.mode})",
        f"shard memory = {mem['a'] / 2**20:.0f} MiB + {c.docs_per_shard:,} x {costs.bytes_per_doc(t.dim):.0f} B = "
        f"{c.shard_gib} GiB; shards = ceil({t.docs:g} / {c.docs_per_shard:,}) = {c.shards:,}",
        f"replicas/shard = max(2, ceil({t.qps:g} x {c.call_ms} ms x {1 + t.headroom:g})) = {c.replicas_per_shard:,}"
        f" (one core each; every search visits every shard); replica processes = {c.shards:,} x "
        f"{c.replicas_per_shard:,} = {c.replica_processes:,}",
        f"replicas/host = min({t.host_cores} cores, floor({t.host_memory_gib:g} GiB x {t.fill:g} / {c.shard_gib}"
        f" GiB)) = {c.replicas_per_host}; replica hosts = {c.replica_hosts:,}",
        f"front end = {costs.http('frontend_cpu_ms_base')} + {costs.http('frontend_cpu_ms_per_shard')} x "
        f"{c.shards:,} shards = {c.frontend_cpu_ms} ms CPU a search; cores = ceil({t.qps:g} x {c.frontend_cpu_ms}"
        f" ms x {1 + t.headroom:g}) = {c.frontend_cores:,}; hosts = {c.frontend_hosts:,}",
        f"total: {c.hosts:,} hosts of {t.host_cores} cores / {t.host_memory_gib:g} GiB, {c.cores:,} cores, "
        f"{c.memory_gib / 1024:,.1f} TiB of replica memory (one index copy per replica process)",
    ]
    if c.docs_per_shard > costs.largest:
        steps.insert(
            3,
            f"caution: recall was measured up to {costs.largest:,} documents; at {c.docs_per_shard:,} it is "
            "the fit's extrapolation (benchmarks/search_ann.py at 1M vectors, dim 128, M 16, needed ef_search "
            "128 for 0.956: docs/search.md); pass --ef-search to plan with a larger one",
        )
    return steps


def load_profile(path: Path | None) -> tuple[dict[str, Any], str]:
    """A saved shard profile, or the bundled one; (profile, name)."""
    if path is None:
        text = resources.files("inferd.kinds.search").joinpath("profiles", BUNDLED).read_text()
        return json.loads(text), f"bundled {BUNDLED}"
    try:
        return json.loads(Path(path).read_text()), str(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"shard profile {path}: {exc}") from None
