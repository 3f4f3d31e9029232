"""Which worker of an LLM model gets a new sequence: prefix-cache affinity under a hard load cap.

A plain object with an injected clock and no I/O; the LLMRuntime drives it.

* The front end names a prompt's full blocks exactly as the worker's scheduler does (`hash_block`,
  chained, salted with the tenant, the model's `params.scheduler.block_size`), and remembers for a while
  which worker was sent which blocks (bounded per worker, least recently sent forgotten first; entries
  older than `affinity_ttl_s` no longer count, since the worker may have evicted them).
* With zones (routing/locality.py), the placement passes the workers grouped by zone, in the order the zone
  routing gives (`pick_first`): the rules below apply within the first zone with room, so prefix affinity
  and the load cap hold within a zone first.
* A worker may take the sequence only if its health is routable (routing.health: READY or PROBING) and
  its engine would accept it: its sequences not yet admitted stay under `max_waiting_seqs` and their
  prompt tokens under `max_waiting_prompt_tokens` (the engine's own bounds; see LLMRuntime). None fits
  -> None (a 429).
* Among those, only workers whose load after taking the sequence stays within the cap count:
      cap = max(min_load + max_extra_seqs, floor(min_load * max_load_ratio))
  where load is live sequences and min_load is the least-loaded candidate's. The least-loaded worker
  is always within the cap, so affinity can skew load by at most the cap and never builds a hot spot.
* Within the cap: the healthier worker wins (READY over PROBING), then the longest remembered prefix,
  then the prompt's home worker, then the lower load, then fewer queued prompt tokens, then the order
  given. With all workers READY and no full block in the prompt this is plain least-loaded.
* The home worker of a prompt is the candidate that ranks first by rendezvous hashing of its first
  block's name with the worker ids (`home`): computed, not remembered, so every front end of a server
  (`--frontends N`, each with its own memory) sends prompts that share a first block to the same
  worker, and a worker that leaves moves only its own prompts.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import msgspec
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from inferd.clock import Clock
from inferd.kinds.llm.kv import BlockHash, hash_blocks
from inferd.kinds.llm.plan import SchedulerConfig
from inferd.routing.health import Health


class RoutingConfig(BaseModel):
    """How an LLM model's front end spreads sequences over its workers (`params.routing`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefix_affinity: bool = True
    """Prefer the worker that holds the longest cached prefix (off: least-loaded only)."""
    max_extra_seqs: int = Field(default=4, ge=1)
    """A worker chosen for its cache may run this many more sequences than the least-loaded one."""
    max_load_ratio: float = Field(default=1.25, ge=1.0)
    """... or up to this multiple of the least-loaded worker's sequences, whichever is larger."""
    remembered_blocks: int | None = Field(default=None, ge=1)
    """Block names remembered per worker; default: the worker's KV pool size (it caches no more)."""
    affinity_ttl_s: float = Field(default=60.0, gt=0.0)
    """A block sent this long ago no longer counts as cached on its worker."""


class WorkerLoad(msgspec.Struct, frozen=True, gc=False):
    """What the router needs to know about one worker at the moment of choosing (a msgspec Struct: one
    is built per worker per request, in C)."""

    worker_id: str
    health: Health
    live_seqs: int
    """Sequences the front end has placed there and not yet seen end."""
    waiting_seqs: int = 0
    """Of those, sent but not yet admitted by its engine (the engine's waiting queue, as of now)."""
    waiting_prompt_tokens: int = 0
    """Prompt tokens of the waiting ones."""


@dataclass(frozen=True, slots=True)
class Choice:
    worker_id: str
    cached_blocks: int
    """Leading blocks of the prompt the worker was recently sent (0: chosen by load alone)."""
    capped: bool
    """A worker with a longer cached prefix was passed over because of the load cap."""


@dataclass(frozen=True, slots=True)
class RoutingStatistics:
    choices: int
    affinity_hits: int
    """Choices that went to a worker with a cached prefix."""
    capped: int
    """Choices where the cap overruled affinity."""
    load_ties: int
    """Choices where the chosen worker's load equalled another candidate's (is the load signal working?)."""
    full: int
    """Requests no routable worker had room for."""


_M64 = (1 << 64) - 1
_by_load = attrgetter("live_seqs", "waiting_prompt_tokens")


