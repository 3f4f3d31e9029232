"""What the zone benchmarks (zone_loss.py, locality.py) share: one server of Z zones in network namespaces,
as the integration tests build them (tests/lan.py: a bridge, one namespace and address per host, nftables
cuts; tests/netns_cluster.py: the processes). Each zone is a front-end host (`inferd serve --zone zN
--workers 0`) and a worker host running W `sim` workers (`inferd worker --zone zN`, each joining every
front end); a Redis host holds the served state. The benchmark process is the machine itself: it reaches
every host over the bridge, as a zone's clients would.

The `sim` device runs one batch at a time, a batch of n costing `base_ms + per_item_ms x n`: a worker's
capacity is `max_batch / cost(max_batch)` answers per second (full batches), a zone's W times that.

Needs root, ip, nft and redis-server. Every process is stopped and every namespace removed at the end,
also after a failure or Ctrl-C (harness.interrupt_on)."""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import ROOT

sys.path.insert(0, str(ROOT))  # the network namespaces and processes are the integration tests' own

from tests.lan import Host, Lan
from tests.netns_cluster import (
    Cluster,
    FrontEnd,
    PacedLoad,
    Proc,
    connect_list,
    live,
    redis_proc,
    scrape,
    serve_argv,
    sim_model_toml,
    sim_repo,
    start_redis,
    wait_live,
    worker_argv,
    workers_of,
    zone_share,
)

__all__ = ["BY_ZONE", "SPILLED", "Device", "FrontEnd", "ZoneFleet", "by_zone", "counters", "delta", "live", "workers_of"]

BY_ZONE = "inferd_requests_by_zone_total"
SPILLED = "inferd_requests_spilled_by_zone_total"


@dataclass(frozen=True)
class Device:
    """The sim device every worker has."""

    base_ms: float = 40.0
    per_item_ms: float = 5.0
    max_batch: int = 8
    max_wait_ms: float = 2.0
    """The batching wait (a batch waits this long for company, and a zone's work this long before it may
    spill to another zone's idle worker: routing/locality.py)."""

    def capacity_rps(self) -> float:
        """One worker's answers per second with full batches."""
        return 1000.0 * self.max_batch / (self.base_ms + self.per_item_ms * self.max_batch)


