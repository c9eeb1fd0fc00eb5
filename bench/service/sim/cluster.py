"""The simulated cluster: a Poisson stream of document questions (load mode's generators), a client that forms one
router call per replica per batch window (or uses its route cache), router replicas (router/replicas.py) each a
RouterPolicy, and SimShards, driven by one event queue in simulated time. Router work is timed on this CPU.

Policies: any RouterPolicy one ('load_guarded', 'cumulative': today's approximate routing from the router's own
placements; 'events': the engines' cache events, delivered at each step's end plus event_delay_s), and 'oracle':
the events policy told every cache change the moment the scheduler makes it, matching the prompt's whole block
chain (every engine block, not the first 1,024 tokens): what a router that knew every engine's cache would do.

Load view (router/load_view.py, load_view): 'engines' delivers each shard's load (flame_llm.protocol.kv_events
shard_load of its waiting and running requests) to every replica at each step's start plus event_delay_s, or, with
load_poll_s > 0, each replica reads every shard's load every load_poll_s (the real feed's pull; replicas' phases
spread); 'peers' hands each replica the others' outstanding work every peer_exchange_s."""
from __future__ import annotations

import gc
import heapq
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from bench.load.load_workloads import OutputLen, doc_weights
from bench.load.loadgen import arrivals
from bench.service.sim.shard import SimShard, StepModel
from flame_llm.config import Config
from flame_llm.engine.sequence import Sequence
from flame_llm.protocol.kv_events import KvEventBatch, shard_load
from flame_llm.protocol.routing_key import Completion, RouteItem, estimate_prefill_work, prefix_chain
from flame_llm.sampling_params import SamplingParams
from router.policy import RouterConfig, RouterPolicy
from router.replicas import ReplicaRing, RouteCache

REVISION = "sim"
_ROUTER = RouterConfig()  # the defaults of the router fields the simulation passes on


@dataclass(slots=True)
class SimConfig:
    num_shards: int = 20
    num_blocks: int = 128  # KV blocks of 128 tokens per shard
    rate: float = 200.0  # offered requests per simulated second
    duration_s: float = 1.0  # arrivals stop here; the run goes on until every request finished
    num_docs: int = 100
    doc_tokens: int = 2048
    question_tokens: int = 64
    output_len: str = "16"  # load mode's --output-len
    doc_zipf: float = 0.0  # load mode's --doc-zipf
    vocab_size: int = 256  # small ids are shared int objects: 1,000 shards' blocks fit in memory
    policy: str = "events"  # a RouterConfig policy, or "oracle"
    spill_factor: float = 1.25
    placement_ttl_s: float = 1.0
    num_replicas: int = 1
    route_ttl_s: float = 0.0  # the client's route cache (0: every request asks a router)
    batch_window_s: float = 0.001  # the client's router call per replica per window
    router_rtt_s: float = 0.0005  # a router call's answer arrives this long after it was made
    event_delay_s: float = 0.0  # cache events reach the routers this long after the step's end
    kill_replica_at_s: float | None = None  # replica 0 dies then (its calls in flight are lost and made again)
    revive_after_s: float | None = None  # and comes back this much later, empty, resyncing from snapshots
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    step: StepModel = field(default_factory=StepModel)
    seed: int = 0
    load_view: str = "own"  # RouterConfig.load_view: own | engines | peers
    load_choices: int = 1  # RouterConfig.load_choices
    load_bucket: float = 0.0  # RouterConfig.load_bucket
    load_row_cost: float = _ROUTER.load_row_cost  # RouterConfig's
    load_row_free: int = _ROUTER.load_row_free
    load_home: int = 1  # replica r prefers shards s % num_replicas == r among tied loads (RouterPolicy home)
    load_poll_s: float = 0.0  # engines: 0 = each shard reports its load at each step start; > 0 = replicas poll
    peer_exchange_s: float = 0.05  # peers: the replicas exchange their outstanding work this often