_KEYS: dict[str, int] = {}
"""Worker id -> its 64-bit rendezvous key (cleared past 4,096 ids)."""


def _worker_key(worker_id: str) -> int:
    key = _KEYS.get(worker_id)
    if key is None:
        if len(_KEYS) >= 4096:
            _KEYS.clear()
        key = _KEYS[worker_id] = int.from_bytes(
            hashlib.blake2b(worker_id.encode(), digest_size=8).digest(), "little"
        )
    return key


def home(worker_ids: Sequence[str], block: BlockHash) -> str | None:
    """Rendezvous hashing: the worker whose score with the block's name is highest (the same in every
    process: no salted hash()). The score is splitmix64's finaliser over the worker's key xor the block's:
    well mixed, integer arithmetic only (a blake2b per worker per request cost 5x as much). It runs for
    every worker for every request: inline below `_VECTOR_FROM` workers, else on numpy's uint64 arrays
    (the same scores: their products wrap modulo 2**64 as `& _M64` does; 13 us against 37 us for 100)."""
    block_key = int.from_bytes(block[:8], "little")
    keys = _KEYS
    if len(worker_ids) >= _VECTOR_FROM:
        x = np.array([keys.get(w) or _worker_key(w) for w in worker_ids], dtype=np.uint64)
        x ^= np.uint64(block_key)
        x ^= x >> _S30
        x *= _MUL1
        x ^= x >> _S27
        x *= _MUL2
        x ^= x >> _S31
        return worker_ids[int(x.argmax())]  # the first of the highest, as the loop below
    best: str | None = None
    best_score = -1
    for worker_id in worker_ids:
        x = (keys.get(worker_id) or _worker_key(worker_id)) ^ block_key
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        x ^= x >> 31
        if x > best_score:
            best, best_score = worker_id, x
    return best


_VECTOR_FROM = 24
"""Workers from which `home` scores them with numpy (below it, the loop is faster than the arrays)."""
_MUL1, _MUL2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


