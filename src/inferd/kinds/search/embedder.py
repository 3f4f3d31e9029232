"""Embeddings for a search index, from its embedder model THROUGH inferd's own batcher: documents at
ingest and queries at search time go through the model's BatchService (kinds/batch/service.py) into the
same queue as /v1/embeddings and OIP traffic to that model, so they batch with it. Query vectors are
cached (LRU by text).

`EmbedderHealth` is the breaker in front of it (a plain object with an injected clock): after a failure
(no ready worker, queue full, timeout, a model error) queries skip the embedder and search lexically;
one query per `probe_interval_s` tries it again, and the first success closes the breaker, so hybrid
search is back within about a probe interval of the embedder's recovery.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from inferd.clock import Clock
from inferd.errors import DeadlineExceeded, ModelError, ServingError, WorkerUnavailable
from inferd.kinds.search.caches import LRU
from inferd.kinds.search.types import Document
from inferd.routing.fairness import BULK, INTERACTIVE

log = logging.getLogger("inferd.search")


class EmbedderState(enum.Enum):
    UP = "up"
    DOWN = "down"


class EmbedderHealth:
    def __init__(self, clock: Clock, probe_interval_s: float = 1.0) -> None:
        self.clock = clock
        self.probe_interval_s = probe_interval_s
        self.state = EmbedderState.UP
        self.reason = ""
        self._next_probe_at = 0.0
        self.changes = 0

    def allow(self) -> bool:
        """Whether this query may use the embedder: always while up; one probe per interval while down."""
        if self.state is EmbedderState.UP:
            return True
        now = self.clock.now()
        if now < self._next_probe_at:
            return False
        self._next_probe_at = now + self.probe_interval_s
        return True

    def success(self) -> None:
        if self.state is EmbedderState.DOWN:
            self.state, self.reason = EmbedderState.UP, ""
            self.changes += 1
            log.info("embedder is back: hybrid and dense search resume")

    def failure(self, reason: str) -> None:
        self._next_probe_at = self.clock.now() + self.probe_interval_s
        self.reason = reason
        if self.state is EmbedderState.UP:
            self.state = EmbedderState.DOWN
            self.changes += 1
            log.warning("embedder unavailable (%s): searching lexically until it answers again", reason)


def embed_text(doc: Document) -> str:
    """What a document's vector is computed from."""
    return f"{doc.title}\n{doc.text}" if doc.title else doc.text


class Embedder:
    def __init__(
        self,
        model: str,
        dim: int,
        find_model: Callable[..., Any],
        clock: Clock,
        cache_entries: int = 4096,
        api_of: Callable[[Any], str] | None = None,
    ) -> None:
        self.model = model
        self.dim = dim
        self.find_model = find_model
        """The registry's lookup `(name, version=None)`: a served version's runtime (a batch model)."""
        self.clock = clock
        self.api_of = api_of
        """The family of routes a model is served on (RuntimeContext.api_of): the embedder must be one
        the OIP routes serve, a batch model with its BatchService (None: not checked)."""
        self.health = EmbedderHealth(clock)
        self.cache: LRU[str, bytes] = LRU(cache_entries)
        self.version: int | None = None
        """The embedder version of the index's vectors: queries are embedded by it (None: not known
        yet, the served default). kinds/search/reembed.py moves it when the served version changes."""
        self.target: int | None = None
        """The version a running re-embed moves to: new documents are embedded by it too."""

    def served_version(self) -> int | None:
        """The embedder's default version now (None while the model is not served)."""
        try:
            return int(self.find_model(self.model).version)
        except ServingError:
            return None

    def promote(self, version: int) -> None:
        """The index's vectors are `version`'s now: so are the queries' (cached vectors are dropped)."""
        self.version, self.target = version, None
        self.cache.clear()

    async def query(self, text: str, deadline: float) -> bytes:
        """The query's vector (cached); raises the embedder's ServingError (recorded by the breaker), or
        WorkerUnavailable at once while the breaker is open and no probe is due."""
        cached = self.cache.get(text)
        if cached is not None:
            return cached
        if not self.health.allow():
            raise WorkerUnavailable(f"embedder {self.model!r} is down ({self.health.reason})")
        try:
            (vector,) = await self._embed([text], deadline, INTERACTIVE, self.version)
        except ServingError as exc:
            self.health.failure(exc.message)
            raise
        self.health.success()
        self.cache.put(text, vector)
        return vector

    async def documents(
        self, texts: Sequence[str], deadline: float, version: int | None, chunk: int = 64
    ) -> list[bytes]:
        """Every text's vector by embedder `version` (None: the default), in order (chunks queued
        together at bulk priority). NotFound when that version is not served."""
        chunks = [texts[i : i + chunk] for i in range(0, len(texts), chunk)]
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._embed(c, deadline, BULK, version)) for c in chunks]
        except* ServingError as group:  # the first chunk's error, as the caller catches it
            raise group.exceptions[0] from None
        return [v for t in tasks for v in t.result()]

    async def _embed(
        self, texts: Sequence[str], deadline: float, priority: int, version: int | None
    ) -> list[bytes]:
        rt = self.find_model(self.model, version)
        if self.api_of is not None and self.api_of(rt) != "oip":
            raise ModelError(f"embedder {self.model!r} is a {rt.kind} model, not a batch embedding model")
        # refuse_late=False: the batcher's admission does not hold the request to its deadline, since its
        # estimate follows the batches it saw (long document batches at ingest) and a refusal would never
        # let it see a short query batch again. The deadline still expires the items (the service's).
        try:
            results = await rt.service.infer(
                [t.encode() for t in texts], deadline=deadline, priority=priority, refuse_late=False
            )
        except DeadlineExceeded:
            raise DeadlineExceeded(
                f"embedder {self.model!r} did not answer in time for {len(texts)} text(s)"
            ) from None
        return [self._vector(r.outputs) for r in results]

    def _vector(self, outputs: dict[str, Any]) -> bytes:
        if "EMBEDDING" not in outputs:
            raise ModelError(f"embedder {self.model!r} has no EMBEDDING output")
        v = np.asarray(outputs["EMBEDDING"], dtype=np.float32).reshape(-1)
        if v.shape[0] != self.dim:
            raise ModelError(
                f"embedder {self.model!r} returned {v.shape[0]}-dimensional vectors; the index expects "
                f"dim = {self.dim}"
            )
        norm = float(np.linalg.norm(v))
        return (v / norm if norm > 0 else v).astype("<f4").tobytes()


def unavailable(exc: BaseException) -> WorkerUnavailable:
    """Why dense search cannot run now (a 503 that names the embedder's problem)."""
    message = exc.message if isinstance(exc, ServingError) else str(exc)
    return WorkerUnavailable(f"dense search needs the embedder, which is unavailable: {message}")
