"""The router's view of what each shard's prefix cache holds, kept from the shards' KvEventBatches
(flame_llm/protocol/kv_events.py): block hash -> the shards holding it.

A batch applies only in order: its epoch must be the shard's known one and its seq the next (one at or
before the cursor is already applied, say by a snapshot taken after it, and is skipped). Otherwise apply()
returns False and the caller asks that shard for a snapshot (a reset batch, always applied). A shard's
holdings are dropped when it restarts (its engine is cold)."""
from __future__ import annotations

from flame_llm.protocol.kv_events import KvEventBatch

_NONE: frozenset[int] = frozenset()


class Holdings:

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards
        self.by_hash: dict[int, set[int]] = {}
        self.held: list[set[int]] = [set() for _ in range(num_shards)]
        self.cursor: list[tuple[int, int] | None] = [None] * num_shards  # (epoch, seq) applied last
        self.counters = {"batches": 0, "gaps": 0, "stale": 0, "resets": 0, "stored": 0, "removed": 0}

    def holders(self, h: int) -> set[int] | frozenset[int]:
        return self.by_hash.get(h, _NONE)

    def apply(self, batch: KvEventBatch) -> bool:
        """Apply one batch; False (nothing applied) when it does not follow the shard's cursor: resync."""
        s = batch.shard
        if not 0 <= s < self.num_shards:
            raise ValueError(f"batch.shard must be in [0, {self.num_shards}); got {s!r}")
        cur = self.cursor[s]
        if cur is not None and cur[0] == batch.epoch and batch.seq <= cur[1]:
            self.counters["stale"] += 1  # already in what is applied (a snapshot taken after it)
            return True
        if not batch.reset:
            if cur != (batch.epoch, batch.seq - 1):
                self.counters["gaps"] += 1
                return False
        else:
            self.counters["resets"] += 1
            self._clear(s)
        held, by_hash = self.held[s], self.by_hash
        for h in batch.removed:
            if h in held:
                held.discard(h)
                owners = by_hash[h]
                owners.discard(s)
                if not owners:
                    del by_hash[h]
        for h in batch.stored:
            if h not in held:
                held.add(h)
                by_hash.setdefault(h, set()).add(s)
        self.cursor[s] = (batch.epoch, batch.seq)
        self.counters["batches"] += 1
        self.counters["stored"] += len(batch.stored)
        self.counters["removed"] += len(batch.removed)
        return True

    def drop_shard(self, shard: int) -> None:
        """Forget the shard's holdings and cursor (it restarted: its next read is a snapshot)."""
        self._clear(shard)
        self.cursor[shard] = None

    def _clear(self, s: int) -> None:
        by_hash = self.by_hash
        for h in self.held[s]:
            owners = by_hash[h]
            owners.discard(s)
            if not owners:
                del by_hash[h]
        self.held[s] = set()

    def stats(self) -> dict:
        return {"hashes": len(self.by_hash), "held": sum(len(x) for x in self.held), **self.counters}
