"""The requests an engine actor is serving, by id and by caller, so that they can be aborted: on the caller's
word (an ABORT or CANCEL frame, or its connection's end: actors/stream_server.py), or when the caller's Ray job is
gone (its process died: nobody will read the results, so its requests must not hold admission slots and KV blocks
until they finish).

Every request runs in its own task on the actor's serving loop; aborting it cancels that task (the engine
request is aborted by AsyncEngine when its awaiting task is cancelled). An abort that arrives before its
request is remembered for a while, so a request that was cancelled while on its way is never started. One lock
makes registering a request and aborting it exclusive (an abort sees the task, or the request sees the abort),
from whichever thread the abort comes.

Requests are keyed by their owner and id (issue 37): the owner is the sender's identity inside the actor (a
stream connection of the socket transport, else the caller's Ray job id), so one owner's id never reaches another
owner's request (its registration, its abort); a second request with an id its owner has in flight is refused
before it registers (DuplicateRequestId)."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict

log = logging.getLogger(__name__)

REMEMBER_ABORTS = 100_000  # ids aborted before their request arrived, remembered (oldest dropped first)
REMEMBER_ABORTS_S = 300.0
WATCH_INTERVAL_S = 0.5  # first look at the callers' jobs after this; each look that finds nobody dead waits
WATCH_BACKOFF = 1.5  # this much longer than the last,
WATCH_MAX_INTERVAL_S = 2.0  # up to this (a dead caller's requests are aborted within ~2 s)
JOB_INFO_TIMEOUT_S = 5.0


async def dead_jobs(job_ids: set[str]) -> set[str]:
    """The job ids (hex) among `job_ids` that Ray's job table marks dead (a driver that exited or was killed).
    Only those jobs are read from the GCS, one filtered job-info call each, without the submission-job and
    running-tasks fields (the whole table, `ray._private.state.jobs()`, grows with every job the cluster ever
    ran); a job the GCS does not know, or a failed call (the GCS is restarting), declares nobody dead."""
    import ray

    gcs = ray._private.worker.global_worker.gcs_client

    async def one(job: str) -> bool:
        try:
            got = await gcs.async_get_all_job_info(job_or_submission_id=job, skip_submission_job_info_field=True,
                                                   skip_is_running_tasks_field=True, timeout=JOB_INFO_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - try again next round
            log.warning("could not read Ray's job info of %s: %s", job, e)
            return False
        return any(info.is_dead for jid, info in got.items() if jid.hex() == job)

    ids = sorted(job_ids)
    return {j for j, dead in zip(ids, await asyncio.gather(*(one(j) for j in ids))) if dead}


Key = tuple[str | None, str]  # (owner, request id)


class DuplicateRequestId(ValueError):
    """A request whose id its owner has in flight here already."""


class Inflight:
    def __init__(self) -> None:
        self.tasks: dict[Key, asyncio.Task] = {}  # (owner, request id) -> the task serving it
        self.callers: dict[str, set[Key]] = {}  # caller job id -> its requests
        self.aborted: OrderedDict[Key, float] = OrderedDict()  # (owner, request id) -> when its abort arrived
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop (abort comes from another thread)
        self.watcher: asyncio.Task | None = None
        # caller_checks / caller_check_s: the watcher's looks at the job table and the seconds they took
        self.counters = {"aborted": 0, "aborted_dead_caller": 0, "caller_checks": 0, "caller_check_s": 0.0}
        self._lock = threading.Lock()

    def add(self, rid: str, caller: str | None, owner: str | None = None) -> bool:
        """Register the current task as serving `rid` for `owner` (None: the caller); False when it was aborted
        already. DuplicateRequestId when the owner has a request `rid` in flight (nothing registered)."""
        key = (owner if owner is not None else caller, rid)
        with self._lock:
            if key in self.tasks:
                raise DuplicateRequestId(f"field 'id': request id {rid!r} is already in flight from this sender; "
                                         "ids must be unique among a sender's requests in flight")
            if self.aborted.pop(key, None) is not None:
                return False
            self.loop = asyncio.get_running_loop()
            self.tasks[key] = asyncio.current_task()
            if caller:
                self.callers.setdefault(caller, set()).add(key)
        if caller and self.watcher is None:
            self.watcher = self.loop.create_task(self._watch())
        return True

    def remove(self, rid: str, caller: str | None, owner: str | None = None) -> None:
        key = (owner if owner is not None else caller, rid)
        with self._lock:
            self.tasks.pop(key, None)
            ids = self.callers.get(caller) if caller else None
            if ids is not None:
                ids.discard(key)
                if not ids:
                    del self.callers[caller]

    def was_aborted(self, rid: str, owner: str | None = None) -> bool:
        """Whether `rid`'s cancellation is one of ours (an abort), not the actor's own shutdown."""
        with self._lock:
            return (owner, rid) in self.aborted

    def abort(self, rids: list[str], owner: str | None = None) -> int:
        """Cancel the tasks serving `owner`'s `rids` (from any thread); remember the others. The number found. A
        request counts in "aborted" once, however many aborts reach it (a client's and its stream's end, say)."""
        return self._abort([(owner, rid) for rid in rids])

    def _abort(self, keys: list[Key]) -> int:
        now = time.monotonic()
        found = counted = 0
        with self._lock:
            for key in keys:
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

    def forget(self, rid: str, owner: str | None = None) -> None:
        with self._lock:
            self.aborted.pop((owner, rid), None)

    async def _watch(self) -> None:
        """Abort the requests of callers whose Ray job died; ends when no caller is left. Looks back off while
        every caller lives (WATCH_INTERVAL_S growing to WATCH_MAX_INTERVAL_S) and start over with a new caller."""
        interval, seen = WATCH_INTERVAL_S, set()
        try:
            while self.callers:
                await asyncio.sleep(interval)
                with self._lock:
                    callers = set(self.callers)
                if not callers:
                    break
                interval = WATCH_INTERVAL_S if callers - seen else min(interval * WATCH_BACKOFF, WATCH_MAX_INTERVAL_S)
                seen = callers
                t0 = time.perf_counter()
                dead = await dead_jobs(callers)
                self.counters["caller_checks"] += 1
                self.counters["caller_check_s"] += time.perf_counter() - t0
                for job in dead:
                    with self._lock:
                        keys = list(self.callers.pop(job, ()))
                    log.warning("caller job %s is gone: aborting its %d requests", job, len(keys))
                    self.counters["aborted_dead_caller"] += len(keys)
                    self._abort(keys)
        finally:
            self.watcher = None
