"""The wire fuzzer in CI (issue 14): a bounded run of tests/fuzz_wire.py (every kind of hostile input, both
decoders, seconds) and hypothesis properties: whatever arrives, the decoders return a batch (Request or
RequestError items) or results, or raise WireError; nothing else escapes. The long run is
`python tests/fuzz_wire.py --inputs 100000`."""
import math

import msgpack
import zstandard
from fuzz_wire import MAX_SECONDS, Deep, Fuzzer, _encode, memory_limit  # tests/fuzz_wire.py (tests/ is on the path)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flame_llm.protocol.errors import RequestError, WireError
from flame_llm.protocol.types import EngineLimits, Request, Result
from flame_llm.protocol.wire import decode_requests, decode_results

BUDGET = 256 << 10
LIMITS = EngineLimits.of(32_000, 4096, BUDGET)


def test_bounded_fuzz_run_keeps_the_property():
    summary = Fuzzer(seed=14, max_payload_bytes=BUDGET).run(inputs=1600, mem_every=4)
    assert summary["exceptions"] == 0, summary["failures"]
    assert not summary["over_time_limit"] and summary["slowest"]["seconds"] < MAX_SECONDS, summary["slowest"]
    assert summary["peak_traced"]["bytes"] <= memory_limit(BUDGET) == 24 * BUDGET + 8192 * 1024, summary["peak_traced"]
    kinds = {k.split("/")[0] for k in summary["by_kind"]}
    assert kinds == {"valid", "mutated_frame", "mutated_msgpack", "mutated_object", "random_bytes",
                     "random_object", "deep", "bomb"}
    outcomes = summary["outcomes"]
    # every decoder path is reached: clean decodes, per-slot errors and each payload-level refusal
    assert outcomes["requests ok"] > 0 and outcomes["results ok"] > 0
    assert any(k.startswith("requests ok, slot errors") for k in outcomes)
    for code in ("bad_zstd", "over_budget", "bad_msgpack", "bad_schema"):
        assert outcomes[f"requests wire:{code}"] > 0 and outcomes[f"results wire:{code}"] > 0
    assert outcomes["results wire:bad_result"] > 0


def _decode_both(payload: bytes) -> None:
    try:
        batch = decode_requests(payload, LIMITS)
        assert all(isinstance(it, (Request, RequestError)) for it in batch.items)
    except WireError:
        pass
    try:
        assert all(isinstance(r, Result) for r in decode_results(payload, BUDGET))
    except WireError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_random_bytes_raise_only_wire_errors(data):
    _decode_both(data)
    _decode_both(zstandard.ZstdCompressor().compress(data))


_leaves = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
           | st.binary(max_size=20) | st.sampled_from([math.nan, math.inf, 2**64 - 1, -2**63]))
_keys = st.sampled_from(["id", "prompt", "sampling", "version", "model_revision", "requests", "temperature",
                         "top_k", "top_p", "max_tokens", "seed", "stop_token_ids", "ignore_eos", "error", "code",
                         "message", "retry_after_s", "timings", "prompt_tokens", "cached_tokens", "shard"]) | st.text(
    max_size=5)
_objects = st.recursive(_leaves, lambda kids: st.lists(kids, max_size=5) | st.dictionaries(_keys, kids, max_size=6),
                        max_leaves=40)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_objects)
def test_wrong_schemas_raise_only_wire_errors(obj):
    _decode_both(zstandard.ZstdCompressor().compress(msgpack.packb(obj, use_bin_type=True)))


@settings(max_examples=100, deadline=None)
@given(st.integers(900, 1100), _leaves, st.sampled_from(["id", "sampling", "requests", "root"]))
def test_deep_nesting_anywhere_raises_only_wire_errors(depth, leaf, where):
    deep = Deep(depth, leaf)
    req = {"id": "a", "prompt": b"\x01\x00\x00\x00" * 300, "sampling": {}}
    if where == "id":
        req["id"] = deep
    elif where == "sampling":
        req["sampling"] = {"temperature": deep}
    batch = {"version": 1, "model_revision": "r", "requests": deep if where == "requests" else [req]}
    raw = _encode(deep if where == "root" else batch)
    _decode_both(zstandard.ZstdCompressor().compress(raw))
