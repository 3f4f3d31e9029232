"""LLM token generation: the continuous-batching scheduler (pure) and its block-based KV cache.

The engine loop around the scheduler (receive -> schedule -> run -> deliver) does the I/O.
"""

from inferd.llm.kv import BlockPool, KVCacheManager, hash_block
from inferd.llm.plan import (
    Delta,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerFull,
    SchedulerStatistics,
    SeqOutput,
    StepPlan,
)
from inferd.llm.scheduler import LLMScheduler
from inferd.llm.sequence import BULK, INTERACTIVE, FinishReason, SeqStatus, Sequence

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
