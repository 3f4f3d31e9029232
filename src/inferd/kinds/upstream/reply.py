"""One upstream engine's answer, held open while the caller streams it, and the statistics of an
upstream-served model (the pool's, plus the runtime's retries)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import aiohttp

from inferd.kinds.upstream.pool import Outcome, PoolStatistics


@dataclass(frozen=True, slots=True)
class UpstreamStatistics(PoolStatistics):
    """The upstream pool's statistics (RuntimeStatistics.detail of the upstream kind)."""

    retries: int = 0
    """Requests tried again on another upstream after a failure before any byte was streamed."""

    @classmethod
    def of(cls, pool: PoolStatistics, retries: int) -> UpstreamStatistics:
        return cls(**{f.name: getattr(pool, f.name) for f in fields(pool)}, retries=retries)


class UpstreamReply:
    """One upstream's answer, held open while the caller streams it. `close` exactly once gives the slot
    back with the outcome (a response not read to its end closes its connection: the upstream cancels)."""

    def __init__(
        self, release: Callable[[str, Outcome], None], url: str, response: aiohttp.ClientResponse
    ) -> None:
        self._release = release
        self.url = url
        self.response = response
        self.status = response.status
        self._closed = False

    def close(self, outcome: Outcome) -> None:
        if self._closed:
            return
        self._closed = True
        if outcome is Outcome.SUCCESS:
            self.response.release()
        else:
            self.response.close()
        self._release(self.url, outcome)


def describe(exc: BaseException) -> str:
    """An aiohttp or timeout error in a few words (TimeoutError's own text is empty)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
