"""The systems under test of `flame-llm bench --mode loadgen`, as MLPerf LoadGen sees them: one LoadgenSut bridges
LoadGen's callbacks (issue_queries from LoadGen's threads, FirstTokenComplete / QuerySamplesComplete back) to an
asyncio loop on a thread of its own, where a backend generates each sample:

- flame: the service through its Python client (bench/systems.py starts it as the burst bench does): Offline's one
  query goes as one `as_completed` call (batched dispatch, each sample completed as it lands), Server's samples
  each as a `stream_chunks` stream;
- flame-http: the same service through its HTTP front door (OpenAI completions, streamed);
- engine (our standalone engine server, serve-http) and vllm (`vllm serve`): their OpenAI endpoints, streamed.
Every sample's answer is generated to its drawn length (EOS ignored); LoadGen gets each answer's token ids and
count (TPOT), and in Server the first token's time (TTFT) the moment it arrives."""

from __future__ import annotations

import array
import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import numpy as np

from bench.http_client import SERVED_MODEL_NAME, sse_chunks
from bench.load.mlperf_data import Dataset
from bench.system_config import parse_system

log = logging.getLogger(__name__)
KEEPALIVE_S = 2.0  # the client's idle keep-alive, under every server's own
HTTP_SUFFIX = "-http"  # a flame label with it drives the front door instead of the Python client


def parse_sut(label: str, policy: str = "cumulative") -> tuple:
    """(SystemConfig, transport "python" | "http") of a loadgen system label: the bench's labels (flame, engine,
    vllm, ...), and any flame label + "-http" for its front door."""
    http = label.endswith(HTTP_SUFFIX)
    try:
        system = parse_system(label[: -len(HTTP_SUFFIX)] if http else label, policy)
    except ValueError as e:
        raise ValueError(f"{e}; or a flame label + '{HTTP_SUFFIX}' (its front door)") from None
    if http and system.kind != "flame":
        raise ValueError(f"system {label!r}: '{HTTP_SUFFIX}' is for flame labels (engine and vllm are HTTP already)")
    system.label = label
    return system, ("http" if http or system.kind != "flame" else "python")


def _ids(chunk: dict) -> list[int]:
    """Token ids a streamed completion chunk carries (-1 for each token given only as text)."""
    ids: list[int] = []
    for c in chunk.get("choices") or []:
        got = c.get("token_ids")
        ids += list(got) if got is not None else ([-1] if c.get("text") else [])
    return ids


class HttpBackend:
    """OpenAI-compatible streamed completions, samples spread round-robin over the replicas' URLs."""

    def __init__(self, urls: list[str], timeout_s: float, max_connections: int = 4096):
        assert urls, "an HTTP system under test needs at least one replica"
        self.urls, self.timeout_s, self.max_connections = urls, timeout_s, max_connections
        self.session: aiohttp.ClientSession | None = None
        self._next = 0

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(
            # idle pooled connections are dropped after KEEPALIVE_S, before a server closes them (ours after 10 s,
            # uvicorn's after 5): a request written into a connection the server is closing fails reset
            connector=aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def stream(self, prompt: np.ndarray, max_tokens: int) -> AsyncIterator[list[int]]:
        url = self.urls[self._next % len(self.urls)]
        self._next += 1
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": prompt.tolist(),
            "max_tokens": int(max_tokens),
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        async with self.session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for chunk in sse_chunks(resp):
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"])[:200])
                if ids := _ids(chunk):
                    yield ids


class FlameBackend:
    """The service's Python client (flame_llm.serving.client.Client)."""

    def __init__(self, client):
        self.client = client

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    @staticmethod
    def _params(max_tokens: int):
        from flame_llm.sampling_params import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)

    async def stream(self, prompt: np.ndarray, max_tokens: int) -> AsyncIterator[list[int]]:
        async for chunk in self.client.stream_chunks(prompt, self._params(max_tokens)):
            if chunk.token_ids:
                yield list(chunk.token_ids)
            if chunk.result is not None and chunk.result.error is not None:
                raise RuntimeError(f"flame: {chunk.result.error}")

    def batch(self, prompts: list[np.ndarray], max_tokens: list[int]) -> Iterator[tuple[int, list[int], str | None]]:
        """(position, output token ids, error or None) of each prompt as its result lands."""
        for i, r in self.client.as_completed(prompts, [self._params(m) for m in max_tokens]):
            yield i, list(r.output_token_ids), (None if r.error is None else str(r.error))


