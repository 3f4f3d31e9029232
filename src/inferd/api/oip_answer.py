"""An OIP request answered by a batch model, whatever the edge it came by: its items queued in the
caller's lane under its deadline and priority (through the response cache when the model has one), and
the lifecycle record that goes with the answer (queue wait, batch, compute time, attempts).

`Api.run_oip` (api/app.py) is the one inference path of both edges: the HTTP route hands it an
`OipSource` over its body, the gRPC edge one over its ModelInferRequest (grpc_edge/codec.py); each
encodes the `Inference` it gets back in its own wire format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from inferd.api.cache_hook import CacheHook
from inferd.api.oip_tensors import DecodedRequest
from inferd.config import ModelConfig
from inferd.core.call import Call
from inferd.gateway.auth import tenant_share
from inferd.gateway.cache import encoded_size
from inferd.kinds.batch.dispatcher import ItemResult, ModelRuntime
from inferd.runtime.contract import Runtime

Answer = tuple[int, list[dict[str, Any]], dict[str, Any]]
"""An OIP answer before encoding: the version that ran it, per-item outputs, the lifecycle record."""


class OipSource(Protocol):
    """An edge's OIP inference request, read once the model has admitted it (the precheck runs before
    a body is read), decoded against whichever model version answers it (the primary's, or its
    fallback's)."""

    async def read(self) -> None:
        """Receive what decoding needs (an HTTP body); nothing to do when the wire has decoded it."""
        ...

    def decode(self, config: ModelConfig) -> DecodedRequest:
        """The request's items and requested outputs, checked against `config` (BadRequest naming what
        is wrong)."""
        ...


@dataclass(slots=True)
class Inference:
    """An OIP request's answer, for its edge to encode (one per call: not frozen, which costs a
    microsecond to build)."""

    runtime: ModelRuntime
    """The model version that answered (the primary's, or its fallback's)."""
    fallback: bool
    """Answered by the primary's fallback."""
    request: DecodedRequest
    """The request as decoded for `runtime` (its id and requested outputs)."""
    version: int
    rows: list[dict[str, Any]]
    """Per-item outputs, in the request's order."""
    record: dict[str, Any]
    """The lifecycle record (`lifecycle`), with `cache` and `fallback` when they apply."""


async def oip_answer(cache: CacheHook, call: Call, rt: ModelRuntime, req: DecodedRequest) -> Answer:
    """Queue an OIP request's items on `rt` and wait, under the call's deadline and priority, in its
    tenant's lane (through the response cache when it is on)."""
    if not rt.config.cache.enabled:
        return await _queue_and_wait(call, rt, req)

    async def compute() -> tuple[Answer, int]:
        answer = await _queue_and_wait(call, rt, req)
        return answer, encoded_size(answer[1])

    # the same answer for the same inputs and requested outputs
    canonical = ("oip", req.items, [spec.name for spec, _ in req.outputs])
    (version, rows, record), lookup = await cache.answer(call, rt, canonical, compute)
    # a hit's record is that of the run that computed it
    return version, rows, {**record, "cache": lookup}


async def _queue_and_wait(call: Call, rt: ModelRuntime, req: DecodedRequest) -> Answer:
    results = await rt.service.infer(
        req.items,
        deadline=call.deadline,
        priority=call.priority,
        share=tenant_share(call.tenant),
        gone=call.departure.watch,
    )
    return results[0].version, [r.outputs for r in results], lifecycle(results)


def lifecycle(results: list[ItemResult]) -> dict[str, Any]:
    """The per-request lifecycle record: queue wait, batch id and size, compute time, attempts."""
    first = results[0]
    if len(results) == 1:
        return {
            "queue_ms": round(first.queue_s * 1000, 3),
            "batch_id": first.batch_id,
            "batch_size": first.batch_size,
            "compute_ms": round(first.compute_s * 1000, 3),
            "attempts": first.attempts,
        }
    batches = list(dict.fromkeys(r.batch_id for r in results))[:8]
    sizes = list(dict.fromkeys(r.batch_size for r in results))[:8]
    return {
        "queue_ms": round(max(r.queue_s for r in results) * 1000, 3),
        "batch_id": ",".join(map(str, batches)),
        "batch_size": ",".join(map(str, sizes)),
        "compute_ms": round(max(r.compute_s for r in results) * 1000, 3),
        "attempts": max(r.attempts for r in results),
    }


def fallback_headers(rt: Runtime) -> list[tuple[bytes, bytes]]:
    """An answer given by a model's fallback names it (X-Inferd-Model-Version names its version)."""
    return [(b"x-inferd-fallback", rt.name.encode()), (b"x-inferd-model", rt.name.encode())]


def lifecycle_headers(record: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """The lifecycle record as metadata (REST: X-Inferd-* headers; gRPC: trailing metadata)."""
    return [
        (b"x-inferd-queue-ms", str(record["queue_ms"]).encode()),
        (b"x-inferd-batch-id", str(record["batch_id"]).encode()),
        (b"x-inferd-batch-size", str(record["batch_size"]).encode()),
        (b"x-inferd-compute-ms", str(record["compute_ms"]).encode()),
        (b"x-inferd-attempts", str(record["attempts"]).encode()),
    ]
