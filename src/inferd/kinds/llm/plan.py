"""The scheduler's inputs and outputs: its config, the typed overload error, the step plan it hands
the engine, what the engine reports back, and the deltas to stream."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from inferd.errors import Overloaded
from inferd.kinds.llm.sequence import FinishReason


class SchedulerConfig(BaseModel):
    """Budgets of one LLM engine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_num_batched_tokens: int = Field(default=2048, ge=2)
    """Tokens computed by one step (decodes plus prefill chunks)."""
    max_num_seqs: int = Field(default=128, ge=1)
    """Sequences running at once."""
    block_size: int = Field(default=16, ge=1)
    """Tokens per KV block."""
    num_blocks: int = Field(default=1024, ge=1)
    """KV blocks in the device pool."""
    enable_prefix_caching: bool = True
    """Reuse computed full blocks of a matching prefix (same tenant only)."""
    max_waiting_seqs: int = Field(default=1024, ge=1)
    """New sequences waiting for admission; `add()` beyond this raises SchedulerFull."""
    max_waiting_prompt_tokens: int = Field(default=1_000_000, ge=1)
    """Prompt tokens of the new sequences waiting; `add()` beyond this raises SchedulerFull."""
    min_retry_after_s: float = Field(default=0.05, ge=0.0)
    """Smallest retry hint SchedulerFull carries."""
    initial_step_s: float = Field(default=0.03, gt=0.0)
    """Step time assumed for retry hints until steps have been measured."""
    policy: Literal["continuous", "static"] = "continuous"
    """continuous: admit and retire sequences every step. static: request-level batching, the
    benchmark baseline (`inferd.kinds.llm.static_scheduler`): a batch is admitted only when nothing runs."""

    @model_validator(mode="after")
    def _decodes_leave_room(self) -> SchedulerConfig:
        if self.max_num_batched_tokens <= self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must exceed max_num_seqs "
                f"({self.max_num_seqs}) so a full set of decodes leaves room for prefill: raise "
                "max_num_batched_tokens or lower max_num_seqs"
            )
        return self

    @property
    def max_seq_tokens(self) -> int:
        return self.num_blocks * self.block_size


class SchedulerFull(Overloaded):
    """`add()` beyond the waiting bounds: nothing was queued; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float, limit: str) -> None:
        super().__init__(message, retry_after_s, reason="llm_queue_full")
        self.limit = limit


class ScheduledChunk(msgspec.Struct, gc=False):
    """Compute `token_ids` at positions `start`.. of one sequence, writing KV into `block_ids`. A
    msgspec Struct, not a dataclass: one is built per sequence per step, and a Struct is built in C at
    about a fifth of the cost (no field holds a container that could make a cycle, so gc=False)."""

    seq_id: str
    start: int
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    samples: bool
    """The chunk reaches the end of the sequence: the engine samples one token for it."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    step: int
    chunks: tuple[ScheduledChunk, ...]
    admitted: tuple[str, ...]
    preempted: tuple[str, ...]
    token_budget: int
    ids: frozenset[str] = frozenset()
    """The chunks' sequences (derived from `chunks`)."""
    prefills: frozenset[str] = frozenset()
    """Those whose chunk does not sample: a prompt still being computed (derived from `chunks`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", frozenset([c.seq_id for c in self.chunks]))
        object.__setattr__(self, "prefills", frozenset([c.seq_id for c in self.chunks if not c.samples]))

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def check_outputs(self, outputs: Mapping[str, SeqOutput]) -> None:
        """ValueError unless every output is for a scheduled chunk and tokens come only for chunks
        that sample. Set operations (C speed): it runs every step."""
        if not outputs.keys() <= self.ids:
            stray = sorted(outputs.keys() - self.ids)
            raise ValueError(f"output for {stray[0]!r}, which step {self.step} did not schedule")
        for seq_id in self.prefills & outputs.keys():
            if outputs[seq_id].token is not None:
                raise ValueError(f"token for {seq_id!r} in step {self.step}, whose chunk does not sample")


@dataclass(frozen=True, slots=True)
class SeqOutput:
    """What the engine reports for one chunk: the sampled token (only for a sampling chunk), and a
    finish reason if the sequence ends here (STOP with the stop token, or ERROR)."""

    token: int | None = None
    finish: FinishReason | None = None


@dataclass(slots=True)
class Delta:
    """What to stream for one sequence after a step (not frozen, like ScheduledChunk: one per token)."""

    seq_id: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None


@dataclass(slots=True)
class Recorded:
    """What one applied step streams. The common case, a sequence that got one token and goes on, is
    kept as two parallel lists (`ids[i]` got `tokens[i]`), with no object per token: at 128 sequences a
    step that is most of the engine's and the front end's work per token. `deltas`: the rest (the
    sequences that ended, with their last token if any)."""

    ids: list[str]
    tokens: list[int]
    deltas: list[Delta]

    def as_deltas(self) -> list[Delta]:
        """Every sequence's delta as one list (the single-token ones first)."""
        return [*(Delta(i, (t,), None) for i, t in zip(self.ids, self.tokens, strict=True)), *self.deltas]


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    running: int
    waiting: int
    waiting_prompt_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_usage: float
    prefix_hit_tokens: int
    prefix_query_tokens: int
    prefix_hit_ratio: float
    preemptions: int
    steps: int
    finished: int
    aborted: int
    errored: int
