"""A shard's prefix-cache events for the router: what its BlockManager stored and evicted, as sequence-numbered
batches (issue 42).

The BlockManager (enable_kv_events) records each hash entering or leaving its cache in order; a KvEventLog
drains that record into a KvEventBatch: the net change since the batch before (a hash stored and evicted
within one batch appears in neither list or in the one it ended in), numbered 1, 2, ... under the log's
epoch (a restarted engine has a new one). Applying a batch is idempotent set arithmetic, so a snapshot taken
while the engine runs, followed by the batches after it, gives the shard's holdings.

A None in the record (a cleared cache, or a record that overflowed undrained) makes the batch a reset: every
hash held when it is cut. The log keeps the last `keep` batches, so several readers (router replicas) can
each follow it with their own cursor (`read(epoch, after_seq)`); a reader whose cursor is older than that,
or of another epoch, gets one snapshot batch (reset=True: every hash held) and continues from its seq. The
hashes are the routing key's (flame_llm/protocol/routing_key.py): the block hash chain seeded with the model
revision.

Load (router.load_view 'engines'): a log given the scheduler's `sequences` (AsyncEngine.sequences) answers a read
`with_load` with the shard's ShardLoad on the last batch it returns. Such a read always cuts a batch, an empty one
when nothing changed, so each load has a stamp (epoch, seq) newer than the one before; only the returned copy of the
batch carries the load (the kept one does not: another reader gets its own fresh load, not this one). A read without
it is what it was before loads existed."""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from flame_llm.protocol.routing_key import estimate_prefill_work

if TYPE_CHECKING:  # the router imports this module: no engine at run time
    from flame_llm.engine.block_manager import BlockManager
    from flame_llm.engine.sequence import Sequence


class ShardLoad(NamedTuple):
    """A shard's own load (router.load_view 'engines'): what its waiting and running requests still need."""
    prefill_work: float  # estimate_prefill_work of the prompt tokens not computed yet (cached ones count as computed)
    decode_tokens: int  # tokens still to decode
    rows: int = 0  # requests waiting or running


def shard_load(seqs: Iterable[Sequence]) -> ShardLoad:
    """The ShardLoad of a scheduler's waiting and running sequences."""
    work, dec, rows = 0.0, 0, 0
    for s in seqs:
        if s.num_computed_tokens < s.num_prompt_tokens:
            work += estimate_prefill_work(s.num_prompt_tokens, s.num_computed_tokens)
        dec += s.max_tokens - s.num_completion_tokens
        rows += 1
    return ShardLoad(work, dec, rows)


@dataclass(slots=True, frozen=True)
class KvEventBatch:
    """One shard's cache changes since its batch seq - 1 (reset=False), or its whole holdings (reset=True: the
    reader replaces what it knows of the shard by `stored`)."""
    shard: int
    epoch: int  # the log's incarnation: a batch of another epoch than the reader's cursor forces a resync
    seq: int  # 1, 2, ... per epoch; a reader at seq k needs k + 1 next, else a snapshot
    stored: list[int]  # block hashes the shard holds now that it did not at seq - 1
    removed: list[int]  # block hashes it held at seq - 1 and no longer holds
    reset: bool = False  # stored is everything it holds (a snapshot, or a cache cleared in this batch)
    load: ShardLoad | None = None  # the shard's load when the batch was cut (None: not reported)


class KvEventLog:
    """The event feed of one shard's BlockManager (built with enable_kv_events)."""

    def __init__(self, shard: int, block_manager: BlockManager, keep: int = 64,
                 sequences: Callable[[], Iterable[Sequence]] | None = None) -> None:
        if block_manager.kv_events is None:
            raise ValueError("the block manager records no cache events; set enable_kv_events")
        if keep < 1:
            raise ValueError(f"keep must be >= 1; got {keep}")
        self.shard, self.bm, self.sequences = shard, block_manager, sequences
        self.epoch = time.time_ns()
        self.seq = 0
        self.batches: deque[KvEventBatch] = deque(maxlen=keep)
        self.lock = threading.Lock()  # readers (router replicas) may call read() from several threads at once

    def cut(self, force: bool = False) -> KvEventBatch | None:
        """The net change recorded since the last cut as the next batch (kept), or None when nothing changed (with
        `force`, an empty batch)."""
        events = self.bm.kv_events
        if not events and not force:
            return None
        stored: dict[int, None] = {}
        removed: dict[int, None] = {}
        reset = False
        while events:  # the engine thread may append meanwhile: popleft and append are thread-safe
            ev = events.popleft()
            if ev is None:
                stored.clear()
                removed.clear()
                reset = True
            elif ev[1]:
                removed.pop(ev[0], None)
                stored[ev[0]] = None
            else:
                stored.pop(ev[0], None)
                removed[ev[0]] = None
        self.seq += 1
        if reset:  # a cleared cache, or a record that overflowed: what it holds now
            stored = self.bm.hash_to_block_id
        batch = KvEventBatch(self.shard, self.epoch, self.seq, list(stored), [] if reset else list(removed), reset)
        self.batches.append(batch)
        return batch

    def snapshot(self) -> KvEventBatch:
        """Every hash the shard holds now, at this log's seq: changes recorded but not yet cut are in it and in the
        next batch too, which re-applies them harmlessly. Cuts nothing, so other readers' batches stay whole."""
        return KvEventBatch(self.shard, self.epoch, self.seq, list(self.bm.hash_to_block_id), [], True)

    def read(self, epoch: int, after_seq: int, with_load: bool = False) -> list[KvEventBatch]:
        """The batches after a reader's cursor (epoch, after_seq), or [snapshot] when they are not all kept. with_load:
        a batch is always cut, and the last one returned carries the shard's load (ValueError: this log has no
        `sequences` to compute it from)."""
        if with_load and self.sequences is None:
            raise ValueError("this shard's event log has no load source (the scheduler's sequences): with_load "
                             "needs an engine that publishes them")
        with self.lock:
            out = self._read(epoch, after_seq, with_load)
            if with_load:  # the load as of the cut in _read (out is never empty: that cut made a new batch)
                out[-1] = dataclasses.replace(out[-1], load=shard_load(self.sequences()))
        return out

    def _read(self, epoch: int, after_seq: int, force: bool) -> list[KvEventBatch]:
        self.cut(force)
        if epoch == self.epoch and after_seq == self.seq:
            return []
        first = self.batches[0].seq if self.batches else self.seq + 1
        if epoch != self.epoch or not first - 1 <= after_seq <= self.seq:
            return [self.snapshot()]  # after the cut above: nothing is pending
        return [b for b in self.batches if b.seq > after_seq]
