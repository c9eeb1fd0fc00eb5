"""The router actor's cache-event feed (policy 'events'): a thread that pulls every shard's KvEventBatches
(EngineActor.kv_events, after the router's cursor for that shard) every poll interval and applies them to the
policy under the actor's lock. A shard's log answers a cursor it cannot continue (a restarted router: no cursor;
a restarted engine: another epoch; batches no longer kept) with a snapshot, so a pull never leaves a gap. A shard
not found yet (starting) or dead (restarting) is skipped and asked again next round. With router.load_view 'engines'
each pull asks for the shard's load too (kv_events with_load), which the policy applies by its stamp (epoch, seq):
a report older than the last applied is ignored. Otherwise the pull is what it was before loads existed."""
from __future__ import annotations

import logging
import threading

import ray

from router.policy import RouterPolicy

log = logging.getLogger(__name__)
PULL_TIMEOUT_S = 5.0


class EventFeed:

    def __init__(self, policy: RouterPolicy, lock: threading.Lock, shard_names: list[str], namespace: str,
                 interval_s: float) -> None:
        assert policy.holdings is not None and len(shard_names) == policy.num_shards
        self.policy, self.lock, self.names, self.namespace = policy, lock, list(shard_names), namespace
        self.interval_s = interval_s
        self.with_load = policy.view is not None and policy.view.mode == "engines"
        self.handles: list = [None] * len(shard_names)
        self.counters = {"polls": 0, "batches": 0, "snapshots": 0, "pull_errors": 0, "loads": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-event-feed", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # never let the thread die: the next round tries again
                log.exception("router event feed: poll failed")

    def poll(self) -> None:
        """One round: pull every reachable shard's batches after its cursor and apply them."""
        self.counters["polls"] += 1
        refs = {}
        for s, name in enumerate(self.names):
            if self.handles[s] is None:
                try:
                    self.handles[s] = ray.get_actor(name, namespace=self.namespace)
                except ValueError:
                    continue  # not created yet
            cur = self.policy.holdings.cursor[s] or (0, 0)
            method = self.handles[s].kv_events
            refs[s] = method.remote(*cur, with_load=True) if self.with_load else method.remote(*cur)
        for s, ref in refs.items():
            try:
                batches = ray.get(ref, timeout=PULL_TIMEOUT_S)
            except Exception as e:  # dead or restarting: its next pull (new epoch) brings a snapshot
                self.counters["pull_errors"] += 1
                log.debug("router event feed: shard %d: %s", s, e)
                continue
            if not batches:
                continue
            with self.lock:
                gaps = self.policy.apply_events(batches)
            self.counters["batches"] += len(batches)
            self.counters["snapshots"] += sum(b.reset for b in batches)
            self.counters["loads"] += sum(b.load is not None for b in batches)
            if gaps:  # cannot come from one read; forget the cursor so the next pull is a snapshot
                self.policy.holdings.cursor[s] = None
