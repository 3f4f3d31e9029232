"""`inferd serve --frontends 2`: the owner's autoscaler and /admin/models see the whole server's load.

One `sim` worker serves both front ends; most of the load goes through front end 1 (a follower), a
little through the owner. The follower reports its load to the owner every second, so what the owner's
autoscaler observed (the admin API's `autoscaler.observed`) covers every front end's arrivals and the
device's whole busy ratio, not the owner's share of them (here about a quarter of the arrivals and
half the busy time: its lone client's batches are small). The autoscaler may keep one worker only
(max_workers = 1): the observation is what this checks, not a fleet change.

Bounded: one server, closed-loop clients capped in count and time."""

from __future__ import annotations

import http.client
import json
import statistics
import time
import urllib.request
from pathlib import Path

from tests.checked_load import wait_for
from tests.conftest import ServerProc, start_server
from tests.frontends_harness import ready_workers, scrape
from tests.integration.test_frontends_owner import Clients, served_by

CONFIG = """
[models.sim]
max_batch_size = 4
max_wait_ms = 2.0

[models.sim.params]
base_ms = 20.0
per_item_ms = 1.0

[models.sim.autoscale]
min_workers = 1
max_workers = 1
"""
ON_FOLLOWER, ON_OWNER = 3, 1
SAMPLES = 6


def connections(server: ServerProc, wanted: dict[int, int]) -> list[http.client.HTTPConnection]:
    """Kept connections: `wanted[i]` reaching front end i (the kernel spreads them over the listeners)."""
    kept: dict[int, list[http.client.HTTPConnection]] = {i: [] for i in wanted}
    for n in range(80):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        front = served_by(server, conn, n)
        if len(kept[front]) < wanted[front]:
            kept[front].append(conn)
        else:
            conn.close()
        if all(len(kept[i]) == wanted[i] for i in wanted):
            return [c for i in sorted(kept) for c in kept[i]]
    got = {i: len(c) for i, c in kept.items()}
    raise AssertionError(f"connections per front end: {got} of {wanted}")


def sim_model(server: ServerProc) -> dict:
    with urllib.request.urlopen(f"{server.admin_url}/admin/models", timeout=5) as r:
        return json.loads(r.read())["models"]["sim"]


def device_busy(server: ServerProc) -> float:
    """The device's busy ratio: every front end's share of it, from one whole-server /metrics scrape."""
    samples = scrape(server)
    return sum(
        v for k, v in samples.items() if k.startswith("inferd_device_busy_ratio{") and 'model="sim"' in k
    )


def test_the_owners_autoscaler_observes_the_load_of_every_front_end(tmp_path: Path) -> None:
    config = tmp_path / "inferd.toml"
    config.write_text(CONFIG)
    server = start_server(
        tmp_path, "--model", "sim", "--workers", "1", "--frontends", "2", "--config", str(config)
    )
    conns: list[http.client.HTTPConnection] = []
    try:
        wait_for(lambda: len(ready_workers(server)) == 1, 30, "one ready worker")
        conns = connections(server, {0: ON_OWNER, 1: ON_FOLLOWER})
        with Clients(conns, max_each=2000, max_s=40.0) as clients:
            wait_for(lambda: clients.answered() >= 200, 30, "200 answers")
            time.sleep(4.0)  # the busy ratio's window fills (it spans 10 s): a bounded settle, not a sync
            started, answered = time.monotonic(), clients.answered()
            rates, busy, device = [], [], []
            for _ in range(SAMPLES):
                time.sleep(1.0)  # the autoscaler observes once a second
                observed = sim_model(server)["autoscaler"]["observed"]
                rates.append(observed["arrival_rate_items_s"])
                busy.append(observed["busy_ratio"])
                device.append(device_busy(server))
            client_rate = (clients.answered() - answered) / (time.monotonic() - started)
            admin_busy = sim_model(server)["busy_ratio"]
        assert clients.errors == [], clients.errors[:5]
        # the owner alone sees about a quarter of the arrivals; the whole server's are about all of them
        rate = statistics.median(rates)
        assert 0.6 * client_rate <= rate <= 1.7 * client_rate, (rates, client_rate)
        whole = statistics.median(device)
        assert whole > 0.2, device  # the device did work
        assert statistics.median(busy) >= 0.7 * whole, (busy, device)
        assert admin_busy >= 0.7 * whole, (admin_busy, device)
    finally:
        for conn in conns:
            conn.close()
        server.stop()