@dataclass(slots=True)
class Req:
    rid: int
    t: float
    prompt: list[int]
    n_out: int
    item: RouteItem
    replica: int = -1
    shard: int = -1
    ttft: float = -1.0
    cached: int = 0
    end: float = -1.0


class Cluster:
    def __init__(self, cfg: SimConfig, model_dir: str) -> None:
        self.cfg = cfg
        ec = Config.from_kwargs(model_dir, model_revision=REVISION, max_num_seqs=cfg.max_num_seqs,
                                max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=4096,
                                enable_kv_events=True)
        self.shards = [SimShard(i, ec, cfg.num_blocks, cfg.step) for i in range(cfg.num_shards)]
        self.oracle = cfg.policy == "oracle"
        rc = RouterConfig(policy="events" if self.oracle else cfg.policy, spill_factor=cfg.spill_factor,
                          placement_ttl_s=cfg.placement_ttl_s, load_view=cfg.load_view,
                          load_choices=cfg.load_choices, load_bucket=cfg.load_bucket,
                          load_row_cost=cfg.load_row_cost, load_row_free=cfg.load_row_free)
        self.rc = rc
        self.now = 0.0
        self.resync_s = 0.0
        self.replicas = [self._replica(r) for r in range(cfg.num_replicas)]
        self.ring = ReplicaRing(cfg.num_replicas)
        self.cache = RouteCache(cfg.route_ttl_s) if cfg.route_ttl_s > 0 else None
        self.queue: list = []
        self.num_arrivals = 0
        self.tie = itertools.count()
        self.pending: dict[int, list[Req]] = {}  # replica -> requests of its batch being formed
        self.done: dict[int, Req] = {}
        self.live: dict[int, Req] = {}  # Sequence.seq_id -> its request
        self.reqs: list[Req] = []
        self.sps: dict[int, SamplingParams] = {}
        self.call_s: list[float] = []  # wall time of each route call
        self.call_sizes: list[int] = []
        self.call_cpu_s: list[float] = []  # CPU time of each (the wall time adds this machine's other processes)
        self.router_cpu_s = self.resync_s
        self.counts = {"router_calls": 0, "retried": 0, "lost_answers": 0, "cache_routes": 0, "gaps": 0,
                       "duplicates": 0, "snapshots": 0}

    def _replica(self, rep: int) -> RouterPolicy:
        """A router replica as it starts: with events, synced from every shard's snapshot (empty at the start)."""
        policy = RouterPolicy(self.cfg.num_shards, self.rc, clock=lambda: self.now, seed=self.cfg.seed * 1000 + rep,
                              home=(rep, self.cfg.num_replicas) if self.cfg.load_home else None)
        if self.rc.policy == "events":
            c0 = time.thread_time()
            policy.apply_events([s.log.snapshot() for s in self.shards])
            self.resync_s += time.thread_time() - c0
        return policy

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.queue, (t, next(self.tie), fn, args))

    # ---- the workload (load mode's generators) ------------------------------------------------------------
    def workload(self) -> None:
        c = self.cfg
        rng = np.random.default_rng(c.seed)
        times = arrivals(c.rate, c.duration_s, c.seed)
        self.num_arrivals = len(times)
        docs = rng.choice(c.num_docs, size=len(times), p=doc_weights(c.num_docs, c.doc_zipf))
        lengths = OutputLen.parse(c.output_len)
        for rid, (t, d) in enumerate(zip(times, docs)):
            self.at(float(t), self.arrive, rid, int(d), lengths.draw(rng), rng.integers(0, c.vocab_size,
                                                                                        c.question_tokens))
        if c.kill_replica_at_s is not None:
            self.at(c.kill_replica_at_s, self.kill, 0)
            if c.revive_after_s is not None:
                self.at(c.kill_replica_at_s + c.revive_after_s, self.revive, 0)
        if c.load_view == "engines" and c.load_poll_s > 0:
            for rep in range(c.num_replicas):
                self.at(c.load_poll_s * (rep + 1) / c.num_replicas, self.poll_load, rep)
        if c.load_view == "peers":
            self.at(c.peer_exchange_s, self.exchange)

    def doc(self, d: int) -> list[int]:
        return np.random.default_rng((self.cfg.seed, d)).integers(0, self.cfg.vocab_size, self.cfg.doc_tokens).tolist()

    def arrive(self, rid: int, d: int, n_out: int, question: np.ndarray) -> None:
        prompt = self.doc(d) + question.tolist()
        chain = (prefix_chain(prompt, REVISION, block=128, max_tokens=len(prompt)) if self.oracle
                 else prefix_chain(prompt, REVISION))
        r = Req(rid, self.now, prompt, n_out, RouteItem(chain, estimate_prefill_work(len(prompt)), n_out))
        self.reqs.append(r)
        if self.cache is not None:
            s = self.cache.lookup(chain, self.now)
            if s is not None:
                self.counts["cache_routes"] += 1
                r.replica = self.ring.owner(chain[0])
                self._timed(self.replicas[r.replica].place_batch, [r.item], [s])
                self.send(r, s)
                return
        self.enqueue(r)

    # ---- routing ------------------------------------------------------------------------------------------
    def enqueue(self, r: Req) -> None:
        rep = self.ring.owner(r.item.chain[0])
        batch = self.pending.setdefault(rep, [])
        if not batch:
            self.at(self.now + self.cfg.batch_window_s, self.flush, rep)
        batch.append(r)

    def flush(self, rep: int) -> None:
        batch = self.pending.pop(rep, [])
        if not batch:
            return
        if rep not in self.ring.alive:  # the call fails at once: made again to the prefix's new owner
            self.counts["retried"] += len(batch)
            for r in batch:
                self.enqueue(r)
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        shards = self.replicas[rep].route_batch([r.item for r in batch])
        self.call_s.append(time.perf_counter() - t0)
        cpu = time.thread_time() - c0
        self.call_cpu_s.append(cpu)
        self.router_cpu_s += cpu
        self.call_sizes.append(len(batch))
        self.counts["router_calls"] += 1
        self.at(self.now + self.cfg.router_rtt_s, self.answer, rep, batch, shards)

    def answer(self, rep: int, batch: list[Req], shards: list[int]) -> None:
        if rep not in self.ring.alive:  # the replica died with the call in flight: the answer never comes
            self.counts["lost_answers"] += len(batch)
            for r in batch:
                self.enqueue(r)
            return
        for r, s in zip(batch, shards):
            r.replica = rep
            if self.cache is not None:
                self.cache.learn(r.item.chain, s, self.now)
            self.send(r, s)

    def _timed(self, fn, *args):
        c0 = time.thread_time()
        out = fn(*args)
        self.router_cpu_s += time.thread_time() - c0
        return out

    # ---- shards -------------------------------------------------------------------------------------------
    def send(self, r: Req, s: int) -> None:
        r.shard = s
        sp = self.sps.get(r.n_out) or self.sps.setdefault(r.n_out, SamplingParams(max_tokens=r.n_out, ignore_eos=True))
        seq = Sequence(r.prompt, sp, 128, request_id=str(r.rid))
        self.live[seq.seq_id] = r
        shard = self.shards[s]
        shard.add(seq)
        if not shard.busy:
            shard.busy = True
            self.step(s)

    def step(self, s: int) -> None:
        if self.cfg.load_view == "engines" and self.cfg.load_poll_s <= 0:  # the load with this step's work in it
            self.report_load(s)
        res = self.shards[s].step()
        if res is None:
            self.shards[s].busy = False
            return
        if self.oracle and res.events is not None:  # every change, the moment the scheduler makes it
            self.deliver(res.events)
        self.at(self.now + res.duration_s, self.step_end, s, res)

    def step_end(self, s: int, res) -> None:
        for seq in res.first_token:
            r = self.live[seq.seq_id]
            r.ttft = self.now - r.t
        by_rep: dict[int, list[Completion]] = {}
        for seq in res.finished:
            r = self.live.pop(seq.seq_id)
            if r.rid in self.done:
                self.counts["duplicates"] += 1
            self.done[r.rid] = r
            r.prompt = None  # free the tokens
            r.cached, r.end = seq.num_cached_tokens, self.now
            by_rep.setdefault(r.replica, []).append(Completion(s, r.item.est_prefill_work, r.n_out,
                                                               seq.num_prompt_tokens, seq.num_cached_tokens))
        for rep, comps in by_rep.items():
            if rep in self.ring.alive:
                self._timed(self.replicas[rep].complete_many, comps)
        if res.events is not None and not self.oracle and self.rc.policy == "events":
            self.at(self.now + self.cfg.event_delay_s, self.deliver, res.events)
        self.step(s)

    def deliver(self, batch: KvEventBatch) -> None:
        for rep in self.ring.alive:
            gaps = self._timed(self.replicas[rep].apply_events, [batch])
            for s in gaps:  # a replica that missed batches: a snapshot of that shard
                self.counts["gaps"] += 1
                self.resync(rep, s)

    def resync(self, rep: int, s: int) -> None:
        t0 = time.thread_time()
        self.replicas[rep].apply_events([self.shards[s].log.snapshot()])
        dt = time.thread_time() - t0
        self.resync_s += dt
        self.router_cpu_s += dt
        self.counts["snapshots"] += 1

    # ---- the shared load view --------------------------------------------------------------------------------
    def report_load(self, s: int) -> None:
        shard = self.shards[s]
        shard.load_seq += 1
        load, stamp = shard_load(shard.scheduler.sequences()), (0, shard.load_seq)
        if self.cfg.event_delay_s > 0:
            self.at(self.now + self.cfg.event_delay_s, self.deliver_load, s, stamp, load)
        else:
            self.deliver_load(s, stamp, load)

    def deliver_load(self, s: int, stamp: tuple[int, int], load) -> None:
        for rep in self.ring.alive:
            self._timed(self.replicas[rep].apply_load, s, stamp, load)

    def poll_load(self, rep: int) -> None:
        """Replica rep reads every shard's load (the feed's pull), then again load_poll_s later."""
        if rep in self.ring.alive:
            for s, shard in enumerate(self.shards):
                shard.load_seq += 1
                load = shard_load(shard.scheduler.sequences())
                self._timed(self.replicas[rep].apply_load, s, (0, shard.load_seq), load)
        if len(self.done) < self.num_arrivals:  # periodic until the last request ends
            self.at(self.now + self.cfg.load_poll_s, self.poll_load, rep)

    def exchange(self) -> None:
        """Every live replica gets the sum of the others' outstanding work per shard."""
        alive = sorted(self.ring.alive)
        own = {rep: self._timed(self.replicas[rep].outstanding) for rep in alive}
        total = [sum(col) for col in zip(*own.values())]
        for rep in alive:
            self._timed(self.replicas[rep].set_peer_load, [t - o for t, o in zip(total, own[rep])])
        if len(self.done) < self.num_arrivals:  # periodic until the last request ends
            self.at(self.now + self.cfg.peer_exchange_s, self.exchange)

    # ---- replica faults -----------------------------------------------------------------------------------
    def kill(self, rep: int) -> None:
        self.ring.kill(rep)
        self.replicas[rep] = None  # its state is gone

    def revive(self, rep: int) -> None:
        self.replicas[rep] = self._replica(rep)
        self.counts["snapshots"] += self.cfg.num_shards if self.rc.policy == "events" else 0
        self.ring.revive(rep)

    # ---- the run ------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Run to the last request's end. Python's cyclic GC is off meanwhile: a collection walks the simulation's
        millions of objects (every shard's blocks and sequences), which a router process does not hold, and would
        be charged to whichever route call it interrupts."""
        self.workload()
        gc.collect()
        gc.disable()
        try:
            while self.queue:
                t, _, fn, args = heapq.heappop(self.queue)
                self.now = t
                fn(*args)
        finally:
            gc.enable()
