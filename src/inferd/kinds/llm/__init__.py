"""LLM token generation: the continuous-batching scheduler (pure) and its block-based KV cache.

The engine loop around the scheduler (receive -> schedule -> run -> deliver) does the I/O.
"""

from inferd.kinds.llm.kv import BlockPool, KVCacheManager, hash_block
from inferd.kinds.llm.plan import (
    Delta,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerFull,
    SchedulerStatistics,
    SeqOutput,
    StepPlan,
)
from inferd.kinds.llm.scheduler import LLMScheduler
from inferd.kinds.llm.sequence import BULK, INTERACTIVE, FinishReason, SeqStatus, Sequence

__all__ = [
    "BULK",
    "INTERACTIVE",
    "BlockPool",
    "Delta",
    "FinishReason",
    "KVCacheManager",
    "LLMScheduler",
    "ScheduledChunk",
    "SchedulerConfig",
    "SchedulerFull",
    "SchedulerStatistics",
    "SeqOutput",
    "SeqStatus",
    "Sequence",
    "StepPlan",
    "hash_block",
]
