"""The paged KV cache's bookkeeping: block ids, reference counts, prefix caching.

Torch-free: this module only hands out block *ids*; the model runner owns the
tensors. Each block holds ``block_size`` consecutive positions of one sequence.

Prefix caching: once every position of a block is computed, the block is
registered under the hash of its *content chain* (the parent block's hash and
this block's token ids), so a block is only ever matched by a sequence whose
whole prefix up to and including that block is identical. A block whose last
reference goes away stays registered ("cached-free") and can be matched again
until it is evicted, least-recently-used first, to make room for a new block.

Accounting (the numbers :meth:`BlockManager.stats` reports):

* ``blocks_free``: blocks with no reference, i.e. allocatable. This includes
  the cached-free ones, so when no sequence is alive ``blocks_free ==
  blocks_total`` whatever the cache holds.
* ``blocks_cached``: blocks registered in the prefix cache (in use or not);
  ``blocks_cached_free`` is the part of them nobody references.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from tokenrelay.engine.scheduling.sequence import Sequence

_ROOT_HASH = 0x7F4A7C15  # the "parent hash" of a sequence's first block


class BlockManager:
    """A fixed pool of ``num_blocks`` KV blocks shared by all sequences."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        # Invariant: a block with refcount 0 is in exactly one of _free (not
        # registered) or _evictable (registered, LRU order: oldest first).
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_query_tokens = 0

    # ------------------------------------------------------------------ sizes
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> dict[str, int]:
        return {
            "blocks_total": self.num_blocks,
            "blocks_free": self.num_free_blocks,
            "blocks_cached": self.num_cached_blocks,
            "blocks_cached_free": len(self._evictable),
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": self.prefix_cache_query_tokens,
        }

    # ---------------------------------------------------------------- hashing
    def _ensure_hashes(self, seq: Sequence, num_blocks: int) -> None:
        """Fill ``seq.block_hashes`` for its first ``num_blocks`` (full) blocks."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else _ROOT_HASH
            hashes.append(hash((parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))))

    def _block_tokens_of(self, seq: Sequence, index: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(seq.token_ids[index * bs : (index + 1) * bs])

    # ------------------------------------------------------------- admission
    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding the longest prefix of ``seq`` (nothing is taken).

        Never the whole sequence: at least one token is left to compute, so the
        step has a logit to sample from.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        self._ensure_hashes(seq, limit)
        hit: list[int] = []
        for i in range(limit):
            block = self._hash_to_block.get(seq.block_hashes[i])
            if block is None or self._block_tokens[block] != self._block_tokens_of(seq, i):
                break
            hit.append(block)
        return hit

    def will_cache_more(self, seq: Sequence, other: Sequence, hit: int) -> bool:
        """Whether ``other``, still computing, will cache the block of ``seq`` after its
        ``hit`` cached ones (a fork of the same prompt waits for it: no prefill twice)."""
        bs = self.block_size
        if not self.enable_prefix_caching or other.num_computed_tokens >= (hit + 1) * bs:
            return False  # computed blocks are already in the cache (or never will be)
        if (seq.num_tokens - 1) // bs <= hit or other.num_tokens // bs <= hit:
            return False
        self._ensure_hashes(seq, hit + 1)
        self._ensure_hashes(other, hit + 1)
        return seq.block_hashes[hit] == other.block_hashes[hit]  # a chain: all before match

    def num_free_blocks_after(self, hit: Iterable[int]) -> int:
        """Free blocks left for fresh allocations once ``hit`` is taken."""
        return self.num_free_blocks - sum(1 for b in hit if self._ref[b] == 0)

    def take_prefix(self, seq: Sequence, hit: list[int]) -> None:
        """Give ``seq`` the cached blocks ``hit`` (from :meth:`match_prefix`)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block in hit:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
        seq.block_table = list(hit)
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_registered_blocks = len(hit)
        seq.num_cached_tokens = seq.num_computed_tokens
        if self.enable_prefix_caching:
            self.prefix_cache_hit_tokens += seq.num_computed_tokens
            self.prefix_cache_query_tokens += seq.num_tokens

    # ------------------------------------------------------------ allocation
    def appendable_tokens(self, seq: Sequence, free_blocks: int | None = None) -> int:
        """How many more tokens ``seq`` could compute with its blocks plus the free ones."""
        free = self.num_free_blocks if free_blocks is None else free_blocks
        capacity = (len(seq.block_table) + free) * self.block_size
        return max(0, capacity - seq.num_computed_tokens)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        needed = self.blocks_for(seq.num_computed_tokens + num_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_tokens`` more computed tokens."""
        needed = self.blocks_for(seq.num_computed_tokens + num_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {needed}, have {self.num_free_blocks}")
        for _ in range(needed):
            seq.block_table.append(self._pop_free_block())

    def _pop_free_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # evict the least recently used cached-free block
            block, _ = self._evictable.popitem(last=False)
            block_hash = self._block_hash[block]
            assert block_hash is not None
            del self._hash_to_block[block_hash]
            self._block_hash[block] = None
            self._block_tokens[block] = None
        assert self._ref[block] == 0
        self._ref[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; registered blocks stay cached until evicted."""
        # Reverse order: a sequence's tail blocks become the least recently
        # used, so they are evicted before the prefix others may share.
        for block in reversed(seq.block_table):
            if self._ref[block] <= 0:
                raise RuntimeError(f"double free of KV block {block}")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    # ----------------------------------------------------------- registration
    def register_computed(self, seq: Sequence) -> None:
        """Register ``seq``'s full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        self._ensure_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = seq.block_table[i]
            block_hash = seq.block_hashes[i]
            if self._block_hash[block] is None and block_hash not in self._hash_to_block:
                self._hash_to_block[block_hash] = block
                self._block_hash[block] = block_hash
                self._block_tokens[block] = self._block_tokens_of(seq, i)
            # else: cached already, or the same content went into another block first
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block (blocks in use stay registered); returns how many."""
        dropped = 0
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            block_hash = self._block_hash[block]
            assert block_hash is not None
            del self._hash_to_block[block_hash]
            self._block_hash[block] = None
            self._block_tokens[block] = None
            self._free.append(block)
            dropped += 1
        return dropped

    # ------------------------------------------------------------------ checks
    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Assert the pool is consistent with the block tables of ``live`` sequences."""
        expected = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                expected[block] += 1
        assert expected == self._ref, "refcounts disagree with block tables"
        free = list(self._free)
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(free) & set(self._evictable), "a block is both free and evictable"
        unreferenced = {b for b in range(self.num_blocks) if self._ref[b] == 0}
        assert unreferenced == set(free) | set(self._evictable), "a free block went missing"
        used = self.num_blocks - len(unreferenced)
        assert used + self.num_free_blocks == self.num_blocks
        for block_hash, block in self._hash_to_block.items():
            assert self._block_hash[block] == block_hash
        assert all(self._block_hash[b] is not None for b in self._evictable)
        assert all(self._block_hash[b] is None for b in free)