class LoadgenSut:
    """LoadGen's SUT and QSL over one backend; counts what it issued, completed and what failed."""

    def __init__(self, backend, dataset: Dataset):
        import mlperf_loadgen as lg

        self.lg, self.backend, self.dataset = lg, backend, dataset
        self.issued = self.completed = self.output_tokens = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="loadgen-sut", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(backend.open(), self.loop).result()
        self.sut = lg.ConstructSUT(self.issue_queries, self.flush_queries)
        n = len(dataset)
        self.qsl = lg.ConstructQSL(n, n, lambda _: None, lambda _: None)  # the samples are in memory already

    def warmup(self, n: int = 8, max_tokens: int = 4) -> float:
        """n samples' prompts with short answers through the backend, outside LoadGen (first-use compiles and
        connections before the measured runs); seconds taken. A failure here is the system's: raised."""

        async def one(i: int) -> None:
            async for _ in self.backend.stream(self.dataset.input_ids[i % len(self.dataset)], max_tokens):
                pass

        async def all_of() -> None:
            await asyncio.gather(*(one(i) for i in range(n)))

        t0 = time.perf_counter()
        asyncio.run_coroutine_threadsafe(all_of(), self.loop).result()
        return time.perf_counter() - t0

    def reset(self) -> None:
        """Counters start again (one LoadGen run each)."""
        with self._lock:
            self.issued = self.completed = self.output_tokens = 0
            self.errors = []

    def counters(self) -> dict:
        with self._lock:
            return {
                "issued": self.issued,
                "completed": self.completed,
                "output_tokens": self.output_tokens,
                "failed": len(self.errors),
                "first_errors": self.errors[:5],
            }

    def issue_queries(self, samples) -> None:
        items = [(s.id, s.index) for s in samples]
        with self._lock:
            self.issued += len(items)
        if len(items) > 1 and hasattr(self.backend, "batch"):  # Offline's one query: one batched call
            threading.Thread(target=self._batch, args=(items,), daemon=True).start()
            return
        for qid, idx in items:
            asyncio.run_coroutine_threadsafe(self._one(qid, idx), self.loop)

    def flush_queries(self) -> None:
        pass

    def _complete(self, qid: int, ids: list[int], error: str | None) -> None:
        data = array.array("B", np.asarray(ids, dtype=np.int32).tobytes())
        ptr, size = data.buffer_info()
        with self._lock:
            self.completed += 1
            self.output_tokens += len(ids)
            if error is not None:
                self.errors.append(error)
        self.lg.QuerySamplesComplete([self.lg.QuerySampleResponse(qid, ptr, size * data.itemsize, len(ids))])

    def _batch(self, items: list[tuple[int, int]]) -> None:
        d = self.dataset
        done: set[int] = set()
        try:
            got = self.backend.batch([d.input_ids[i] for _, i in items], [int(d.output_lens[i]) for _, i in items])
            for k, ids, err in got:
                self._complete(items[k][0], ids, err)
                done.add(k)
        except Exception as e:  # noqa: BLE001 - every sample must still be completed, or LoadGen waits forever
            log.exception("offline batch failed")
            for k, (qid, _) in enumerate(items):
                if k not in done:
                    self._complete(qid, [], f"{type(e).__name__}: {e}"[:200])

    async def _one(self, qid: int, idx: int) -> None:
        ids: list[int] = []
        error = None
        try:
            async for got in self.backend.stream(self.dataset.input_ids[idx], int(self.dataset.output_lens[idx])):
                if not ids:
                    first = array.array("B", np.asarray(got[:1], dtype=np.int32).tobytes())
                    ptr, size = first.buffer_info()
                    self.lg.FirstTokenComplete([self.lg.QuerySampleResponse(qid, ptr, size)])
                ids += got
            if not ids:
                error = "no tokens"
        except Exception as e:  # noqa: BLE001 - counted and reported; LoadGen still gets the sample back
            error = f"{type(e).__name__}: {e}"[:200]
        self._complete(qid, ids, error)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.backend.close(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.lg.DestroyQSL(self.qsl)
        self.lg.DestroySUT(self.sut)


def make_backend(system, transport: str, timeout_s: float):
    """The backend driving a started bench system (bench/systems.py make_system)."""
    if transport == "python":
        return FlameBackend(system.client)
    return HttpBackend([r.url for r in system.http_replicas()], timeout_s)
