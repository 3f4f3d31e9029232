"""The gRPC edge's generated modules are what scripts/protos makes of the vendored descriptor set, and
their descriptors are byte-identical to tritonclient's (so both register in one process)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]


def _script():  # scripts/protos has no .py suffix: load it by path
    from importlib.machinery import SourceFileLoader

    loader = SourceFileLoader("protos_script", str(ROOT / "scripts" / "protos"))
    spec = importlib.util.spec_from_loader("protos_script", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_generated_modules_are_current(tmp_path: Path) -> None:
    script = _script()
    written = script.generate(tmp_path)
    names = sorted(p.name for p in written)
    assert names == sorted(
        p.name for p in (ROOT / "src/inferd/grpc_edge/protos").glob("*_pb2*.py*")
    ), "run scripts/protos"
    for path in written:
        committed = ROOT / "src/inferd/grpc_edge/protos" / path.name
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run scripts/protos"


def test_descriptors_match_tritonclients() -> None:
    from tritonclient.grpc import model_config_pb2, service_pb2

    from inferd.grpc_edge.protos import grpc_service_pb2
    from inferd.grpc_edge.protos import model_config_pb2 as ours_config

    for theirs, ours in ((service_pb2, grpc_service_pb2), (model_config_pb2, ours_config)):
        a, b = descriptor_pb2.FileDescriptorProto(), descriptor_pb2.FileDescriptorProto()
        theirs.DESCRIPTOR.CopyToProto(a)
        ours.DESCRIPTOR.CopyToProto(b)
        assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
    assert "inferd.grpc_edge.protos.grpc_service_pb2" in sys.modules
