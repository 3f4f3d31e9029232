"""One server on many hosts, with real processes in network namespaces (tests/lan.py): three front-end
hosts, two worker hosts and a Redis host on one bridge, each host its own address. The front ends share
their served state in the Redis host's redis-server (`--store redis://...`) and take no local workers
(`--workers 0`); the workers join them over TCP: one through a comma list of all three, one through a
DNS name (`--connect dns:routers:9000`) that resolves, inside its host, to the first two front ends
only (`Host.resolve`: /etc/netns/<ns>/hosts, read by getaddrinfo).

One topology for the module, built once; the scenarios run on it in order:
  1. SIGKILL of a front end under load: the clients of the other two get every answer, once, their own;
     the killed one's clients get only answers that are theirs; the front end started again takes
     workers and requests;
  2. Redis stopped for 10 s and started again (empty: no persistence): every front end goes on
     answering, shows `inferd_cluster_store_up 0`, and refuses changes with 503 naming the store; once
     Redis answers, each shows 1, a reload reaches all three, one holds the lease again, and an update
     asked of any front end is carried out and seen the same on all three;
  3. the name is changed to add the third front end: the DNS worker joins it, with its zone.

Every load is capped in count and time, every wait bounded; every process is stopped and every
namespace removed at the end, also after a failure."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from inferd.cluster.redis_store import RedisStore
from inferd.cluster.served import SERVED, ModelServed, ServedState, serving_reports
from tests.checked_load import Load, assert_exactly_once, infer, tally, wait_answers, wait_for
from tests.lan import Lan
from tests.netns_cluster import (
    REDIS_PORT,
    WORKER_PORT,
    Cluster,
    FrontEnd,
    PacedLoad,
    Proc,
    connect_list,
    get_json,
    metric_total,
    post,
    redis_answers,
    redis_proc,
    scrape,
    serve_argv,
    sim_model_toml,
    sim_repo,
    start_redis,
    wait_live,
    worker_argv,
    workers_of,
)

NAME = "routers"


def holds(fe: FrontEnd) -> bool:
    return scrape(fe).get("inferd_cluster_lease_holder") == 1.0


def store_up(fe: FrontEnd) -> float | None:
    return scrape(fe).get("inferd_cluster_store_up")


def served_state(fe: FrontEnd) -> dict:
    """What /admin/models says this front end serves: per model row, its version and whether default."""
    page = get_json(f"{fe.admin_url}/admin/models")
    return {key: (row["version"], row["default"]) for key, row in page["models"].items()}


def in_store(address: str) -> tuple[ServedState, dict[str, tuple[dict, int]]]:
    """What the Redis host holds: the served document, and each front end's report of what it serves
    (`serving/<frontend>`: per model its versions and default, and the config generation it read)."""

    async def read() -> tuple[ServedState, dict[str, tuple[dict, int]]]:
        store = RedisStore(f"redis://{address}:{REDIS_PORT}/0", timeout_s=2.0)
        try:
            _, served = await SERVED.read(store)
            found = [r for _, r in (await serving_reports(store, "").others()).values()]
        finally:
            await store.close()
        return served, {
            r.frontend: ({m: (s.versions, s.default) for m, s in r.models.items()}, r.generation) for r in found
        }

    return asyncio.run(read())


def converged(address: str, ids: list[str]) -> bool:
    """The served document says sim version 1 is served and the default, and every front end reports
    serving just that, at the document's config generation."""
    served, serving = in_store(address)
    return served.models == {"sim": ModelServed([1], 1, [])} and serving == {
        fe: ({"sim": ([1], 1)}, served.generation) for fe in ids
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("hosts")
    sim_repo(root, sim_model_toml(timeout_ms=10000))
    (root / "inferd.toml").write_text("")
    with Lan() as lan:
        fe_hosts = [lan.host(f"fe-{x}") for x in "abc"]
        w_hosts = [lan.host(f"wk-{i}") for i in (1, 2)]
        redis_host = lan.host("redis")
        front_ends = [
            FrontEnd(
                f"fe-{x}", h,
                serve_argv(f"fe-{x}", h.address, root, redis_host.address, "--zone", zone, "--config", str(root / "inferd.toml")),
                root / f"fe-{x}.log", id=f"fe-{x}",
            )
            for x, h, zone in zip("abc", fe_hosts, ("zone-a", "zone-b", "zone-a"), strict=True)
        ]
        c = Cluster(root, redis_proc(redis_host, root), front_ends)
        with c.running(log_tail=2000):
            start_redis(c.redis)
            for fe in front_ends:
                fe.start()
            for fe in front_ends:
                wait_live(fe)
            w_hosts[1].resolve({NAME: [h.address for h in fe_hosts[:2]]})  # before the worker starts there
            c.workers = [
                Proc("w1", w_hosts[0], worker_argv("w1", connect_list(front_ends), "--zone", "zone-a"), root / "w1.log"),
                Proc(
                    "w2", w_hosts[1],
                    worker_argv("w2", f"dns:{NAME}:{WORKER_PORT}", "--zone", "zone-b", "--resolve-every-s", "0.5"),
                    root / "w2.log",
                ),
            ]
            for w in c.workers:
                w.start()
            a, b, fe_c = front_ends
            wait_for(lambda: set(workers_of(a)) == set(workers_of(b)) == {"w1", "w2"}, 60, "w1 and w2 on a and b")
            wait_for(lambda: set(workers_of(fe_c)) == {"w1"}, 60, "w1 on c")
            wait_for(lambda: sum(holds(fe) for fe in front_ends) == 1, 30, "one front end holding the lease")
            yield c


def test_sigkill_of_a_front_end_fails_only_its_own_requests(cluster: Cluster) -> None:
    holder = [fe for fe in cluster.front_ends if holds(fe)]
    victim = next(fe for fe in reversed(cluster.front_ends) if fe not in holder)  # not the lease holder
    others = [fe for fe in cluster.front_ends if fe is not victim]
    counters = ("inferd_batch_failures_total", "inferd_retried_items_total")
    before = {(fe.id, name): metric_total(fe, name) for fe in others for name in counters}
    joined = {fe.id: set(workers_of(fe)) for fe in others}
    loads = {fe.id: Load(fe.url, f"kill-{fe.id}", clients=2, max_requests=120, max_s=40) for fe in cluster.front_ends}
    with loads["fe-a"], loads["fe-b"], loads["fe-c"]:
        for load in loads.values():
            wait_answers(load, 15)
        victim.kill()
        victim.proc.wait(10)
        for fe in others:
            loads[fe.id].finish(60)
    for fe in others:
        t = tally(loads[fe.id])
        assert_exactly_once(t, loads[fe.id])
        assert t.ok == t.sent == 120, (fe.id, t)
        for name in counters:  # no batch of theirs was lost or sent again
            assert metric_total(fe, name) == before[fe.id, name], (fe.id, name)
    t = tally(loads[victim.id])
    assert t.duplicated == 0 and t.misrouted == 0, t  # what its clients got was theirs
    assert t.ok >= 15 and t.sent > t.ok, t  # answered until killed, then refused connections
    for w in cluster.workers:
        assert w.alive(), f"worker {w.name} exited:\n{w.log()[-3000:]}"
    for fe in others:
        assert set(workers_of(fe)) == joined[fe.id], f"{fe.id}'s workers changed"

    victim.start()  # the same front end started again (same id, address and data folder)
    wait_live(victim)
    wait_for(lambda: "w1" in workers_of(victim), 60, f"w1 joining {victim.id} again")
    answers = [infer(victim.url, f"back-{i}") for i in range(20)]
    assert all(a is not None and a.correct for a in answers), answers


def test_redis_stopped_for_10s_then_started_again(cluster: Cluster) -> None:
    fes = cluster.front_ends
    for fe in fes:
        wait_live(fe)
    wait_for(lambda: all(store_up(fe) == 1.0 for fe in fes), 20, "the store up on every front end")
    wait_for(lambda: sum(holds(fe) for fe in fes) == 1, 30, "one holder")
    before = {fe.id: served_state(fe) for fe in fes}
    assert before["fe-a"] == before["fe-b"] == before["fe-c"] == {"sim": (1, True)}, before

    store_url = f"redis://{cluster.redis.host.address}:{REDIS_PORT}/0"
    loads = {fe.id: PacedLoad(fe.url, f"outage-{fe.id}", clients=1, max_requests=300, max_s=45) for fe in fes}
    cluster.redis.stop()
    stopped_at = time.monotonic()
    with loads["fe-a"], loads["fe-b"], loads["fe-c"]:
        wait_for(lambda: all(store_up(fe) == 0.0 for fe in fes), 15, "the store seen down on every front end")
        wait_for(lambda: not any(holds(fe) for fe in fes), 15, "no front end acting as holder")
        for fe in fes:
            for change in ("scale?workers=1", "update?version=1"):
                status, answer = post(f"{fe.admin_url}/admin/models/sim/{change}")
                named = f"the cluster store does not answer (the cluster store at {store_url}"
                assert status == 503 and named in answer["error"], (fe.id, change, status, answer)
        for load in loads.values():
            wait_answers(load, 10)  # answered while the store is down
        assert all(store_up(fe) == 0.0 for fe in fes)
        time.sleep(max(0.0, 10.0 - (time.monotonic() - stopped_at)))  # 10 s of outage
        cluster.redis.start()  # on the same address and port, empty
        wait_for(lambda: redis_answers(cluster.redis.host.address), 10, "redis-server answering again")
        wait_for(lambda: all(store_up(fe) == 1.0 for fe in fes), 20, "the store up again on every front end")
        for load in loads.values():
            wait_answers(load, 10)  # answered once the store is back
    for fe in fes:
        t = tally(loads[fe.id])
        assert_exactly_once(t, loads[fe.id])
        assert t.ok == t.sent, (fe.id, t)

    # converged: a reload reaches all three, one holds the lease, a change asked of any is carried out
    ids = sorted(fe.id for fe in fes)
    def reloaded() -> list[str]:
        status, answer = post(f"{fes[0].admin_url}/admin/reload")
        return sorted(answer["frontends"]["reloaded"]) if status == 200 else []

    wait_for(lambda: reloaded() == ids, 30, "a reload reaching every front end")
    wait_for(lambda: sum(holds(fe) for fe in fes) == 1, 30, "a holder again")
    for fe in fes:
        status, answer = post(f"{fe.admin_url}/admin/models/sim/update?version=1")
        assert status == 200, (fe.id, status, answer)
    wait_for(lambda: all(served_state(fe) == before[fe.id] for fe in fes), 10, "the same served state everywhere")
    wait_for(lambda: converged(cluster.redis.host.address, ids), 10, "the served state in the store, reported by all")
    for fe in fes:
        answers = [infer(fe.url, f"after-{fe.id}-{i}") for i in range(10)]
        assert all(a is not None and a.correct for a in answers), answers


def test_a_dns_worker_joins_a_front_end_added_to_the_name(cluster: Cluster) -> None:
    a, b, c = cluster.front_ends
    w2 = cluster.workers[1]
    wait_for(lambda: "w2" in workers_of(a) and "w2" in workers_of(b), 60, "w2 on a and b")
    assert "w2" not in workers_of(c)  # not in the name yet
    w2.host.resolve({NAME: [fe.host.address for fe in cluster.front_ends]})
    wait_for(lambda: "w2" in workers_of(c), 30, "w2 joining the front end added to the name")
    page = get_json(f"{c.admin_url}/admin/workers")
    assert page["frontend"] == {"id": "fe-c", "zone": "zone-a"}
    zones = {w["worker_id"]: w["zone"] for w in page["workers"]}
    assert zones == {"w1": "zone-a", "w2": "zone-b"}, zones
    assert {"w1", "w2"} <= set(workers_of(a)) and {"w1", "w2"} <= set(workers_of(b))  # still on the others
    with Load(c.url, "dns", clients=2, max_requests=60, max_s=30) as load:
        load.finish(30)
    t = tally(load)
    assert_exactly_once(t, load)
    assert t.ok == 60, t
    assert w2.alive()
