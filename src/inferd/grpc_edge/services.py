"""Triton's `inference.GRPCInferenceService` over the request core: each RPC is read into its Call
(grpc_edge/calls.py), passes the same chain as a REST route (api/app.py `Api.layers`, with `GrpcErrors`
for `Errors`), then its handler, which answers a `GrpcReply`; `GrpcReply.send` ends the RPC.

ModelInfer runs the REST infer route's own path (`Api.run_oip`: resolve with canary and A/B splits,
fallback, precheck, deadline, cache, shadow) over the ModelInferRequest (grpc_edge/codec.py); an LLM's
request (Triton's vLLM tensors) runs the REST text routes' (grpc_edge/text.py). ModelStreamInfer takes
many such requests on one stream (grpc_edge/stream.py), each its own Call through the same chain. The
repository RPCs run the REST repository routes' code (grpc_edge/repository.py); the shared-memory RPCs
answer UNIMPLEMENTED (the generated base class's default).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from typing import Any

from grpc import aio

from inferd.api.app import Api
from inferd.api.oip_answer import fallback_headers, lifecycle_headers
from inferd.api.oip_metadata import GRPC, model_metadata, server_metadata
from inferd.api.repository import Repository
from inferd.core.call import Call, Handler, Layer, chain
from inferd.errors import NotFound, ServingError
from inferd.grpc_edge.calls import SERVICE, RpcMetadata, grpc_call, read_hints
from inferd.grpc_edge.codec import GrpcOip, encode_response
from inferd.grpc_edge.errors import code_of
from inferd.grpc_edge.model_config import LLM_INPUTS, LLM_OUTPUTS, model_config, model_statistics
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.protos import grpc_service_pb2_grpc as pb_grpc
from inferd.grpc_edge.reply import GrpcReply
from inferd.grpc_edge.repository import RepositoryRpcs
from inferd.grpc_edge.stream import Response, StreamRequests, reply_responses
from inferd.grpc_edge.text import text_reply
from inferd.observability.logging_setup import accept_request_id

Context = aio.ServicerContext[Any, Any]

class InferRpc:
    """ModelInfer's request along the chain: the message as api/oip_answer.py's `OipSource`, and the
    call's metadata (an A/B split sticky by a header reads it)."""

    __slots__ = ("metadata", "source")

    def __init__(self, message: pb.ModelInferRequest, metadata: RpcMetadata) -> None:
        self.source = GrpcOip(message)
        self.metadata = metadata


