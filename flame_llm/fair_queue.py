"""Per-user FIFO queues served in rotation: one user's backlog delays another user's item by a turn, not by the
backlog. The shards' admission (actors/admission.py, callers) and a client's credit queue (serving/shard_queue.py, end
users) take turns with it."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable


class FairQueue:
    """Items in per-user FIFO queues, served one user at a time in rotation (a user served goes to the back)."""

    def __init__(self) -> None:
        self.queues: dict[Hashable, deque] = {}  # in turn order

    @property
    def users(self) -> int:
        """Users with items waiting."""
        return len(self.queues)

    def waiting(self, user: Hashable) -> int:
        q = self.queues.get(user)
        return len(q) if q else 0

    def head_user(self) -> Hashable:
        return next(iter(self.queues))

    def append(self, item, user: Hashable = "") -> None:
        self.queues.setdefault(user, deque()).append(item)

    def extend(self, items, user_of: Callable) -> None:
        for item in items:
            self.append(item, user_of(item))

    def head(self):
        return self.queues[next(iter(self.queues))][0]

    def popleft(self):
        user = next(iter(self.queues))
        q = self.queues.pop(user)
        item = q.popleft()
        if q:
            self.queues[user] = q  # to the back of the rotation
        return item

    def remove(self, item) -> None:
        for user, q in self.queues.items():
            if item in q:
                q.remove(item)
                if not q:
                    del self.queues[user]
                return
        raise ValueError("not queued")

    def drop(self, pred: Callable) -> list:
        """Remove and return the items pred holds for, keeping the others' order and turns."""
        out = []
        for user in list(self.queues):
            q = self.queues[user]
            out += [x for x in q if pred(x)]
            kept = deque(x for x in q if not pred(x))
            if kept:
                self.queues[user] = kept
            else:
                del self.queues[user]
        return out

    def clear(self) -> None:
        self.queues.clear()

    def __iter__(self):
        for q in list(self.queues.values()):
            yield from list(q)

    def __contains__(self, item) -> bool:
        return any(item in q for q in self.queues.values())

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def __bool__(self) -> bool:
        return bool(self.queues)
