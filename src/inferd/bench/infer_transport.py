"""How `inferd bench` sends a request and reads its answer, whatever the protocol:
`send(rid, payload, deadline) -> (error kind or None, metadata, answer bytes)`, and `fields(answer)`, what
the answer check (`inferd.bench.infer_requests.AnswerChecker`) reads of it.

REST: the OIP v2 JSON body over one of the HTTP clients (`inferd.bench.http_clients`); a status other
than 200 is the error kind `http_<status>`. gRPC: Triton's ModelInfer (`inferd.bench.grpc_infer`), a
status other than OK the kind `grpc_<code>`. Connection failures raise OSError (or aiohttp.ClientError),
and the caller bounds each send with its deadline (cancellation) and counts that as a timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from inferd.bench.grpc_infer import GrpcInferClient
from inferd.bench.http_clients import HttpClient, make_client
from inferd.bench.infer_requests import Answer, Fields, json_fields, request_body
from inferd.bench.load_spec import LoadSpec


class InferTransport(Protocol):
    """What the load generator needs of a protocol."""

    async def start(self) -> None: ...

    async def send(self, rid: str, payload: str, deadline: float) -> Answer: ...

    def fields(self, raw: bytes) -> Fields: ...

    async def close(self) -> None: ...


class OipOverHttp:
    """The OIP v2 JSON request over an HTTP client."""

    def __init__(self, client: HttpClient) -> None:
        self._client = client

    fields = staticmethod(json_fields)

    async def start(self) -> None:
        await self._client.start()

    async def send(self, rid: str, payload: str, deadline: float) -> Answer:
        status, headers, raw = await self._client.post(request_body(rid, payload), deadline)
        return (None if status == 200 else f"http_{status}"), headers, raw

    async def close(self) -> None:
        await self._client.close()


def make_transport(spec: LoadSpec, now: Callable[[], float]) -> InferTransport:
    """The transport `spec.protocol` (and for HTTP `spec.client`) names; call from inside the running loop."""
    if spec.protocol == "grpc":
        return GrpcInferClient(spec, now)
    return OipOverHttp(make_client(spec, now))
