"""ModelConfig's and ModelStatistics' answers: a model as Triton's `inference.ModelConfig` describes one,
so that `get_model_config` (and perf_analyzer, which reads the same fields) find what they read there,
and its request counts.

A batch model (OIP): platform and backend "inferd", `max_batch_size` (the most items one request may
carry: max_items_per_request, capped at the model's device batch), its tensors with `TYPE_*` data
types and dims without the batch dimension (an empty dims list: one scalar per item), and
`dynamic_batching` (max_queue_delay_microseconds from max_wait_ms, preferred batch sizes). An LLM
(the `text` family) takes Triton's vLLM backend tensors and is decoupled (answers stream on
ModelStreamInfer): text_input BYTES [1], stream BOOL [1], sampling_parameters BYTES [1] and
exclude_input_in_output BOOL [1] (both optional); text_output BYTES [-1].
"""

from __future__ import annotations

from inferd.config import TensorSpec
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.grpc_edge.protos import model_config_pb2 as mc
from inferd.observability.metrics import RequestStatistics
from inferd.runtime.contract import Runtime

BACKEND = "inferd"


def data_type(datatype: str) -> int:
    """A KServe datatype (FP32, BYTES...) as Triton's config enum (TYPE_FP32, TYPE_STRING...)."""
    return mc.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


def _tensor(cls: type, spec: TensorSpec) -> object:
    return cls(name=spec.name, data_type=data_type(spec.datatype), dims=list(spec.shape))


def model_config(rt: Runtime, api: str) -> mc.ModelConfig:
    """`rt`'s config; `api`: its kind's family of routes ("oip": a batch model, "text": an LLM or
    upstream model, else a kind served by neither: name and platform only)."""
    c = rt.config
    if api == "text":
        return llm_config(rt)
    config = mc.ModelConfig(name=c.name, platform=c.platform, backend=BACKEND)
    if api != "oip":
        return config
    config.max_batch_size = min(c.max_items_per_request, c.max_batch_size)
    config.input.extend(_tensor(mc.ModelInput, t) for t in c.inputs)
    config.output.extend(_tensor(mc.ModelOutput, t) for t in c.outputs)
    config.dynamic_batching.max_queue_delay_microseconds = round(c.max_wait_ms * 1000)
    config.dynamic_batching.preferred_batch_size.extend(c.preferred_batch_sizes)
    return config


LLM_INPUTS = (
    TensorSpec(name="text_input", datatype="BYTES", shape=(1,)),
    TensorSpec(name="stream", datatype="BOOL", shape=(1,)),
    TensorSpec(name="sampling_parameters", datatype="BYTES", shape=(1,)),
    TensorSpec(name="exclude_input_in_output", datatype="BOOL", shape=(1,)),
)
"""Triton's vLLM backend's inputs (all but text_input optional)."""
LLM_OUTPUTS = (TensorSpec(name="text_output", datatype="BYTES", shape=(-1,)),)


def llm_config(rt: Runtime) -> mc.ModelConfig:
    """An LLM as Triton's vLLM backend presents one (decoupled: its answers stream)."""
    c = rt.config
    return mc.ModelConfig(
        name=c.name,
        platform=c.platform,
        backend=BACKEND,
        max_batch_size=0,
        model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True),
        input=[
            mc.ModelInput(name=t.name, data_type=data_type(t.datatype), dims=list(t.shape), optional=i > 0)
            for i, t in enumerate(LLM_INPUTS)
        ],
        output=[_tensor(mc.ModelOutput, t) for t in LLM_OUTPUTS],
    )


def model_statistics(rt: Runtime, requests: RequestStatistics) -> pb.ModelStatistics:
    """ModelStatistics of one model version: its requests answered so far (every protocol), ok as
    `success` and `inference_count`, any other outcome as `fail`, with their summed durations. Batch
    executions are not counted per version here (execution_count stays 0): inferd_batch_executions_total
    has them."""
    duration = pb.StatisticDuration
    return pb.ModelStatistics(
        name=rt.name,
        version=str(rt.version),
        inference_count=requests.ok,
        inference_stats=pb.InferStatistics(
            success=duration(count=requests.ok, ns=round(requests.ok_s * 1e9)),
            fail=duration(count=requests.failed, ns=round(requests.failed_s * 1e9)),
        ),
    )
