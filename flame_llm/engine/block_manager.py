"""Paged KV blocks with a chained-hash prefix cache.

A block's hash is published only after its K/V are written (publish() runs after the step), a hit
compares token ids as well as the hash, and a prompt never hits its last token: hits cover only
full blocks that end before it, so the last token is always computed and yields logits.

Free blocks live in one ordered map, front reused first. Default (FIFO): a freed block joins the back,
so the oldest-freed block is reused first whether or not it holds a cached prefix. With enable_lru the
map is an LRU over cached blocks bounded by the pool: a freed block that holds a published hash joins
the back (most recent), one that holds none goes to the front, so an allocation evicts a cached block
only when no uncached free block is left, and then the least recently released one. A request's
blocks are released last-first, so its shared head blocks outlive its tail. A hit revives a free
block in O(1) wherever it sits.

The chain starts from hash_seed (-1 by default; the engine passes the model revision's seed with
enable_kv_events, so a block's hash is the routing key's: flame_llm/protocol/routing_key.py). With
enable_kv_events every hash entering or leaving the cache (hash_to_block_id) is recorded in order in
kv_events, (hash, True) stored and (hash, False) evicted, None for a cleared cache; the serving layer
drains it (flame_llm/protocol/kv_events.py). A record nobody drains (an offline engine) is bounded: past
KV_EVENTS_MAX entries it is replaced by None, and the reader takes a snapshot. Off, nothing is recorded."""
from __future__ import annotations

from collections import OrderedDict, deque

from flame_llm.engine.sequence import Sequence
from flame_llm.prefix import hash_block

