"""Helpers shared by test modules: prompts for the transformers reference, and a fake model runner
with a deterministic stand-in model for schedule-level tests (no model can run a million-step
schedule search in CI; the fake checks every KV read as attention would)."""
import hashlib
import json
import random

import torch

from flame_llm.config import SCHEDULER_FEATURES_OFF, Config
from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from flame_llm.engine.scheduler import Scheduler
from flame_llm.engine.sequence import Sequence
from flame_llm.kernels.metadata import AttentionMetadata
from flame_llm.kernels.torch_attention import paged_attention, store_kvcache
from flame_llm.sampling_params import SamplingParams

POISON = float("nan")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels need CUDA tensors

MAX_TOKENS = 24


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(40)]  # a 40-token prefix shared by two prompts
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 33, 70)]
    prompts.append(shared + [rng.randrange(3, 512) for _ in range(9)])
    prompts.append(shared + [rng.randrange(3, 512) for _ in range(25)])
    return prompts



BS = 16
EOS = 2


def next_token(ids: list[int]) -> int:
    """A deterministic stand-in for the model: a function of the whole token history."""
    v = (sum(ids[-4:]) * 2654435761 + len(ids) * 40503) % 1_000_003
    return EOS if v % 41 == 0 else 3 + v % 500


class FakeRunner:
    """Writes (token, position) into a simulated paged KV and checks every read, like attention would."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.kv: dict[int, tuple[int, int]] = {}

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def run(self, scheduled: SchedulerOutput, pending: dict[int, int] | None = None) -> ModelRunnerOutput:
        """One step. `pending`: seq_id -> the token the previous, not yet completed step sampled for that
        sequence (asynchronous scheduling feeds it before the host has appended it)."""
        seqs, num_tokens = scheduled.seqs, scheduled.num_scheduled_tokens
        assert len({s.seq_id for s in seqs}) == len(seqs)
        histories = []
        for seq, n, start in zip(seqs, num_tokens, scheduled.num_computed_tokens):  # the step's starts
            end = start + n
            history = list(seq.token_ids)
            if end > seq.num_tokens:  # the one token a running step is sampling for it
                assert end == seq.num_tokens + 1 and pending is not None and seq.seq_id in pending
                history.append(pending[seq.seq_id])
            assert n >= 1 and len(seq.block_table) * self.bs >= end
            for pos in range(start, end):
                self.kv[self.slot(seq, pos)] = (history[pos], pos)
            histories.append(history[:end])
        out: list[int | None] = []
        for seq, history in zip(seqs, histories):  # read after every write of the step, as the kernel does
            end = len(history)
            assert [self.kv.get(self.slot(seq, p)) for p in range(end)] == [
                (t, p) for p, t in enumerate(history)], f"KV of {seq.request_id} is corrupt"
            out.append(next_token(history) if end >= seq.num_tokens else None)
        return ModelRunnerOutput(scheduled, out)


def make_workload(seed: int = 0, n: int = 40) -> list[tuple[int, list[int], SamplingParams]]:
    """(arrival step, prompt, params): shared prefixes, block-aligned prompts, late arrivals, eos."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(k)] for k in (16, 32, 48, 20)]
    work = []
    for i in range(n):
        if rng.random() < 0.5:
            prompt = list(rng.choice(prefixes)) + [rng.randrange(3, 500) for _ in range(rng.choice([0, 1, 7, 16]))]
        else:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 90))]
        sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.7)
        work.append((0 if i < n // 2 else rng.randint(1, 60), prompt, sp))
    return work


def replay(sched: Scheduler, workload, aborts: dict[int, str] | None = None, max_steps: int = 5000,
           asynchronous: bool = False):
    """Drive sched like LLMEngine does; return the per-step schedule and each request's output.
    asynchronous: as with async_scheduling, launch step N+1 (its pending tokens fed from step N's
    outputs), then complete step N."""
    runner = FakeRunner(sched.block_manager.block_size)
    arrivals = sorted(((a, i, p, sp) for i, (a, p, sp) in enumerate(workload)), key=lambda x: (x[0], x[1]))
    seqs: dict[str, Sequence] = {}
    trace = []
    inflight = None
    step = 0
    while arrivals or not sched.is_finished() or inflight is not None:
        assert step < max_steps, "the schedule does not make progress"
        while arrivals and arrivals[0][0] <= step:
            _, i, prompt, sp = arrivals.pop(0)
            seq = Sequence(prompt, sp, sched.block_manager.block_size, request_id=f"r{i}")
            seqs[seq.request_id] = seq
            sched.add(seq)
        if aborts and step in aborts:
            sched.abort(aborts[step])
        scheduled = sched.schedule()
        batch, num_tokens = scheduled.seqs, scheduled.num_scheduled_tokens
        assert sum(num_tokens) <= sched.max_num_batched_tokens and len(batch) <= sched.max_num_seqs
        trace.append([(s.request_id, n) for s, n in zip(batch, num_tokens)])
        if not asynchronous:
            if batch:
                sched.update_from_output(runner.run(scheduled))
            partial = [s for s in sched.running if s.num_tokens - s.num_computed_tokens > 1]
            assert not partial or partial == [sched.running[-1]], "decode-first: only the newest may be mid-prefill"
        else:
            launched = None
            if batch:
                prev = {} if inflight is None else {
                    s.seq_id: t for s, t in zip(inflight.scheduled.seqs, inflight.sampled_token_ids) if t is not None}
                launched = runner.run(scheduled, prev)
            sched.update_from_output(inflight)
            inflight = launched
        step += 1
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert all(s.num_pending_tokens == 0 for s in seqs.values())
    outputs = {rid: (s.completion_token_ids, s.finish_reason, s.num_cached_tokens) for rid, s in seqs.items()}
    return trace, outputs


def expected_outputs(workload, max_model_len: int) -> list[list[int]]:
    """What any correct schedule must produce for each request (the fake model is history-only)."""
    outs = []
    for _, prompt, sp in workload:
        ids = list(prompt)
        while True:
            tok = next_token(ids)
            ids.append(tok)
            if ((not sp.ignore_eos and tok == EOS) or len(ids) - len(prompt) >= sp.max_tokens
                    or len(ids) >= max_model_len):
                break
        outs.append(ids[len(prompt):])
    return outs


def make_scheduler(model: str, num_blocks: int = 24, cls: type[Scheduler] = Scheduler, **kwargs) -> Scheduler:
    # the recorded schedules predate the scheduler features and same-step prefix sharing (the engine's defaults
    # turn them on): tests that want one say so
    kwargs = dict(block_size=BS, max_num_seqs=6, max_num_batched_tokens=128, max_model_len=128,
                  num_kvcache_blocks=num_blocks, eos_token_ids=(EOS,), enable_same_step_prefix_sharing=False,
                  **SCHEDULER_FEATURES_OFF) | kwargs
    cfg = Config.from_kwargs(model, **kwargs)
    cc = cfg.cache_config
    return cls(cfg, BlockManager(num_blocks, BS, cc.enable_prefix_caching, cc.enable_lru))


def trace_digest(trace, outputs) -> str:
    return hashlib.sha256(json.dumps([trace, sorted(outputs.items())]).encode()).hexdigest()


def make_case(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, *, pad_rows=0,
              decode=False, max_seqlen_k=None, dtype=torch.float32, device=DEVICE, seed=0):
    """Random cache holding every sequence's prefix (the rest poisoned) plus this step's q/k/v.

    pad_rows appends padded decode rows (q_len 1, seq_len 0, slot -1) like a CUDA-graph batch."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)  # physical blocks in random order
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.full((len(seq_lens) + pad_rows, max_blocks), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, POISON, dtype=dtype)
    v_cache = torch.full(shape, POISON, dtype=dtype)
    slots, used = [], 0
    for i, (s, n) in enumerate(zip(seq_lens, q_lens)):
        assert 0 < n <= s
        blocks = perm[used:used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        block_tables[i, :len(blocks)] = blocks.to(torch.int32)
        rows = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:s]
        k_cache.view(-1, num_kv_heads, head_dim)[rows[:s - n]] = torch.randn(
            s - n, num_kv_heads, head_dim, generator=g).to(dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[rows[:s - n]] = torch.randn(
            s - n, num_kv_heads, head_dim, generator=g).to(dtype)
        slots.append(rows[s - n:])
    slots.append(torch.full((pad_rows,), -1, dtype=torch.int64))
    q_lens_all = list(q_lens) + [1] * pad_rows
    num_tokens = sum(q_lens_all)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + q_lens_all).cumsum(0).to(torch.int32)
    lens = torch.tensor(list(seq_lens) + [0] * pad_rows, dtype=torch.int32)
    meta = AttentionMetadata(
        cu_seqlens_q=cu, seq_lens=lens, block_tables=block_tables, slot_mapping=torch.cat(slots),
        max_seqlen_q=max(q_lens_all), max_seqlen_k=max_seqlen_k or max(seq_lens), is_decode=decode,
        fresh_only=list(seq_lens) == list(q_lens) and pad_rows == 0,
        cu_seqlens_k=torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32))
    tensors = [q, k, v, k_cache, v_cache]
    for name in ("cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping", "cu_seqlens_k"):
        setattr(meta, name, getattr(meta, name).to(device))
    return [t.to(device) for t in tensors], meta


def reference(q, k, v, k_cache, v_cache, meta, num_real, scale):
    """Cache after the torch store, and the fp32 torch attention of the first num_real sequences."""
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_ref, v_ref, meta.slot_mapping)
    n = int(meta.cu_seqlens_q[num_real])
    out = paged_attention(q[:n].float(), k_ref.float(), v_ref.float(), meta.cu_seqlens_q[:num_real + 1],
                          meta.seq_lens[:num_real], meta.block_tables[:num_real], scale)
    return k_ref, v_ref, out


# attention cases (name -> make_case arguments): ragged prefill, prefix chunks, GQA 1-8, head dims 16-128,
# block sizes 16-256, decode with padded graph rows, speculative verify segments
CASES_ATTENTION = {
    "fresh_ragged_gqa4_d64_bs16": dict(seq_lens=[37, 1, 70, 13], q_lens=[37, 1, 70, 13], num_heads=8,
                                       num_kv_heads=2, head_dim=64, block_size=16),
    "prefix_chunks_gqa1_d128_bs32": dict(seq_lens=[80, 50, 33, 64], q_lens=[17, 50, 1, 32], num_heads=2,
                                         num_kv_heads=2, head_dim=128, block_size=32),
    "prefix_gqa8_d64_bs64": dict(seq_lens=[150, 9], q_lens=[40, 3], num_heads=8, num_kv_heads=1,
                                 head_dim=64, block_size=64),
    "gqa3_d48_bs256": dict(seq_lens=[300, 20], q_lens=[45, 20], num_heads=6, num_kv_heads=2, head_dim=48,
                           block_size=256),
    "tiny_d16_bs128": dict(seq_lens=[129, 5], q_lens=[129, 2], num_heads=4, num_kv_heads=2, head_dim=16,
                           block_size=128),
    "decode_pad_split_gqa4_d128_bs16": dict(seq_lens=[200, 1, 77, 130], q_lens=[1, 1, 1, 1], num_heads=8,
                                           num_kv_heads=2, head_dim=128, block_size=16, pad_rows=2,
                                           decode=True, max_seqlen_k=1024),
    "decode_gqa8_d64_bs32": dict(seq_lens=[33, 96, 5], q_lens=[1, 1, 1], num_heads=8, num_kv_heads=1,
                                 head_dim=64, block_size=32, decode=True),
    "verify_k4_gqa4_d64_bs16": dict(seq_lens=[90, 41, 5], q_lens=[5, 5, 5], num_heads=4, num_kv_heads=1,
                                    head_dim=64, block_size=16, max_seqlen_k=2048),
}


def answering(actor, timeout_s: float = 120.0):
    """The actor's health() once it answers: a killed actor is asked again until its next incarnation does (a
    kill lands a moment after ray.kill returns; a restart may outlast the requests, which went on elsewhere)."""
    import time

    import ray
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.health.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            assert time.monotonic() < deadline, "the actor did not answer again"
            time.sleep(0.1)


def kill_mid_burst(client, victim, prompts, sp):
    """client.generate(prompts, sp) in a thread (its results land in the returned dict's "res"); `victim` killed
    (Ray restarts it) once it has requests of the burst in flight. Returns (thread, dict)."""
    import threading
    import time

    import ray
    out: dict = {}
    burst = threading.Thread(target=lambda: out.update(res=client.generate(prompts, sp)))
    burst.start()
    deadline = time.monotonic() + 60
    while ray.get(victim.stats.remote())["inflight_requests"] == 0:  # mid-burst: the shard is busy
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ray.kill(victim, no_restart=False)
    return burst, out


def service_with_a_client(model: str, engine: dict, num_shards: int, namespace: str):
    """A service on a fresh local Ray (killed shards restart without limit) and a client of it: yields (service,
    client), then stops them and Ray. For module fixtures."""
    import ray

    from flame_llm.serving.client import Client
    from flame_llm.serving.service import start_service
    from flame_llm.serving.service_config import ServiceConfig
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = ServiceConfig.from_kwargs(model=model, engine=engine, num_shards=num_shards, cpu_per_shard=0.5,
                                    namespace=namespace, restart_timeout_s=120.0, max_restarts=-1)
    svc = start_service(cfg)
    client = Client.for_service(svc)
    yield svc, client
    client.close()
    svc.stop(timeout_s=10)
    ray.shutdown()


def socket_items(actor, payload: bytes, batch: bool = False, abort_first: list[str] | None = None) -> list:
    """One request payload through the engine actor's one entry point, its stream server's socket (an OPEN frame,
    or with `batch` a BATCH frame), from a connection of its own: what comes back, token id lists (a stream) and
    result payloads, until a stream's result, or a batch's every request has its result (an unreadable payload:
    its one result with id None). abort_first: request ids of an ABORT frame sent before it on that connection."""
    import asyncio

    import ray

    from flame_llm.protocol.stream_frames import Frame, encode_frame, read_frame
    from flame_llm.protocol.types import EngineLimits
    from flame_llm.protocol.wire import decode_requests, decode_results

    try:
        n = len(decode_requests(payload, EngineLimits.of(1 << 31, 1 << 31, 1 << 30)).items) if batch else 1
    except Exception:  # noqa: BLE001 - unreadable: the shard answers one result
        n = 1

    async def main() -> list:
        ep = await actor.stream_endpoint.remote(ray.get_runtime_context().get_node_id())
        reader, writer = await asyncio.open_connection(ep.host, ep.port)
        writer.write(encode_frame(Frame.HELLO, ep.token)
                     + (encode_frame(Frame.ABORT, abort_first) if abort_first else b"")
                     + encode_frame(Frame.BATCH if batch else Frame.OPEN, 0, payload, None, None))
        out, answered = [], 0
        try:
            while answered < n:
                frame = await read_frame(reader, 1 << 30)
                assert frame is not None and frame[0] in (Frame.CHUNK, Frame.RESULT), frame
                out.append(frame[2])
                if frame[0] == Frame.RESULT:
                    results = decode_results(frame[2])
                    answered = n if results[0].id is None else answered + len(results)
        finally:
            writer.close()
        return out

    return asyncio.run(main())


def submitted(actor, payload: bytes, abort_first: list[str] | None = None) -> list:
    """A request batch through the engine actor's socket (socket_items): the results of every result payload, in
    finishing order."""
    from flame_llm.protocol.wire import decode_results
    return [r for x in socket_items(actor, payload, True, abort_first) for r in decode_results(x)]


def unbounded_credit(client) -> None:
    """Let the client send past what its shards admit (as when other clients share them): its requests then meet
    the shards' rejections and the overloaded retry path."""
    for ch in client.dispatch.channels.values():
        ch.capacity = 1 << 30
        ch.chunk = 1 << 29
