"""/metrics of the whole server, whichever front end answers the scrape.

`exposition` is the text /metrics answers: a lone front end's registry, or, with several, the whole
server's. Each front end serves its own registry's text on a Unix socket of the plan (`serve_registry`);
the one that answers /metrics reads every peer's (`scrape_all`), labels each sample with `frontend="i"` and
merges the families, so one scrape holds every front end's counters and gauges (sum over `frontend` in
PromQL for the server's totals). The custom collectors (kinds/collectors.py) compute their
values in their own process at that moment, as with one front end. A peer that does not answer in time
is left out, and `inferd_frontend_up{frontend="i"}` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from inferd.frontends.plan import FrontendPlan

log = logging.getLogger("inferd.frontends")

PEER_TIMEOUT_S = 2.0


async def serve_registry(path: str, registry: CollectorRegistry) -> asyncio.Server:
    """Answer each connection on `path` with the registry's text, then close it."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(generate_latest(registry))
            await writer.drain()
        except OSError:
            pass  # the scraper left
        finally:
            writer.close()

    return await asyncio.start_unix_server(answer, path=path)


async def read_peer(path: str) -> bytes | None:
    """A peer's registry text, or None when it does not answer within PEER_TIMEOUT_S."""
    try:
        async with asyncio.timeout(PEER_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(path, limit=2**24)
            try:
                return await reader.read()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return None


async def exposition(plan: FrontendPlan | None, own: CollectorRegistry) -> bytes:
    """The text of /metrics: this front end's registry alone (None: the only one), else `scrape_all`."""
    if plan is None:
        return generate_latest(own)
    return await scrape_all(plan, own)


async def scrape_all(plan: FrontendPlan, own: CollectorRegistry) -> bytes:
    """Every front end's metrics (this one's read directly), merged under a `frontend` label."""
    peers = [i for i in range(plan.count) if i != plan.index]
    texts = await asyncio.gather(*(read_peer(plan.metrics_path(i)) for i in peers))
    by_frontend: dict[int, bytes | None] = dict(zip(peers, texts, strict=True))
    by_frontend[plan.index] = generate_latest(own)
    return merge(by_frontend)


def merge(texts: dict[int, bytes | None]) -> bytes:
    """One exposition from each front end's (None: it did not answer)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts))
    return generate_latest(registry)


class _Merged:
    def __init__(self, texts: dict[int, bytes | None]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        up = GaugeMetricFamily(
            "inferd_frontend_up", "1 when the front end answered this scrape.", labels=["frontend"]
        )
        for index in sorted(self.texts):
            text = self.texts[index]
            up.add_metric([str(index)], 0.0 if text is None else 1.0)
            if text is None:
                continue
            with contextlib.suppress(ValueError):  # a torn text: that front end's families are skipped
                for family in text_string_to_metric_families(text.decode()):
                    merged = families.setdefault(
                        family.name, Metric(family.name, family.documentation, family.type, family.unit)
                    )
                    merged.samples.extend(
                        Sample(s.name, {**s.labels, "frontend": str(index)}, s.value, s.timestamp)
                        for s in family.samples
                    )
        yield up
        yield from families.values()
