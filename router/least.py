"""The least-loaded shard in O(log n): a heap of (load, cumulative work, shard) entries with lazy deletion.

RouterPolicy asks for the least-loaded shard on every unseen prefix and, through its load guard, on every hit; a
scan of 1,000 shards costs ~100 us of Python per ask. Each change of a shard's load pushes a fresh entry; an entry
whose values are no longer the shard's is stale and skipped when it reaches the top; the heap is rebuilt when
stale entries outnumber live ones 3 to 1. Order and ties are those of the scan it replaces: least load, then least
cumulative work, then the lower index."""
from __future__ import annotations

import heapq


class LeastLoaded:

    def __init__(self, load: list[float], cumulative: list[float]) -> None:
        self.load, self.cum = load, cumulative  # the policy's lists, read (never written) here
        self._rebuild()

    def _rebuild(self) -> None:
        self.heap = [(self.load[i], self.cum[i], i) for i in range(len(self.load))]
        heapq.heapify(self.heap)

    def changed(self, shard: int) -> None:
        """shard's load or cumulative work changed."""
        heapq.heappush(self.heap, (self.load[shard], self.cum[shard], shard))
        if len(self.heap) > 4 * len(self.load):
            self._rebuild()

    def least(self) -> int:
        heap, load, cum = self.heap, self.load, self.cum
        while True:
            w, c, s = heap[0]
            if w == load[s] and c == cum[s]:
                return s
            heapq.heappop(heap)

    def smallest(self, k: int) -> list[int]:
        """The k least-loaded shards (fewer when there are fewer), least first."""
        heap, load, cum, out, seen = self.heap, self.load, self.cum, [], set()
        while heap and len(out) < k:
            w, c, s = heapq.heappop(heap)
            if w == load[s] and c == cum[s] and s not in seen:
                out.append(s)
                seen.add(s)
        for s in out:
            heapq.heappush(heap, (load[s], cum[s], s))
        return out
