"""The block-based KV cache, as bookkeeping only: which blocks of the device pool each sequence holds,
and which full blocks are cached for reuse. No tensors, no I/O.

* The pool has `num_blocks` blocks of `block_size` tokens. A sequence holds
  ceil(tokens allocated / block_size) blocks; the pool is never exceeded.
* Prefix caching: a full block is named by a hash chained over (parent hash, the block's tokens,
  tenant salt). Equal names mean equal KV, so a new sequence reuses cached blocks of a matching prefix
  and skips their prefill. The salt keeps tenants apart: a tenant never hits another tenant's blocks.
* Blocks are reference counted. A block whose count drops to 0 goes to the free list but keeps its
  hash, so it can still be hit, until the pool needs it (least recently freed first).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes


_ROOT = b"\x00root"
_BIG_ENDIAN = sys.byteorder == "big"


def hash_block(parent: BlockHash | None, tokens: Sequence[int], salt: str) -> BlockHash:
    """The name of one full block: stable across processes (sha256, not Python's `hash`), over the
    parent's name, the salt and the token ids as 8-byte integers (half the cost of formatting them)."""
    ids = array("q", tokens)
    if _BIG_ENDIAN:  # the same names on every host
        ids.byteswap()
    data = b"".join((parent or _ROOT, salt.encode(), b"\x00", ids.tobytes()))
    return hashlib.sha256(data).digest()


def hash_blocks(
    parent: BlockHash | None, tokens: Sequence[int], salt: str, block_size: int
) -> list[BlockHash]:
    """The names of the full blocks of `tokens` (a partial last block is not named), chained from
    `parent`: `hash_block` block by block, with the ids packed once for all of them."""
    full = len(tokens) // block_size * block_size
    if full == block_size:  # one block (a decode filled it): `hash_block`, without the loop's setup
        return [hash_block(parent, tokens if full == len(tokens) else tokens[:full], salt)]
    ids = array("q", tokens if full == len(tokens) else tokens[:full])  # only what is named is packed
    if _BIG_ENDIAN:
        ids.byteswap()
    data = memoryview(ids).cast("B")
    salt_bytes = salt.encode() + b"\x00"
    width = block_size * ids.itemsize
    sha256, join = hashlib.sha256, b"".join
    out: list[BlockHash] = []
    for start in range(0, len(ids) * ids.itemsize, width):
        parent = sha256(join((parent or _ROOT, salt_bytes, data[start : start + width]))).digest()
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class BlockPoolStatistics:
    num_blocks: int
    free: int
    """Blocks no sequence holds (cached ones included: they are evicted on demand)."""
    cached: int
    """Blocks with a published hash, held or not."""
    evictions: int

    @property
    def used(self) -> int:
        return self.num_blocks - self.free

    @property
    def usage(self) -> float:
        return self.used / self.num_blocks


class BlockPool:
    """Per block: its reference count and its name (None: unnamed), in two flat lists. The free list
    is the never-used blocks (`_fresh` onwards, in id order) followed by the released ones (`_free`,
    least recently freed first): the never-used ones were free from the start, so they go first. A
    block that was never used costs nothing beyond its two list slots."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._fresh = 0
        """Blocks `_fresh`.. have never been allocated."""
        self._free: OrderedDict[int, None] = OrderedDict()
        """Released blocks with ref_count 0, least recently freed first (after the never-used ones)."""
        self._cached: dict[BlockHash, int] = {}
        self._evictions = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._fresh + len(self._free)

    def statistics(self) -> BlockPoolStatistics:
        return BlockPoolStatistics(self.num_blocks, self.num_free, len(self._cached), self._evictions)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free list."""
        refs = self._refs
        for bid in block_ids:
            if refs[bid] == 0:
                del self._free[bid]
            refs[bid] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, evicting the least recently freed cached ones. The caller checks room."""
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks: {self.num_free} free of {self.num_blocks}")
        fresh = min(n, self.num_blocks - self._fresh)
        out = list(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        refs, hashes, free = self._refs, self._hashes, self._free
        for bid in out:
            refs[bid] = 1
        for _ in range(n - fresh):
            bid, _ = free.popitem(last=False)
            block_hash = hashes[bid]
            if block_hash is not None:
                if self._cached.get(block_hash) == bid:
                    del self._cached[block_hash]
                hashes[bid] = None
                self._evictions += 1
            refs[bid] = 1
            out.append(bid)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Pass a sequence's blocks tail first: the tail is then
        evicted first, and the shared head of a prefix stays cached longest."""
        refs = self._refs
        for bid in block_ids:
            if refs[bid] <= 0:
                raise ValueError(f"block {bid} released more often than it was taken")
            refs[bid] -= 1
            if refs[bid] == 0:
                self._free[bid] = None

    def publish(self, block_id: int, block_hash: BlockHash) -> None:
        """Name a computed full block so later sequences can hit it. If another block already has
        the name (two sequences computed the same prefix at once), this one stays unnamed."""
        if self._hashes[block_id] is not None or block_hash in self._cached:
            return
        self._hashes[block_id] = block_hash
        self._cached[block_hash] = block_id


@dataclass(frozen=True, slots=True)
class PrefixHit:
    block_ids: tuple[int, ...]
    num_tokens: int
    held_free: int
    """How many of the hit blocks sit on the free list (taking them shrinks the free pool)."""


class KVCacheManager:
    """Per-sequence block tables over one BlockPool, with prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, tuple[int, ...]] = {}
        """Each sequence's block table, as handed to the model (rebuilt only when it grows)."""
        self._published: dict[str, int] = {}
        """How many leading blocks of each sequence have been named."""

    def blocks_of(self, seq_id: str) -> tuple[int, ...]:
        return self._tables.get(seq_id, ())

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> PrefixHit:
        """The longest cached prefix of a sequence of `num_tokens` tokens. At least one token is
        always left to compute (the model needs it to produce the next token)."""
        if not self.enable_prefix_caching:
            return PrefixHit((), 0, 0)
        limit = (num_tokens - 1) // self.block_size
        ids: list[int] = []
        for h in block_hashes[:limit]:
            bid = self.pool.lookup(h)
            if bid is None:
                break
            ids.append(bid)
        held_free = sum(1 for b in ids if self.pool.ref_count(b) == 0)
        return PrefixHit(tuple(ids), len(ids) * self.block_size, held_free)

    def can_admit(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Room for a new sequence that hits `hit` and then computes up to `num_tokens` tokens."""
        new = self.blocks_for(num_tokens) - len(hit.block_ids)
        return new + hit.held_free <= self.pool.num_free

    def admit(self, seq_id: str, hit: PrefixHit, num_tokens: int) -> bool:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if not self.can_admit(hit, num_tokens):
            return False
        self.pool.touch(hit.block_ids)
        new = self.blocks_for(num_tokens) - len(hit.block_ids)
        self._tables[seq_id] = (*hit.block_ids, *self.pool.allocate(new))
        self._published[seq_id] = len(hit.block_ids)
        return True

    def grow(self, seq_id: str, num_tokens: int) -> bool:
        """Make room for a held sequence to reach `num_tokens` tokens; False if the pool is short."""
        table = self._tables[seq_id]
        if num_tokens <= len(table) * self.block_size:  # the common case: its last block has room
            return True
        new = self.blocks_for(num_tokens) - len(table)
        if new > self.pool.num_free:
            return False
        self._tables[seq_id] = (*table, *self.pool.allocate(new))
        return True

    def publish_computed(self, seq_id: str, block_hashes: Sequence[BlockHash], num_computed: int) -> None:
        """Name the sequence's full blocks whose KV is now computed."""
        table = self._tables.get(seq_id)
        if table is None or not self.enable_prefix_caching:
            return
        full = min(num_computed // self.block_size, len(block_hashes), len(table))
        published = self._published[seq_id]
        if full <= published:
            return
        for i in range(published, full):
            self.pool.publish(table[i], block_hashes[i])
        self._published[seq_id] = full

    def free(self, seq_id: str) -> int:
        """Release every block the sequence holds (tail first); returns how many it held."""
        table = self._tables.pop(seq_id, None)
        self._published.pop(seq_id, None)
        if not table:
            return 0
        self.pool.release(table[::-1])
        return len(table)

    def held(self) -> int:
        return sum(len(t) for t in self._tables.values())
