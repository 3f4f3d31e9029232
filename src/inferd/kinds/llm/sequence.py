"""One generation request as the scheduler sees it: token ids in, token ids out."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from inferd.kinds.llm.kv import BlockHash, hash_blocks
from inferd.routing.fairness import BULK, INTERACTIVE

__all__ = ["BULK", "INTERACTIVE", "FinishReason", "SeqStatus", "Sequence"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    """Its blocks were taken back; it waits at the head of its class to recompute them."""
    FINISHED = "finished"
    ABORTED = "aborted"
    ERRORED = "errored"

    TERMINAL: frozenset[SeqStatus]


SeqStatus.TERMINAL = frozenset({SeqStatus.FINISHED, SeqStatus.ABORTED, SeqStatus.ERRORED})


class FinishReason(enum.Enum):
    STOP = "stop"
    """The engine saw a stop token or string."""
    LENGTH = "length"
    """max_tokens reached."""
    ABORT = "abort"
    """The client went away."""
    ERROR = "error"
    """The model failed on this sequence."""

    @property
    def status(self) -> SeqStatus:
        return _STATUS_OF[self]


_STATUS_OF = {
    FinishReason.STOP: SeqStatus.FINISHED,
    FinishReason.LENGTH: SeqStatus.FINISHED,
    FinishReason.ABORT: SeqStatus.ABORTED,
    FinishReason.ERROR: SeqStatus.ERRORED,
}


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    tenant: str = ""
    """The prefix-cache salt: sequences of different tenants never share blocks."""
    priority: int = INTERACTIVE
    """INTERACTIVE (0) or BULK (1)."""
    arrival: int = 0
    """Order of `add()`; FIFO within a tenant's lane of a priority class."""
    output: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0
    """Tokens whose KV is in the cache (prompt and output together)."""
    admitted: int = -1
    """Order of the latest admission into the running set (preemption takes the latest first)."""
    preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Names of the full blocks of prompt + output, extended as tokens arrive."""
    weight: float = 1.0
    """The tenant's weight: its share of admissions while other tenants wait too (kinds/llm/waiting.py)."""
    blocks: tuple[int, ...] = ()
    """Its KV block table while it runs (the scheduler copies KVCacheManager's whenever it changes)."""
    room: int = 0
    """Tokens its block table holds (`hold`). This and `named` are plain ints so that the per-token
    checks read the Sequence alone: at 100 devices in one process, touching its lists was most of
    their cost."""
    named: int = 0
    """Tokens of prompt + output whose blocks are named (len(block_hashes) * block_size)."""
    prompt_len: int = field(init=False, default=0)
    """len(prompt), kept: the scheduler asks for `num_tokens` of every sequence every step."""

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output)

    @property
    def num_pending(self) -> int:
        """Tokens to compute before the next token can be sampled (1 while decoding)."""
        return self.num_tokens - self.num_computed

    def token_ids(self, start: int, stop: int) -> tuple[int, ...]:
        n = self.prompt_len
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return tuple(self.output[start - n : stop - n])
        return (*self.prompt[start:], *self.output[: stop - n])

    def hold(self, blocks: tuple[int, ...], block_size: int) -> None:
        """Its block table is now `blocks` (() once freed)."""
        self.blocks = blocks
        self.room = len(blocks) * block_size

    def extend_hashes(self, block_size: int) -> None:
        """Name the full blocks of prompt + output not named yet (each block once, when it fills)."""
        hashes = self.block_hashes
        named = len(hashes) * block_size
        full = (self.prompt_len + len(self.output)) // block_size * block_size
        if full > named:
            parent = hashes[-1] if hashes else None
            hashes += hash_blocks(parent, self.token_ids(named, full), self.tenant, block_size)
        self.named = len(hashes) * block_size