class PrefixAffinityRouter:
    def __init__(self, config: RoutingConfig, scheduler: SchedulerConfig, clock: Clock) -> None:
        self.config = config
        self.scheduler = scheduler
        self.clock = clock
        self.block_size = scheduler.block_size
        self.capacity = config.remembered_blocks or scheduler.num_blocks
        self._sent: dict[str, OrderedDict[BlockHash, float]] = {}
        """Per worker: block name -> when it was last sent there, least recently sent first."""
        self._first: dict[BlockHash, set[str]] = {}
        """A prompt's first block -> the workers whose `_sent` holds it: most requests' prompts were
        sent to no worker or one, settled in one lookup however many workers there are."""
        self._choices = self._hits = self._capped = self._ties = self._full = 0

    # ---- naming prompts -----------------------------------------------------------------------------
    def block_hashes(self, prompt: Sequence[int], tenant: str) -> list[BlockHash]:
        """The names the worker's scheduler gives the prompt's full blocks (Sequence.extend_hashes)."""
        if not (self.config.prefix_affinity and self.scheduler.enable_prefix_caching):
            return []
        return hash_blocks(None, prompt, tenant, self.block_size)

    # ---- choosing -----------------------------------------------------------------------------------
    def has_room(self, w: WorkerLoad, prompt_tokens: int) -> bool:
        """Whether the worker's engine would queue one more sequence of `prompt_tokens` tokens."""
        s = self.scheduler
        return (
            w.waiting_seqs < s.max_waiting_seqs
            and w.waiting_prompt_tokens + prompt_tokens <= s.max_waiting_prompt_tokens
        )

    def cap(self, min_load: int) -> int:
        """The most live sequences a worker may hold after taking one chosen for its cache."""
        c = self.config
        return max(min_load + c.max_extra_seqs, math.floor(min_load * c.max_load_ratio))

    def pick(
        self, workers: Sequence[WorkerLoad], hashes: Sequence[BlockHash], prompt_tokens: int
    ) -> Choice | None:
        """The worker for a new sequence, or None when no routable worker has room for it."""
        return self.pick_first((workers,), hashes, prompt_tokens)

    def pick_first(
        self, groups: Sequence[Sequence[WorkerLoad]], hashes: Sequence[BlockHash], prompt_tokens: int
    ) -> Choice | None:
        """`pick` in the first group with a worker that has room (zones in the order zone routing gives:
        affinity and the load cap apply within a zone first); None when none has."""
        for workers in groups:
            choice = self._pick(workers, hashes, prompt_tokens)
            if choice is not None:
                return choice
        self._full += 1
        return None

    def _pick(
        self, workers: Sequence[WorkerLoad], hashes: Sequence[BlockHash], prompt_tokens: int
    ) -> Choice | None:
        """The rule of the module docstring, in a few passes over the workers (it runs for every request)."""
        s = self.scheduler
        max_seqs, max_tokens = s.max_waiting_seqs, s.max_waiting_prompt_tokens - prompt_tokens
        routable = Health.ROUTABLE
        candidates = [
            w
            for w in workers
            if w.health in routable and w.waiting_seqs < max_seqs and w.waiting_prompt_tokens <= max_tokens
        ]
        if not candidates:
            return None
        loads = [w.live_seqs for w in candidates]
        limit = self.cap(min(loads))
        within = [w for w in candidates if w.live_seqs < limit]  # has the least loaded
        cached = self._cached_all(candidates, hashes)
        if cached is None:  # no candidate holds the first block: the healthiest within the cap tie on 0
            health = max([w.health for w in within])
            tied = [w for w in within if w.health == health]
            best_n, capped = 0, False
        else:
            top = max((w.health, n) for w, n in zip(candidates, cached, strict=True) if w.live_seqs < limit)
            tied = [
                w
                for w, n in zip(candidates, cached, strict=True)
                if w.live_seqs < limit and (w.health, n) == top
            ]
            best_n = top[1]
            capped = any(n > best_n and w.live_seqs >= limit for n, w in zip(cached, candidates, strict=True))
        home_id = home([w.worker_id for w in within], hashes[0]) if hashes and len(tied) > 1 else None
        best = next((w for w in tied if w.worker_id == home_id), None) or min(tied, key=_by_load)
        self._count(best, best_n, capped, loads)
        return Choice(best.worker_id, best_n, capped)

    def _count(self, best: WorkerLoad, cached: int, capped: bool, loads: list[int]) -> None:
        self._choices += 1
        self._hits += cached > 0
        self._capped += capped
        self._ties += loads.count(best.live_seqs) > 1  # another candidate has the chosen one's load

    def _cached_all(self, candidates: list[WorkerLoad], hashes: Sequence[BlockHash]) -> list[int] | None:
        """`_cached` of each candidate; None when none holds the prompt's first block (most requests,
        settled in one lookup)."""
        if not hashes:
            return None
        holders = self._first.get(hashes[0])
        if not holders:
            return None
        now = self.clock.now()
        return [self._cached(w.worker_id, hashes, now) if w.worker_id in holders else 0 for w in candidates]

    def _cached(self, worker_id: str, hashes: Sequence[BlockHash], now: float) -> int:
        """Leading blocks of `hashes` sent to the worker within the TTL."""
        sent = self._sent.get(worker_id)
        if not sent:
            return 0
        n = 0
        for h in hashes:
            at = sent.get(h)
            if at is None or now - at > self.config.affinity_ttl_s:
                break
            n += 1
        return n

    # ---- remembering ---------------------------------------------------------------------------------
    def record(self, worker_id: str, hashes: Sequence[BlockHash]) -> None:
        """The worker was sent a sequence with these blocks: it will compute and cache them."""
        if not hashes:
            return
        sent = self._sent.setdefault(worker_id, OrderedDict())
        now = self.clock.now()
        for h in hashes:
            sent[h] = now
            sent.move_to_end(h)
        self._first.setdefault(hashes[0], set()).add(worker_id)
        while len(sent) > self.capacity:
            self._unhold(sent.popitem(last=False)[0], worker_id)

    def _unhold(self, block: BlockHash, worker_id: str) -> None:
        holders = self._first.get(block)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._first[block]

    def forget(self, worker_id: str) -> None:
        """The worker is gone (its cache with it)."""
        for block in self._sent.pop(worker_id, ()):
            self._unhold(block, worker_id)

    def remembered(self, worker_id: str) -> int:
        return len(self._sent.get(worker_id, ()))

    def statistics(self) -> RoutingStatistics:
        return RoutingStatistics(self._choices, self._hits, self._capped, self._ties, self._full)