async def _refuse(exc: ServingError, call: Call, request: object) -> GrpcReply:
    """The handler of a call the edge could not read (a bad metadata value, a deadline past): its error."""
    raise exc


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, api: Api, layers: list[Layer]) -> None:
        self.api = api
        self.server = server = api.server
        self.registry = server.registry
        self.clock = server.clock
        self.layers = layers
        self.enforced = api.tenants_enforced
        self._live = chain(layers, self._server_live)
        self._ready = chain(layers, self._server_ready)
        self._server_meta = chain(layers, self._server_metadata)
        self._model_ready = chain(layers, self._model_ready_of)
        self._model_meta = chain(layers, self._model_metadata)
        self._config = chain(layers, self._model_config)
        self._statistics = chain(layers, self._model_statistics)
        self._infer = chain(layers, self._model_infer)
        self._stream_infer = chain(layers, partial(self._model_infer, streams=True))
        rpcs = RepositoryRpcs(Repository(server))
        self._repository = {"RepositoryIndex": chain(layers, rpcs.index), "RepositoryModelLoad": chain(layers, rpcs.load)}
        self._repository["RepositoryModelUnload"] = chain(layers, rpcs.unload)
        self._streams: set[StreamRequests] = set()
        """The open ModelStreamInfer streams, for `drain_streams`."""
        self._draining = False
        """`drain_streams` was called: a stream starting now is drained at once."""

    async def _rpc(
        self, context: Context, method: str, run: Handler, request: Any, model: str = "", version: str = "",
        keys: bool = False,
    ) -> Any:
        """One unary RPC through the chain: its Call read (the caller's key too when tenants are
        configured, or `keys`), `run`, and the reply sent."""
        metadata = RpcMetadata(context.invocation_metadata())
        call = grpc_call(context, metadata, SERVICE + method, model, version, keys or self.enforced())
        reply = await run(call, request)
        return await reply.send(context)

    # ---- health and metadata ----------------------------------------------------------------------
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return await self._rpc(context, "ServerLive", self._live, request)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return await self._rpc(context, "ServerReady", self._ready, request)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Context
    ) -> pb.ServerMetadataResponse:
        return await self._rpc(context, "ServerMetadata", self._server_meta, request)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        return await self._rpc(context, "ModelReady", self._model_ready, request, request.name, request.version)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        return await self._rpc(context, "ModelMetadata", self._model_meta, request, request.name, request.version)

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        return await self._rpc(context, "ModelConfig", self._config, request, request.name, request.version)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Context
    ) -> pb.ModelStatisticsResponse:
        return await self._rpc(context, "ModelStatistics", self._statistics, request, request.name, request.version)

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        return await self._rpc(context, "RepositoryIndex", self._repository["RepositoryIndex"], request, keys=True)

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        run = self._repository["RepositoryModelLoad"]
        return await self._rpc(context, "RepositoryModelLoad", run, request, request.model_name, keys=True)

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        run = self._repository["RepositoryModelUnload"]
        return await self._rpc(context, "RepositoryModelUnload", run, request, request.model_name, keys=True)

    async def _server_live(self, call: Call, request: Any) -> GrpcReply:
        return GrpcReply(pb.ServerLiveResponse(live=True))

    async def _server_ready(self, call: Call, request: Any) -> GrpcReply:
        return GrpcReply(pb.ServerReadyResponse(ready=self.server.ready))

    async def _server_metadata(self, call: Call, request: Any) -> GrpcReply:
        return GrpcReply(pb.ServerMetadataResponse(**server_metadata(GRPC)))

    async def _model_ready_of(self, call: Call, request: pb.ModelReadyRequest) -> GrpcReply:
        if request.name in self.server.model_control.unloaded and call.tenant.may_call(request.name):
            return GrpcReply(pb.ModelReadyResponse(ready=False))  # tritonclient's is_model_ready: False
        rt = self._model(call, request.name, request.version)
        return GrpcReply(pb.ModelReadyResponse(ready=rt.ready and not self.server.shutting_down))

    async def _model_metadata(self, call: Call, request: pb.ModelMetadataRequest) -> GrpcReply:
        rt = self._model(call, request.name, request.version)
        oip = self.server.kinds.get(rt.kind).api == "oip"
        meta = model_metadata(rt.config, self.registry.versions(rt.name), oip)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        if self.server.kinds.get(rt.kind).api == "text":  # an LLM takes Triton's vLLM backend tensors here
            inputs = [tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in LLM_INPUTS]
            outputs = [tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in LLM_OUTPUTS]
        else:
            inputs = [tensor(**t) for t in meta.get("inputs", ())]
            outputs = [tensor(**t) for t in meta.get("outputs", ())]
        return GrpcReply(
            pb.ModelMetadataResponse(
                name=meta["name"], versions=meta["versions"], platform=meta["platform"], inputs=inputs, outputs=outputs
            )
        )

    async def _model_config(self, call: Call, request: pb.ModelConfigRequest) -> GrpcReply:
        rt = self._model(call, request.name, request.version)
        return GrpcReply(pb.ModelConfigResponse(config=model_config(rt, self.server.kinds.get(rt.kind).api)))

    async def _model_statistics(self, call: Call, request: pb.ModelStatisticsRequest) -> GrpcReply:
        """One model version's statistics (`name`, `version`: the default), or every served version's
        (no name) that the caller may call."""
        if request.name:
            runtimes = [self._model(call, request.name, request.version)]
        else:
            runtimes = [rt for rt in self.registry if call.tenant.may_call(rt.name)]
        metrics = self.server.metrics
        stats = [model_statistics(rt, metrics.request_statistics(rt.name, rt.version)) for rt in runtimes]
        return GrpcReply(pb.ModelStatisticsResponse(model_stats=stats))

    def _generates_text(self, name: str) -> bool:
        """Whether `name` is a model of the text family (an LLM): its requests are Triton's vLLM tensors."""
        try:
            rt = self.registry.get(name)
        except NotFound:  # the OIP path answers it (404, or 403 to a tenant)
            return False
        return self.server.kinds.get(rt.kind).api == "text"

    def _model(self, call: Call, name: str, version: str) -> Any:
        """The runtime of `name` at `version` ("" the default): NotFound (an unloaded model's says so), or
        Forbidden for a tenant."""
        self.api.check_served(call, name)
        return self.registry.get(name, version or None)  # not call.runtime: not counted, as on REST

    # ---- inference ----------------------------------------------------------------------------------
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        metadata = RpcMetadata(context.invocation_metadata())
        call, run = self._infer_call(context, metadata, "ModelInfer", request, self._infer)
        reply = await run(call, InferRpc(request, metadata))
        return await reply.send(context)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Context) -> None:
        """Many requests on one stream, each through the chain as a ModelInfer call (grpc_edge/stream.py);
        the stream's cancellation cancels every one's task."""
        metadata = RpcMetadata(context.invocation_metadata())
        answer = partial(self._stream_request, context, metadata)
        stream = StreamRequests(self.server.config.grpc_stream_max_in_flight, answer, context.write)
        self._streams.add(stream)
        if self._draining:  # accepted just before the listener stopped: it reads nothing
            stream.drain()
        try:
            await stream.run(request_iterator)
        except ServingError as exc:  # a message that did not parse: the stream ends with its status
            await context.abort(code_of(exc), exc.message)
        finally:
            self._streams.discard(stream)

    def drain_streams(self) -> None:
        """The server stops: every open stream reads no more requests and ends once those it read are
        answered (the edge then gives them its grace); so does any stream that starts from now on."""
        self._draining = True
        for stream in self._streams:
            stream.drain()

    async def _stream_request(
        self, context: Context, metadata: RpcMetadata, request: pb.ModelInferRequest
    ) -> AsyncIterator[Response]:
        call, run = self._infer_call(context, metadata, "ModelStreamInfer", request, self._stream_infer)
        if request.id:  # each request of a stream is known by its own id in logs and traces
            call.request_id = accept_request_id(request.id)
        reply = await run(call, InferRpc(request, metadata))
        async with aclosing(reply_responses(call, request, reply)) as responses:
            async for response in responses:
                yield response

    def _infer_call(
        self, context: Context, metadata: RpcMetadata, method: str, request: pb.ModelInferRequest, run: Handler
    ) -> tuple[Call, Handler]:
        """An inference request's Call, and the chain to run it through (one that answers its error when
        the call's metadata or deadline is refused)."""
        keys = self.enforced()
        call = grpc_call(context, metadata, SERVICE + method, request.model_name, request.model_version, keys)
        call.reserves_tokens = self._generates_text(request.model_name)  # a token quota's admission
        try:
            read_hints(call, metadata, context, self.clock, keys)
        except ServingError as exc:
            run = chain(self.layers, partial(_refuse, exc))
        return call, run

    async def _model_infer(self, call: Call, rpc: InferRpc, streams: bool = False) -> GrpcReply:
        """A batch model's request (the REST infer route's path), or an LLM's (grpc_edge/text.py; `streams`:
        on ModelStreamInfer, where its answer may stream)."""
        if self._generates_text(rpc.source.message.model_name):
            return await text_reply(self.api, call, rpc.source.message, rpc.metadata.get, streams)
        source = rpc.source
        done = await self.api.run_oip(call, source.message.model_name, rpc.metadata.get, source)
        headers = fallback_headers(done.runtime) if done.fallback else []
        headers += lifecycle_headers(done.record)
        return GrpcReply(encode_response(done), headers)
