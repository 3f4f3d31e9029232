"""Triton's repository RPCs (RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload) over the REST
routes' own code (api/repository.py `Repository`): the same callers, refusals and model control. The
caller's key is read whether tenants are configured or not (the admin token may call them)."""

from __future__ import annotations

from inferd.api.repository import Repository
from inferd.core.call import Call
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.reply import GrpcReply


class RepositoryRpcs:
    def __init__(self, repository: Repository) -> None:
        self.repository = repository

    async def index(self, call: Call, request: pb.RepositoryIndexRequest) -> GrpcReply:
        who = self.repository.caller(call, call.credential)
        row = pb.RepositoryIndexResponse.ModelIndex
        rows = [
            row(name=r.name, version=r.version, state=r.state.value, reason=r.reason)
            for r in self.repository.index(who, request.ready)
        ]
        return GrpcReply(pb.RepositoryIndexResponse(models=rows))

    async def load(self, call: Call, request: pb.RepositoryModelLoadRequest) -> GrpcReply:
        who = self.repository.caller(call, call.credential)
        await self.repository.load(who, request.model_name, request.parameters.keys())
        return GrpcReply(pb.RepositoryModelLoadResponse())

    async def unload(self, call: Call, request: pb.RepositoryModelUnloadRequest) -> GrpcReply:
        who = self.repository.caller(call, call.credential)
        await self.repository.unload(who, request.model_name)  # unload_dependents: none here, ignored
        return GrpcReply(pb.RepositoryModelUnloadResponse())
