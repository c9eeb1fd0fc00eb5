"""Wire fuzzer: decode_requests and decode_results against hostile payloads.

    python tests/fuzz_wire.py --inputs 100000 --out /tmp/fuzz_wire.json

Kinds of input (each for both decoders): valid frames, mutated frames (compressed bytes flipped, cut,
spliced), mutated msgpack (raw bytes changed, then compressed), mutated objects (one node of a valid
batch or result list replaced with a hostile value: huge ints, NaN/inf, wrong types, long strings,
ext types, big maps and arrays, deep nesting), random bytes, random objects (wrong schemas), deep
nesting (900 to 1,100 levels), bombs (no declared content size and inflating past the budget, a
declared size over it, a lying header, a huge window, concatenated frames) and structure bombs (many
empty containers, many invalid slots, many short strings).

The property: decode_requests returns a batch of Request or RequestError items, or raises WireError;
decode_results returns Results or raises WireError; nothing else is raised; no input takes MAX_SECONDS
or more (timed without tracing); the memory one decode allocates (tracemalloc's peak, on every
--mem-every-th input and every bomb) stays under memory_limit(budget): MEMORY_FACTOR x the payload budget
plus SLOT_BYTES per request slot a batch may hold.
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import msgpack
import numpy as np
import zstandard

from flame_llm.protocol.errors import ErrorCode, ErrorInfo, RequestError, WireError
from flame_llm.protocol.types import DEFAULT_MAX_PAYLOAD_BYTES, MAX_BATCH_REQUESTS, EngineLimits, Request, Result
from flame_llm.protocol.wire import WIRE_VERSION, decode_requests, decode_results, encode_requests, encode_results
from flame_llm.sampling_params import SamplingParams

MAX_SECONDS = 1.0
MEMORY_FACTOR = 24  # x the budget: unpacked msgpack takes at most ~21x its bytes (full arrays of short strings)
SLOT_BYTES = 1024  # ... plus an invalid request slot's RequestError (~0.5 kB), MAX_BATCH_REQUESTS of them at most
VOCAB, MAX_MODEL_LEN = 32_000, 4096
HOSTILE = [2**64 - 1, -2**63, 2**63, 2**31, -1, 0, float("nan"), float("inf"), float("-inf"), -0.0, 1e308, True,
           None, "", "x" * 300, "é" * 200, b"", b"\x00" * 3, [], {}, [None] * 3, {"k": 1}, {b"k": 1}]


class Deep(NamedTuple):
    """`depth` nested one-item arrays around `leaf`, encoded by _encode (msgpack's packer stops near 1,024)."""
    depth: int
    leaf: object = 1


def _encode(obj: object) -> bytes:
    """msgpack bytes of obj, with Deep values spelled out."""
    if isinstance(obj, Deep):
        return b"\x91" * obj.depth + msgpack.packb(obj.leaf)
    if isinstance(obj, dict):
        return _HEADERS.pack_map_header(len(obj)) + b"".join(_encode(k) + _encode(v) for k, v in obj.items())
    if isinstance(obj, list):
        return _HEADERS.pack_array_header(len(obj)) + b"".join(_encode(x) for x in obj)
    return msgpack.packb(obj, use_bin_type=True)


_HEADERS = msgpack.Packer()


def _zstd(raw: bytes, rng: random.Random) -> bytes:
    """Compressed with or without a declared content size (the decoder's two inflate paths)."""
    if rng.random() < 0.5:
        return zstandard.ZstdCompressor(level=rng.choice([1, 3])).compress(raw)
    obj = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    return obj.compress(raw) + obj.flush()


def _pack(obj: object, rng: random.Random) -> bytes:
    return _zstd(_encode(obj), rng)


def _sampling(rng: random.Random) -> SamplingParams:
    return SamplingParams(temperature=rng.choice([0.0, 0.7, 100.0]), top_k=rng.choice([-1, 1, 50, 2**31 - 1]),
                          top_p=rng.choice([1.0, 0.5, 1e-9]), max_tokens=rng.choice([1, 16, 2**31 - 1]),
                          ignore_eos=rng.random() < 0.5, seed=rng.choice([None, 0, 2**63 - 1]),
                          stop_token_ids=tuple(rng.randrange(2**32) for _ in range(rng.choice([0, 1, 5]))))


def _requests(rng: random.Random) -> list[Request]:
    return [Request(f"r{i}-{rng.randrange(10**6)}", np.asarray([rng.randrange(VOCAB) for _ in
                    range(rng.randint(1, 64))], np.uint32), _sampling(rng)) for i in range(rng.randint(0, 8))]


def _results(rng: random.Random) -> list[Result]:
    out = []
    for i in range(rng.randint(0, 8)):
        err = ErrorInfo(rng.choice(list(ErrorCode)), "m" * rng.randint(0, 50), rng.choice([None, 0.0, 2.5, 3600]))
        prompt = rng.randint(0, 5000)
        out.append(Result(rng.choice([f"r{i}", None]), [rng.randrange(2**32) for _ in range(rng.randint(0, 20))],
                          rng.choice(["stop", "length", None]), prompt, rng.randint(0, prompt), rng.randint(-1, 64),
                          "cpu-0", "node", {"queue_s": rng.random(), "steps": rng.randint(0, 9)},
                          err if rng.random() < 0.3 else None, "ab12"))
    return out


def _valid_obj(target: str, rng: random.Random) -> object:
    if target == "requests":
        return {"version": WIRE_VERSION, "model_revision": "rev", "requests": [r.to_wire() for r in _requests(rng)]}
    return [r.to_wire() for r in _results(rng)]


def _valid_frame(target: str, rng: random.Random) -> bytes:
    if target == "requests":
        return encode_requests(_requests(rng), "rev", level=rng.choice([1, 3, 19]))
    return encode_results(_results(rng), level=rng.choice([1, 3]))


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif op == 2:
            del b[i:i + rng.randint(1, 16)]
        elif op == 3:
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        else:
            b[i:i] = b[rng.randrange(len(b) + 1):][:rng.randint(1, 64)]
    return bytes(b)


def _hostile(rng: random.Random) -> object:
    r = rng.random()
    if r < 0.6:
        return rng.choice(HOSTILE)
    if r < 0.7:
        return Deep(rng.randint(900, 1100), rng.choice(HOSTILE))
    if r < 0.8:
        return [rng.randrange(2**32) for _ in range(rng.choice([257, 8193]))]
    if r < 0.9:
        return {f"k{i}": i for i in range(rng.choice([8, 300]))}
    return msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randint(0, 8)))