class ZoneFleet:
    """`zones` zones of one front end and `workers` workers each, and a Redis host; a `with` block."""

    def __init__(self, zones: int, workers: int, device: Device, log_dir: Path, config: str = "") -> None:
        self.names = [f"z{i + 1}" for i in range(zones)]
        self.workers_per_zone = workers
        self.device = device
        self.log_dir = log_dir
        self.config = config
        self.lan = Lan()
        self.hosts: dict[str, tuple[Host, Host]] = {}
        self.cluster: Cluster | None = None
        self._running: contextlib.AbstractContextManager[None] | None = None

    def capacity_rps(self) -> float:
        """The fleet's answers per second with full batches on every worker."""
        return len(self.names) * self.workers_per_zone * self.device.capacity_rps()

    def __enter__(self) -> ZoneFleet:
        self.lan.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._running is not None:
                self._running.__exit__(None, None, None)
        finally:
            self.lan.close()

    def _start(self) -> None:
        root, d = self.log_dir, self.device
        for sub in ("repo", *(f"data-fe-{z}" for z in self.names)):  # a fresh start
            shutil.rmtree(root / sub, ignore_errors=True)
        sim_repo(root, sim_model_toml(10000, d.base_ms, d.max_batch, d.per_item_ms, d.max_wait_ms))
        (root / "inferd.toml").write_text(self.config)
        redis_host = self.lan.host("zredis")
        for z in self.names:
            self.hosts[z] = (self.lan.host(f"zfe-{z}"), self.lan.host(f"zwk-{z}"))
        front_ends = [
            FrontEnd(
                f"fe-{z}", fe_host,
                serve_argv(f"fe-{z}", fe_host.address, root, redis_host.address, "--zone", z,
                           "--config", str(root / "inferd.toml"), "--log-level", "WARNING"),
                root / f"fe-{z}.log", id=f"fe-{z}",
            )
            for z, (fe_host, _) in self.hosts.items()
        ]  # fmt: skip
        self.cluster = Cluster(root, redis_proc(redis_host, root), front_ends)
        self._running = self.cluster.running(log_tail=1500)
        self._running.__enter__()
        start_redis(self.cluster.redis)
        for fe in front_ends:
            fe.start()
        for fe in front_ends:
            wait_live(fe, 90)
        everyone = connect_list(front_ends)
        for z, (_, wk_host) in self.hosts.items():
            for i in range(self.workers_per_zone):
                wid = f"w-{z}-{i + 1}"
                argv = worker_argv(wid, everyone, "--zone", z, "--log-level", "WARNING")
                self.cluster.workers.append(Proc(wid, wk_host, argv, root / f"{wid}.log"))
        for w in self.cluster.workers:
            w.start()
        ids = {w.name for w in self.cluster.workers}
        deadline = time.monotonic() + 120
        while not all(set(workers_of(fe)) == ids for fe in front_ends):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every worker ready on every front end within 120 s: {ids}")
            time.sleep(0.2)
        # a front end whose own zone's workers joined after another zone's ramps its share up as work flows
        # (failback: a hold, then a ramp): light load until every front end keeps its work in its zone
        warm = [PacedLoad(fe.url, f"warm-{fe.id}", clients=1, max_requests=100_000, max_s=120, pace_s=0.05)
                for fe in front_ends]  # fmt: skip
        with contextlib.ExitStack() as stack:
            for load in warm:
                stack.enter_context(load)
            while not all(zone_share(fe).get(fe.id.removeprefix("fe-")) == 1.0 for fe in front_ends):
                if time.monotonic() > deadline + 60:
                    raise TimeoutError("not every front end keeping its work in its own zone within 180 s")
                time.sleep(0.2)

    # ---- the fleet --------------------------------------------------------------------------------------
    @property
    def front_ends(self) -> list[FrontEnd]:
        assert self.cluster is not None
        return self.cluster.front_ends

    def front_end(self, zone: str) -> FrontEnd:
        return self.front_ends[self.names.index(zone)]

    def workers_in(self, zone: str) -> set[str]:
        return {f"w-{zone}-{i + 1}" for i in range(self.workers_per_zone)}

    def cut(self, zone: str) -> None:
        """The zone's hosts lose every packet to and from everything else (they still reach each other)."""
        self.lan.cut_off(self.hosts[zone])

    def heal(self, zone: str) -> None:
        self.lan.heal(self.hosts[zone])

    def dropped(self, zone: str) -> int:
        return sum(h.dropped() for h in self.hosts[zone])

    def answers(self, fe: FrontEnd) -> bool:
        return live(fe)


def by_zone(fe: FrontEnd, name: str = BY_ZONE) -> dict[str, float] | None:
    """Work this front end sent to each zone's workers so far (None: it did not answer)."""
    found = counters(fe)
    return None if found is None else found[name]


def counters(fe: FrontEnd) -> dict[str, dict[str, float]] | None:
    """One scrape: the work sent to each zone (BY_ZONE), what of it spilled (SPILLED), and the items retried
    and batches failed ("retried", "failed": {"": total}); None when the front end did not answer."""
    try:
        samples = scrape(fe)
    except OSError:
        return None
    out: dict[str, dict[str, float]] = {BY_ZONE: {}, SPILLED: {}, "retried": {"": 0.0}, "failed": {"": 0.0}}
    totals = {"inferd_retried_items_total": "retried", "inferd_batch_failures_total": "failed"}
    for key, value in samples.items():
        name = key.split("{", 1)[0]
        if name in (BY_ZONE, SPILLED):
            zone = key.split('zone="', 1)[1].split('"', 1)[0]
            out[name][zone] = out[name].get(zone, 0.0) + value
        elif name in totals:
            out[totals[name]][""] += value
    return out


def delta(after: dict[str, float] | None, before: dict[str, float] | None) -> dict[str, float] | None:
    if after is None or before is None:
        return None
    return {z: after.get(z, 0.0) - before.get(z, 0.0) for z in sorted(set(after) | set(before))}