KV_EVENTS_MAX = 1 << 16  # recorded cache events kept undrained before the record collapses to "take a snapshot"


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_lru: bool = False, enable_kv_events: bool = False, hash_seed: int = -1) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_lru = enable_lru
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # free blocks; new blocks come from the front (see the module doc for the order)
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_hit_tokens = 0
        self.num_query_tokens = 0
        self.num_evictions = 0
        self.hash_seed = hash_seed
        # enable_kv_events: (hash, stored) as hashes enter or leave hash_to_block_id, None for a clear; else None
        self.kv_events: deque[tuple[int, bool] | None] | None = deque() if enable_kv_events else None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the cached full blocks that start seq (never covering its last token)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        h = -1
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block(i)
            h = self.block_hash(seq, i, h)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def block_hash(self, seq: Sequence, i: int, prev: int) -> int:
        """Chained hash of seq's full block i given block i-1's hash; prompt blocks are hashed once."""
        memo = seq.prompt_block_hashes
        if i < len(memo):
            return memo[i]
        h = hash_block(seq.block(i), prev if i else self.hash_seed)
        if i == len(memo) and (i + 1) * self.block_size <= seq.num_prompt_tokens:
            memo.append(h)
        return h

    def next_block_hash(self, seq: Sequence, cached: int) -> int | None:
        """Hash of seq's first block past `cached` tokens, if seq could still hit it (a full block
        ending before its last token); else None."""
        k = cached // self.block_size
        if not self.enable_prefix_caching or k >= (seq.num_tokens - 1) // self.block_size:
            return None
        h = -1
        for i in range(k + 1):  # memoized for prompt blocks after the first call
            h = self.block_hash(seq, i, h)
        return h

    def add_unpublished_prompt_hashes(self, seq: Sequence, out: set[int]) -> None:
        """Add the hashes of seq's full prompt blocks that are not published yet (it will write them)."""
        if not self.enable_prefix_caching:
            return
        h = seq.last_block_hash
        for i in range(seq.num_published_blocks, seq.num_prompt_tokens // self.block_size):
            h = self.block_hash(seq, i, h)
            out.add(h)

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """match_prefix's length by hashes alone: cheap enough to rank a queue every step (an
        allocation still compares token ids)."""
        if not self.enable_prefix_caching:
            return 0
        h, n = -1, 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            h = self.block_hash(seq, i, h)
            if h not in self.hash_to_block_id:
                break
            n += 1
        return n * self.block_size

    def can_allocate(self, seq: Sequence) -> int:
        """Cached tokens seq would start with if its prompt can be allocated now, else -1."""
        hits = self.match_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = seq.num_blocks - len(hits) + revived
        return len(hits) * self.block_size if needed <= len(self.free_block_ids) else -1

    def allocation_room(self, seq: Sequence) -> tuple[int, int]:
        """(cached tokens seq would start with, tokens past them the free pool could then hold)."""
        hits = self.match_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return len(hits) * self.block_size, (len(self.free_block_ids) - revived) * self.block_size

    def allocate(self, seq: Sequence) -> None:
        """Attach the cached prefix blocks; the blocks for tokens to compute come from append_slots."""
        assert not seq.block_table
        hits = self.match_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        cached = len(hits) * self.block_size
        seq.num_computed_tokens = cached
        seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
        seq.num_published_blocks = len(hits)
        seq.last_block_hash = self.blocks[hits[-1]].hash if hits else -1
        if self.enable_prefix_caching:
            self.num_hit_tokens += seq.num_cached_tokens
            self.num_query_tokens += seq.num_prompt_tokens

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != -1:
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
                self.num_evictions += 1
                if self.kv_events is not None:
                    self.kv_events.append((block.hash, False))
            block.hash = -1
            block.token_ids = []
        block.ref_count = 1
        return block_id

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = (seq.num_computed_tokens + num_new_tokens + self.block_size - 1) // self.block_size
        return max(0, total - len(seq.block_table))

    def num_appendable_tokens(self, seq: Sequence) -> int:
        """How many of seq's next tokens its blocks plus the whole free pool could hold."""
        return (len(seq.block_table) + len(self.free_block_ids)) * self.block_size - seq.num_computed_tokens

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_block_ids)

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Make the block table cover the next num_new_tokens tokens to compute."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def publish(self, seq: Sequence, upto: int | None = None) -> None:
        """Register the hashes of seq's full blocks below `upto` tokens (default: its computed ones) whose
        token ids are all known. Their K/V must be written by a step that runs before, or is, any step
        that reads them: each layer stores a step's K/V before it attends, so a request scheduled in the
        same step as the one computing its prefix may share those blocks."""
        upto = seq.num_computed_tokens if upto is None else upto
        full = min(upto, seq.num_tokens) // self.block_size
        if not self.enable_prefix_caching or full <= seq.num_published_blocks:
            return
        h, events = seq.last_block_hash, self.kv_events
        for i in range(seq.num_published_blocks, full):
            tokens = seq.block(i)
            h = self.block_hash(seq, i, h)
            if events is not None and h not in self.hash_to_block_id:
                events.append((h, True))
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, tokens
            self.hash_to_block_id[h] = block.block_id
        seq.last_block_hash = h
        seq.num_published_blocks = full
        if events is not None and len(events) > KV_EVENTS_MAX:  # nobody drains it: a snapshot will do
            events.clear()
            events.append(None)

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if self.enable_lru and not self.is_cached(block):
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0
        seq.last_block_hash = -1

    def is_cached(self, block: Block) -> bool:
        return block.hash != -1 and self.hash_to_block_id.get(block.hash) == block.block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached block and restore the initial free order; all blocks must be free."""
        assert self.num_free_blocks == self.num_blocks, "reset_prefix_cache needs every block free"
        for block in self.blocks:
            block.hash, block.token_ids = -1, []
        self.hash_to_block_id.clear()
        if self.kv_events is not None:
            self.kv_events.append(None)
        self.free_block_ids = OrderedDict.fromkeys(range(self.num_blocks))

    def reset_stats(self) -> None:
        self.num_hit_tokens = self.num_query_tokens = self.num_evictions = 0

    def stats(self) -> dict:
        return {"num_blocks": self.num_blocks, "num_free_blocks": self.num_free_blocks,
                "prefix_hit_tokens": self.num_hit_tokens, "prefix_query_tokens": self.num_query_tokens,
                "evictions": self.num_evictions}
