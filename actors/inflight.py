"""The requests an engine actor is serving, keyed by owner and id, so that they can be aborted: on the owner's word
(an ABORT or CANCEL frame) or at its connection's end (actors/stream_server.py). The owner is the sender's stream
connection, so a client process that dies (its sockets closed by its kernel) or whose node is lost (TCP keepalive,
flame_llm/protocol/stream_frames.py) has its requests aborted with its connections: they must not hold admission
slots and KV blocks until they finish. (A watcher of the callers' Ray jobs did the same for the retired Ray
transport; it was retired with it, issue 38.)

Every request runs in its own task on the actor's serving loop; aborting it cancels that task (the engine
request is aborted by AsyncEngine when its awaiting task is cancelled). An abort that arrives before its
request is remembered for a while, so a request that was cancelled while on its way is never started. One lock
makes registering a request and aborting it exclusive (an abort sees the task, or the request sees the abort),
from whichever thread the abort comes.

One owner's id never reaches another owner's request (its registration, its abort; issue 37); a second request
with an id its owner has in flight is refused before it registers (DuplicateRequestId)."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict

REMEMBER_ABORTS = 100_000  # ids aborted before their request arrived, remembered (oldest dropped first)
REMEMBER_ABORTS_S = 300.0

Key = tuple[str, str]  # (owner, request id)


class DuplicateRequestId(ValueError):
    """A request whose id its owner has in flight here already."""


class Inflight:
    def __init__(self) -> None:
        self.tasks: dict[Key, asyncio.Task] = {}  # (owner, request id) -> the task serving it
        self.aborted: OrderedDict[Key, float] = OrderedDict()  # (owner, request id) -> when its abort arrived
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop (abort comes from another thread)
        self.counters = {"aborted": 0}
        self._lock = threading.Lock()

    def add(self, rid: str, owner: str) -> bool:
        """Register the current task as serving `owner`'s `rid`; False when it was aborted already.
        DuplicateRequestId when the owner has a request `rid` in flight (nothing registered)."""
        key = (owner, rid)
        with self._lock:
            if key in self.tasks:
                raise DuplicateRequestId(f"field 'id': request id {rid!r} is already in flight from this sender; "
                                         "ids must be unique among a sender's requests in flight")
            if self.aborted.pop(key, None) is not None:
                return False
            self.loop = asyncio.get_running_loop()
            self.tasks[key] = asyncio.current_task()
        return True

    def remove(self, rid: str, owner: str) -> None:
        with self._lock:
            self.tasks.pop((owner, rid), None)

    def was_aborted(self, rid: str, owner: str) -> bool:
        """Whether `rid`'s cancellation is one of ours (an abort), not the actor's own shutdown."""
        with self._lock:
            return (owner, rid) in self.aborted

    def abort(self, rids: list[str], owner: str) -> int:
        """Cancel the tasks serving `owner`'s `rids` (from any thread); remember the others. The number found. A
        request counts in "aborted" once, however many aborts reach it (a client's and its stream's end, say)."""
        now = time.monotonic()
        found = counted = 0
        with self._lock:
            for key in ((owner, rid) for rid in rids):
                again = key in self.aborted
                self.aborted[key] = now
                self.aborted.move_to_end(key)
                task = self.tasks.get(key)
                if task is not None and self.loop is not None:
                    found += 1
                    counted += not again
                    self.loop.call_soon_threadsafe(task.cancel)
            while self.aborted and (len(self.aborted) > REMEMBER_ABORTS
                                    or now - next(iter(self.aborted.values())) > REMEMBER_ABORTS_S):
                self.aborted.popitem(last=False)
            self.counters["aborted"] += counted
        return found

    def forget(self, rid: str, owner: str) -> None:
        with self._lock:
            self.aborted.pop((owner, rid), None)