def _replace_node(obj: object, rng: random.Random) -> object:
    """obj with one node (a map value, a list item or a map key) replaced by a hostile value."""
    if isinstance(obj, dict) and obj and rng.random() < 0.8:
        key = rng.choice(list(obj))
        if rng.random() < 0.1:
            return {**{k: v for k, v in obj.items() if k != key}, rng.choice(["zz", b"kb", "id"]): obj[key]}
        return {**obj, key: _replace_node(obj[key], rng)}
    if isinstance(obj, list) and obj and rng.random() < 0.8:
        i = rng.randrange(len(obj))
        return obj[:i] + [_replace_node(obj[i], rng)] + obj[i + 1:]
    return _hostile(rng)


def _random_obj(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth > 4 or r < 0.4:
        return rng.choice(HOSTILE + [rng.randrange(-2**63, 2**64), rng.random(), rng.randbytes(rng.randint(0, 9))])
    if r < 0.7:
        return [_random_obj(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    keys = ["id", "prompt", "sampling", "version", "model_revision", "requests", "error", "timings", "code", "x"]
    return {rng.choice(keys): _random_obj(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def _bomb(target: str, budget: int, rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:  # no declared size, inflating past the budget
        obj = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
        return obj.compress(bytes(budget + rng.randint(1, budget))) + obj.flush()
    if kind == 1:  # a declared size over the budget
        return zstandard.ZstdCompressor(level=1).compress(bytes(budget + 1))
    if kind == 2:  # a header declaring less than the frame inflates to
        frame = bytearray(zstandard.ZstdCompressor(level=1).compress(bytes(4096)))
        frame[6:8] = rng.randrange(0, 3000).to_bytes(2, "little")
        return bytes(frame)
    if kind == 3:  # a window larger than the decoder accepts
        params = zstandard.ZstdCompressionParameters.from_level(1, window_log=27, write_content_size=False)
        obj = zstandard.ZstdCompressor(compression_params=params).compressobj()
        return obj.compress(msgpack.packb(_valid_obj(target, rng))) + obj.flush()
    if kind == 4:  # concatenated frames
        return _valid_frame(target, rng) * rng.randint(2, 3)
    return _structure_bomb(target, budget, rng)


def _structure_bomb(target: str, budget: int, rng: random.Random) -> bytes:
    """An array of up to 8,192 (MAX_BATCH_REQUESTS, one more now and then) items that cost little on the wire
    and much in memory: empty arrays or maps, nils, ext types, or arrays as wide as the budget allows of
    short strings, ints or empty arrays (the densest: ~60 bytes in memory per 3 on the wire)."""
    leaf = rng.choice([b"\x90", b"\x80", b"\xc0", b"\xa2ab", b"\xcd\x01\x02", b"\xd4\x01\x01"])
    width = rng.choice([0, 15, 8192])
    item = leaf if width == 0 else (bytes([0x90 + width]) if width < 16 else b"\xdd" + width.to_bytes(4, "big"))
    item += leaf * width
    n = min(rng.randint(1, budget // 4), 8192 + (rng.random() < 0.1), max(1, (budget - 64) // len(item)))
    body = b"\xdd" + n.to_bytes(4, "big") + item * n
    if target == "requests":
        head = msgpack.packb({"version": WIRE_VERSION, "model_revision": "r"})
        body = bytes([0x83]) + head[1:] + msgpack.packb("requests") + body
    return _zstd(body, rng)


def memory_limit(budget: int) -> int:
    return MEMORY_FACTOR * budget + MAX_BATCH_REQUESTS * SLOT_BYTES


class Fuzzer:
    def __init__(self, seed: int, max_payload_bytes: int) -> None:
        self.rng = random.Random(seed)
        self.budget = max_payload_bytes
        self.limits = EngineLimits.of(VOCAB, MAX_MODEL_LEN, max_payload_bytes)
        self.kinds: dict[str, Callable[[str], bytes]] = {
            "valid": lambda t: _valid_frame(t, self.rng),
            "mutated_frame": lambda t: _mutate_bytes(_valid_frame(t, self.rng), self.rng),
            "mutated_msgpack": lambda t: _zstd(_mutate_bytes(msgpack.packb(_valid_obj(t, self.rng)), self.rng),
                                               self.rng),
            "mutated_object": lambda t: _pack(_replace_node(_valid_obj(t, self.rng), self.rng), self.rng),
            "random_bytes": lambda t: (b"\x28\xb5\x2f\xfd" if self.rng.random() < 0.5 else b"")
            + self.rng.randbytes(self.rng.randint(0, 2000)),
            "random_object": lambda t: _pack(_random_obj(self.rng), self.rng),
            "deep": lambda t: _pack(_replace_node(_valid_obj(t, self.rng), self.rng) if self.rng.random() < 0.3
                                    else Deep(self.rng.randint(900, 1100)), self.rng),
            "bomb": lambda t: _bomb(t, self.budget, self.rng),
        }

    def decode(self, target: str, payload: bytes) -> str:
        """The outcome's name; raises anything the property forbids."""
        try:
            if target == "requests":
                batch = decode_requests(payload, self.limits, expected_revision=None)
                assert all(isinstance(it, (Request, RequestError)) for it in batch.items)
                bad = Counter(it.code.value for it in batch.items if isinstance(it, RequestError))
                return f"ok, slot errors led by {bad.most_common(1)[0][0]}" if bad else "ok"
            results = decode_results(payload, self.budget)
            assert all(isinstance(r, Result) for r in results)
            return "ok"
        except WireError as e:
            return f"wire:{e.code.value}"

    def run(self, inputs: int, mem_every: int = 1, progress: bool = False) -> dict:
        counts: Counter[str] = Counter()
        outcomes: Counter[str] = Counter()
        failures: list[dict] = []
        slowest = {"seconds": 0.0}
        peak_mem = {"bytes": 0}
        limit = memory_limit(self.budget)
        names = list(self.kinds)
        t_start = time.perf_counter()
        for i in range(inputs):
            kind, target = names[i % len(names)], ("requests", "results")[(i // len(names)) % 2]
            payload = self.kinds[kind](target)
            counts[f"{kind}/{target}"] += 1
            t0 = time.perf_counter()
            try:
                outcome = self.decode(target, payload)
            except Exception as e:  # noqa: BLE001 - the property: nothing but WireError escapes
                outcome = f"EXCEPTION {type(e).__name__}"
                failures.append({"kind": kind, "target": target, "error": f"{type(e).__name__}: {e}"[:300],
                                 "payload_hex": payload[:200].hex()})
            dt = time.perf_counter() - t0
            outcomes[f"{target} {outcome}"] += 1
            if dt > slowest["seconds"]:
                slowest = {"seconds": dt, "kind": kind, "target": target, "payload_bytes": len(payload),
                           "outcome": outcome}
            if kind == "bomb" or i % mem_every == 0:
                tracemalloc.start()
                try:
                    self.decode(target, payload)
                except Exception:  # noqa: BLE001 - counted above
                    pass
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                if peak > peak_mem["bytes"]:
                    peak_mem = {"bytes": peak, "kind": kind, "target": target, "outcome": outcome}
            if progress and (i + 1) % 10_000 == 0:
                print(f"{i + 1} inputs, {time.perf_counter() - t_start:.0f}s", file=sys.stderr)
        return {"inputs": inputs, "seconds": time.perf_counter() - t_start, "by_kind": dict(sorted(counts.items())),
                "outcomes": dict(sorted(outcomes.items())), "exceptions": len(failures), "failures": failures[:20],
                "slowest": slowest, "over_time_limit": slowest["seconds"] >= MAX_SECONDS,
                "peak_traced": peak_mem, "memory_limit_bytes": limit,
                "over_memory_limit": peak_mem["bytes"] > limit,
                "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-payload-bytes", type=int, default=DEFAULT_MAX_PAYLOAD_BYTES, help="both decoders' budget")
    ap.add_argument("--mem-every", type=int, default=1, help="trace the memory of every n-th input (and every bomb)")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    args = ap.parse_args(argv)
    summary = {"config": vars(args), **Fuzzer(args.seed, args.max_payload_bytes).run(args.inputs, args.mem_every,
                                                                                       progress=True)}
    text = json.dumps(summary, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    failed = summary["exceptions"] or summary["over_time_limit"] or summary["over_memory_limit"]
    if failed:
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    main()
