import re
import resource
import threading
import tracemalloc

import msgpack
import numpy as np
import pytest
import zstandard

from flame_llm.protocol.errors import ErrorCode, ErrorInfo, RequestError, WireError
from flame_llm.protocol.types import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_BATCH_REQUESTS,
    MAX_ID_BYTES,
    MAX_USER_BYTES,
    RESULT_FIELDS,
    EngineLimits,
    Request,
    Result,
)
from flame_llm.protocol.wire import (
    BATCH_OVERHEAD,
    MAX_REVISION_BYTES,
    decode_requests,
    decode_results,
    encode_requests,
    encode_results,
    request_wire_size,
)
from flame_llm.sampling_params import MAX_OUTPUT_TOKENS, MAX_TOP_K, SEED_LIMIT, TOKEN_ID_LIMIT, SamplingParams

VOCAB, MAX_LEN = 1000, 64
GIB = 1 << 30


def _decode(payload, vocab_size=VOCAB, max_model_len=MAX_LEN, max_payload_bytes=DEFAULT_MAX_PAYLOAD_BYTES, **kw):
    return decode_requests(payload, EngineLimits.of(vocab_size, max_model_len, max_payload_bytes), **kw)


def _raw(obj, level=1) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(msgpack.packb(obj, use_bin_type=True))


def _req(rid="a", prompt=b"\x01\x00\x00\x00", sampling=None):
    return {"id": rid, "prompt": prompt, "sampling": {} if sampling is None else sampling}


def _batch(*reqs, version=1, revision="rev"):
    return _raw({"version": version, "model_revision": revision, "requests": list(reqs)})


def test_round_trip_lists_and_arrays():
    sp = SamplingParams(temperature=0.0, top_k=5, top_p=0.9, max_tokens=7, ignore_eos=True,
                        stop_token_ids=(3, 4), seed=11)
    reqs = [Request("x", [1, 2, 3], sp),
            Request("y", np.array([999, 0], dtype=np.uint32), SamplingParams()),
            Request("z", np.arange(5, dtype=np.int64), SamplingParams(max_tokens=2))]
    batch = _decode(encode_requests(reqs, "rev-1", level=3))
    assert batch.model_revision == "rev-1"
    assert [r.id for r in batch.items] == ["x", "y", "z"]
    assert [list(r.prompt_token_ids) for r in batch.items] == [[1, 2, 3], [999, 0], [0, 1, 2, 3, 4]]
    assert batch.items[0].sampling == sp
    assert batch.items[1].sampling == SamplingParams()
    assert batch.items[0].prompt_token_ids.dtype == np.uint32


def test_empty_batch():
    batch = _decode(encode_requests([], "r"))
    assert batch.items == [] and batch.model_revision == "r"


def test_big_batch_fits_the_default_budget():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128_000, 8000, dtype=np.uint32) for _ in range(128)]
    payload = encode_requests([Request(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)], "m")
    batch = _decode(payload, vocab_size=128_000, max_model_len=32768)
    assert len(batch.items) == 128
    assert all(np.array_equal(it.prompt_token_ids, p) for it, p in zip(batch.items, prompts, strict=True))


def test_request_wire_size_bounds_the_decoded_size():
    sp = SamplingParams(temperature=0.5, top_k=MAX_TOP_K, top_p=0.5, max_tokens=MAX_OUTPUT_TOKENS, ignore_eos=True,
                        stop_token_ids=(TOKEN_ID_LIMIT - 1,) * 3, seed=SEED_LIMIT - 1)  # every field at its widest
    counts = [1, 300, 70_000]
    reqs = [Request("é" * (MAX_ID_BYTES // 2 - i), np.zeros(n, np.uint32), sp, "ü" * (MAX_USER_BYTES // 2))
            for i, n in enumerate(counts)]
    payload = encode_requests(reqs, "r" * MAX_REVISION_BYTES)
    decoded = zstandard.frame_content_size(payload)
    bound = BATCH_OVERHEAD + sum(request_wire_size(n, num_stop_tokens=3) for n in counts)
    assert decoded <= bound < decoded + 3 * 64 + 64  # tight, not just large


def test_thread_local_codecs_round_trip_concurrently():
    errors = []

    def work(k):
        try:
            for j in range(20):
                reqs = [Request(f"{k}-{j}", [k, j, 1], SamplingParams())]
                assert _decode(encode_requests(reqs, "r", level=1 + k % 3)).items[0].id == f"{k}-{j}"
        except Exception as e:  # noqa: BLE001 - re-raised below in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("bad, where", [
    ([-1, 2], "in \\[0, 2\\*\\*32\\)"),
    ([1 << 32], "in \\[0, 2\\*\\*32\\)"),
    (np.array([1.5]), "integers"),
    (np.zeros((2, 2), np.int32), "flat"),
])
def test_encode_rejects_bad_token_ids(bad, where):
    with pytest.raises(ValueError, match=f"request 'q': prompt_token_ids.*{where}"):
        encode_requests([Request("q", bad, SamplingParams())], "r")


def test_encode_rejects_bad_level_and_revision():
    with pytest.raises(ValueError, match="zstd level must be an integer in \\[-7, 19\\]; got 22"):
        encode_requests([], "r", level=22)
    with pytest.raises(ValueError, match="model_revision must be a str of at most 256"):
        encode_requests([], "r" * 257)
    with pytest.raises(ValueError, match="model_revision"):
        encode_requests([], None)


# ---- batch-level failures ----

def _lying_header(declared: int) -> bytes:
    """A valid frame whose header declares `declared` bytes but that inflates to 4096."""
    frame = bytearray(zstandard.ZstdCompressor(level=1).compress(bytes(4096)))
    fhd = frame[4]
    single, dict_flag, fcs_flag = (fhd >> 5) & 1, fhd & 3, fhd >> 6
    assert fcs_flag == 1  # 2-byte field holding size - 256, for 4096
    off = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    frame[off:off + 2] = (declared - 256).to_bytes(2, "little")
    return bytes(frame)


@pytest.mark.parametrize("payload, code, match", [
    (b"not zstd at all", "bad_zstd", "not a zstd frame"),
    (b"", "bad_zstd", "not a zstd frame"),
    ("text", "bad_zstd", "must be bytes; got str"),
    (zstandard.ZstdCompressor().compress(b"abc" * 100)[:-5], "bad_zstd", "corrupt"),
    (zstandard.ZstdCompressor().compress(b"abc") * 2, "bad_zstd", "corrupt"),
    (_lying_header(300), "bad_zstd", "corrupt"),
    (zstandard.ZstdCompressor().compress(b"\xc1"), "bad_msgpack", "not valid msgpack"),
    (zstandard.ZstdCompressor().compress(msgpack.packb(1) + b"\x01"), "bad_msgpack", "ExtraData"),
    (zstandard.ZstdCompressor().compress(b"\x91" * 100_000), "bad_msgpack", "not valid msgpack"),
    (_raw([1, 2]), "bad_schema", "must be a map; got list"),
    (_raw({"version": 1, "requests": []}), "bad_schema", "keys must be exactly"),
    (_raw({"version": 1, "model_revision": "r", "requests": [], "x": 1}), "bad_schema", "'x'"),
    (_raw({"version": 1, "model_revision": 5, "requests": []}), "bad_schema", "model_revision must be a str"),
    (_raw({"version": 1, "model_revision": "r", "requests": {}}), "bad_schema", "requests must be a list"),
    (_batch(version=2), "bad_version", "version must be 1; got 2"),
    (_batch(version="1"), "bad_version", "version must be 1"),
    (_batch(version=True), "bad_version", "version must be 1"),
])
def test_batch_errors(payload, code, match):
    with pytest.raises(WireError, match=match) as e:
        _decode(payload)
    assert e.value.code == code
    assert isinstance(e.value, ValueError)


def test_wrong_revision_and_over_budget():
    payload = encode_requests([Request("a", [1] * 50, SamplingParams())], "rev-a")
    with pytest.raises(WireError, match="'rev-a' does not match the served model's 'rev-b'") as e:
        _decode(payload, expected_revision="rev-b")
    assert e.value.code == "wrong_revision"
    size = zstandard.frame_content_size(payload)
    assert _decode(payload, max_payload_bytes=size).items[0].id == "a"
    with pytest.raises(WireError, match=f"declares {size} decoded bytes; max_payload_bytes is {size - 1}$") \
            as e:
        _decode(payload, max_payload_bytes=size - 1)
    assert e.value.code == "over_budget"


def test_window_larger_than_decoder_limit_is_refused():
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=26, write_content_size=False)
    obj = zstandard.ZstdCompressor(compression_params=params).compressobj()
    payload = obj.compress(msgpack.packb([1])) + obj.flush()
    assert zstandard.get_frame_parameters(payload).window_size == 1 << 26
    assert zstandard.ZstdDecompressor().decompressobj().decompress(payload) == msgpack.packb([1])
    with pytest.raises(WireError) as e:
        _decode(payload)
    assert e.value.code == "bad_zstd"


# ---- decompression bombs ----

def _bomb(declare: bool) -> bytes:
    cctx = zstandard.ZstdCompressor(level=1)
    obj = cctx.compressobj(size=GIB) if declare else cctx.compressobj()
    zeros = bytes(1 << 20)
    return b"".join([obj.compress(zeros) for _ in range(GIB >> 20)] + [obj.flush()])


@pytest.fixture(scope="module")
def bombs():
    return {True: _bomb(True), False: _bomb(False)}


@pytest.mark.parametrize("declared", [True, False])
@pytest.mark.parametrize("decode", ["requests", "results"])
def test_bomb_is_never_inflated(bombs, declared, decode):
    payload = bombs[declared]
    assert len(payload) < 64 << 10 and zstandard.frame_content_size(payload) == (GIB if declared else -1)
    budget = DEFAULT_MAX_PAYLOAD_BYTES
    assert budget == 4 << 20
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match=f"max_payload_bytes.*{budget}") as e:
            if decode == "requests":
                _decode(payload)  # the default budget is 4 MiB
            else:
                decode_results(payload, max_payload_bytes=budget)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.code == "over_budget"
    assert peak < 2 * budget + (2 << 20)  # chunks up to the budget at most, never the 1 GiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 64 << 10


def test_undeclared_size_within_budget_decodes():
    obj = zstandard.ZstdCompressor(level=1).compressobj()
    raw = msgpack.packb({"version": 1, "model_revision": "r",
                         "requests": [_req("u", b"\x05\x00\x00\x00" * 3)]}, use_bin_type=True)
    payload = obj.compress(raw) + obj.flush()
    assert zstandard.frame_content_size(payload) == -1
    assert list(_decode(payload).items[0].prompt_token_ids) == [5, 5, 5]
    with pytest.raises(WireError, match=f"inflates past max_payload_bytes {len(raw) - 1}"):
        _decode(payload, max_payload_bytes=len(raw) - 1)


# ---- per-request failures: the bad slot gets its error, the others proceed ----

_TOK = np.array([7, 8], "<u4").tobytes()


@pytest.mark.parametrize("bad, rid, code, match", [
    ("not a map", None, "bad_id", "id must be a non-empty str"),
    ({"prompt": _TOK, "sampling": {}}, None, "bad_id", "got None"),
    (_req(rid=5), None, "bad_id", "got 5"),
    (_req(rid=""), None, "bad_id", "non-empty"),
    (_req(rid="é" * 129), None, "bad_id", "at most 256 UTF-8 bytes"),
    (_req(rid="ok"), "ok", "duplicate_id", "'ok' appears more than once"),
    ({**_req(rid="b"), "extra": 1}, "b", "bad_request", "'extra'"),
    ({"id": "b", "prompt": _TOK}, "b", "bad_request", "keys must be exactly id, prompt, sampling"),
    ({**_req(rid="b"), "user": ""}, "b", "bad_request", "user must be a non-empty str"),
    ({**_req(rid="b"), "user": 7}, "b", "bad_request", "user must be .* at most 128 UTF-8 bytes"),
    ({**_req(rid="b"), "user": "é" * 65}, "b", "bad_request", "at most 128 UTF-8 bytes"),
    (_req(rid="b", prompt="text"), "b", "bad_prompt", "must be bytes"),
    (_req(rid="b", prompt=b""), "b", "empty_prompt", "at least 1 token; got 0"),
    (_req(rid="b", prompt=b"\x01\x02\x03\x04\x05"), "b", "bad_prompt", "5 bytes is not a multiple of 4"),
    (_req(rid="b", prompt=bytes(4 * MAX_LEN)), "b", "prompt_too_long",
     "64 tokens; the limit is 63 \\(max_model_len 64, and a prompt must leave room for one output token\\)"),
    (_req(rid="b", prompt=np.array([1, VOCAB], "<u4").tobytes()), "b", "token_out_of_range",
     "token id 1000 at position 1 is >= vocab_size 1000"),
    (_req(rid="b", sampling=[1]), "b", "bad_sampling", "sampling must be a map"),
    (_req(rid="b", sampling={"temp": 1.0}), "b", "bad_sampling", "unknown sampling fields \\['temp'\\]"),
    (_req(rid="b", sampling={"temperature": -1.0}), "b", "bad_sampling", "'temperature' must be"),
    (_req(rid="b", sampling={"top_p": 0}), "b", "bad_sampling", "'top_p' must be in \\(0, 1\\]"),
    (_req(rid="b", sampling={"stop_token_ids": 5}), "b", "bad_sampling", "int"),
])
def test_request_errors_are_per_slot(bad, rid, code, match):
    payload = _batch(_req("ok", _TOK), bad, _req("last", _TOK, {"max_tokens": 3}))
    items = _decode(payload).items
    assert len(items) == 3
    assert items[0].id == "ok" and list(items[0].prompt_token_ids) == [7, 8]
    assert items[2].id == "last" and items[2].sampling.max_tokens == 3
    err = items[1]
    assert isinstance(err, RequestError), err
    assert (err.id, err.code) == (rid, code)
    assert re.search(match, err.message), err.message
    assert err.info().to_dict() == {"code": code, "message": err.message, "retry_after_s": None}


def test_a_requests_user_travels_only_when_set():
    """Request.user (the shard's fair admission turns of a sender's users): off the wire when "", so a client
    without users sends the bytes it sent before."""
    plain = Request("a", [1, 2], SamplingParams())
    assert "user" not in plain.to_wire()
    items = _decode(encode_requests([plain, Request("b", [3], SamplingParams(), "key:0123")], "m")).items
    assert (items[0].user, items[1].user) == ("", "key:0123")


def test_prompt_at_the_limits_is_accepted():
    """The engine's rule (flame_llm.config.max_prompt_tokens): a prompt leaves room for one output token."""
    from flame_llm.limits import max_prompt_tokens

    assert EngineLimits.of(VOCAB, MAX_LEN).max_prompt_tokens == max_prompt_tokens(MAX_LEN) == MAX_LEN - 1
    items = _decode(_batch(_req("a", np.array([VOCAB - 1] * (MAX_LEN - 1), "<u4").tobytes()))).items
    assert isinstance(items[0].prompt_token_ids, np.ndarray) and len(items[0].prompt_token_ids) == MAX_LEN - 1


# ---- results ----

def test_results_round_trip_with_defaults_and_errors():
    ok = Result("a", np.array([1, 2, 3], np.uint32), "length", prompt_tokens=9, cached_tokens=4, shard=1,
                device="GPU-x", node="n1", timings={"queue_s": 0.5, "steps": 3}, prompt_digest="ab12")
    err = Result("b", shard=0, error=ErrorInfo(ErrorCode.OVERLOADED, "over 64 requests", 0.25))
    out = decode_results(encode_results([ok, err, Result(None, [5])], level=5))
    assert out[0] == Result("a", [1, 2, 3], "length", 9, 4, 1, "GPU-x", "n1", {"queue_s": 0.5, "steps": 3}, None,
                            "ab12")
    assert out[0].to_dict() == {"id": "a", "output_token_ids": [1, 2, 3], "finish_reason": "length",
                                "prompt_tokens": 9, "cached_tokens": 4, "shard": 1, "device": "GPU-x", "node": "n1",
                                "timings": {"queue_s": 0.5, "steps": 3}, "error": None, "prompt_digest": "ab12"}
    assert out[1].to_dict()["error"] == {"code": "overloaded", "message": "over 64 requests", "retry_after_s": 0.25}
    assert out[1].error.code is ErrorCode.OVERLOADED
    # a field left out takes its default
    assert out[1].output_token_ids == [] and out[1].finish_reason is None and out[1].shard == 0
    assert out[1].prompt_digest == "" and out[1].device == ""
    assert out[2].id is None and out[2].output_token_ids == [5]
    assert all(set(r.to_wire()) == set(RESULT_FIELDS) for r in out)
    assert decode_results(encode_results([])) == []


def test_encode_results_rejects_unknown_fields_and_bad_tokens():
    with pytest.raises(TypeError, match="tokens"):
        Result("a", tokens=[])
    with pytest.raises(ValueError, match="result 'a': output_token_ids must be in"):
        encode_results([Result("a", [-3])])


def test_retryable_codes():
    assert {c.value for c in ErrorCode if c.retryable} == {"overloaded", "draining", "router_error",
                                                           "shard_unavailable"}
    assert not any(c.retryable for c in (ErrorCode.BAD_SAMPLING, ErrorCode.SHARD_DIED, ErrorCode.ENGINE_ERROR))
    assert f"{ErrorCode.DRAINING}" == str(ErrorCode.DRAINING) == "draining" == ErrorCode.DRAINING


def _err(retry_after_s):
    return {"code": "overloaded", "message": "m", "retry_after_s": retry_after_s}


def _deep(depth: int, leaf=1):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def _result(**kw):
    return {"id": "a", "output_token_ids": b"", "finish_reason": "stop", "prompt_tokens": 1,
            "cached_tokens": 0, "shard": 0, "device": "", "node": "", "timings": {}, "error": None,
            "prompt_digest": "", **kw}


@pytest.mark.parametrize("obj, code, match", [
    ({"a": 1}, "bad_schema", "result payload must be a list; got dict"),
    ([1], "bad_result", "result 0 must be a map"),
    ([{"id": "a"}], "bad_result", "result 0 must be a map with keys"),
    ([_result(), _result(shard="0")], "bad_result", "result 1 field 'shard' must be int; got str"),
    ([_result(output_token_ids=b"\x00" * 6)], "bad_result", "6 bytes, not a multiple of 4"),
    ([_result(timings={"t": "x"})], "bad_result", "timings must map str to finite numbers; got {'t': 'x'}"),
    ([_result(timings={"t": float("nan")})], "bad_result", "timings must map str to finite numbers; got {'t': nan}"),
    ([_result(timings={"t": float("-inf")})], "bad_result", "finite numbers; got {'t': -inf}"),
    ([_result(timings={"t": True})], "bad_result", "finite numbers; got {'t': True}"),
    ([_result(prompt_tokens=-1)], "bad_result", "field 'prompt_tokens' must be an integer in [0, 4294967295]; got -1"),
    ([_result(prompt_tokens=2**32)], "bad_result",
     "'prompt_tokens' must be an integer in [0, 4294967295]; got 4294967296"),
    ([_result(prompt_tokens=True)], "bad_result", "'prompt_tokens' must be an integer in [0, 4294967295]; got True"),
    ([_result(cached_tokens=-3)], "bad_result",
     "field 'cached_tokens' must be an integer in [0, 1] (prompt_tokens); got -3"),
    ([_result(prompt_tokens=4, cached_tokens=5)], "bad_result", "'cached_tokens' must be an integer in [0, 4] "
                                                                "(prompt_tokens); got 5"),
    ([_result(shard=-2)], "bad_result", "field 'shard' must be an integer in [-1, 2147483647]; got -2"),
    ([_result(error=_err(float("nan")))], "bad_result",
     "result 0 error retry_after_s must be None or a number in [0, 3600]; got nan"),
    ([_result(error=_err(float("inf")))], "bad_result", "retry_after_s must be None or a number in [0, 3600]; got inf"),
    ([_result(error=_err(-0.5))], "bad_result", "retry_after_s must be None or a number in [0, 3600]; got -0.5"),
    ([_result(error=_err(1e300))], "bad_result", "retry_after_s must be None or a number in [0, 3600]; got 1e+300"),
    ([_result(error=_err(True))], "bad_result", "retry_after_s must be None or a number in [0, 3600]; got True"),
    ([_result(error={"code": "overloaded", "message": "m" * 9000, "retry_after_s": _deep(900)})], "bad_result",
     "error must be a map {code: str, message: str, retry_after_s: number or None}; got {'code': 'overloaded', "),
    ([_result(error={"code": "x"})], "bad_result", "error must be a map"),
    ([_result(error={"code": "x", "message": 1, "retry_after_s": None})], "bad_result",
     "error must be a map"),
    ([_result(error={"code": "queue_full", "message": "m", "retry_after_s": None})], "bad_result",
     "error code 'queue_full' is not one of the protocol's codes"),
])
def test_decode_results_errors(obj, code, match):
    with pytest.raises(WireError, match=re.escape(match)) as e:
        decode_results(_raw(obj))
    assert e.value.code == code


def test_decode_results_over_budget():
    payload = encode_results([Result("a", [1] * 100)])
    with pytest.raises(WireError, match="max_payload_bytes is 100") as e:
        decode_results(payload, max_payload_bytes=100)
    assert e.value.code == "over_budget"


def test_results_at_their_limits_decode():
    recs = [_result(prompt_tokens=2**32 - 1, cached_tokens=2**32 - 1, shard=-1, timings={"t": 0, "u": -1.5},
                    error=_err(3600)), _result(prompt_tokens=0, cached_tokens=0, error=_err(0))]
    out = decode_results(_raw(recs))
    assert out[0].error.retry_after_s == 3600 and out[1].error.retry_after_s == 0 and out[0].shard == -1


# ---- nesting, sizes and structure bombs: a clean WireError or a per-slot RequestError, bounded messages ----

_PAD = np.full(2500, 7, dtype="<u4").tobytes()  # a 10 kB prompt: room for ~1,250 containers in its batch


def test_a_deeply_nested_id_is_a_short_bad_id():
    """~1,000 levels pass msgpack's own 1,024-level stack; the error message must not repr() them. Beside a
    10 kB prompt the batch's container budget holds them, and the id's slot fails alone."""
    items = _decode(_batch(_req("ok", _PAD), _req(rid=_deep(1000, "x"), prompt=_TOK))).items
    err = items[1]
    assert isinstance(err, RequestError) and err.code == "bad_id" and err.id is None
    assert err.message == "id must be a non-empty str of at most 256 UTF-8 bytes; got [[<list of 1>]]"
    assert items[0].id == "ok"
    # alone in a small batch, 1,000 levels are 1,000 containers in ~1 kB: the whole batch is refused
    with pytest.raises(WireError, match="holds more than") as e:
        _decode(_batch(_req("ok", _TOK), _req(rid=_deep(1000, "x"), prompt=_TOK)))
    assert e.value.code == "over_budget"


@pytest.mark.parametrize("where", ["version", "revision", "sampling", "stop", "keys"])
def test_deep_values_anywhere_in_a_batch_fail_cleanly(where):
    deep = _deep(1000)
    req = _req("b", _PAD, {"stop_token_ids": deep} if where == "stop" else {"temperature": deep})
    if where == "keys":
        req = {"id": "b", "prompt": _PAD, "sampling": {}, "x": deep}
    payload = _raw({"version": deep if where == "version" else 1, "model_revision": deep if where == "revision"
                    else "rev", "requests": [req]})
    if where in ("version", "revision"):
        with pytest.raises(WireError) as e:
            _decode(payload)
        assert len(str(e.value)) < 200
        return
    err = _decode(payload).items[0]
    assert isinstance(err, RequestError) and len(err.message) < 300, err.message


def test_nesting_past_msgpacks_stack_is_bad_msgpack():
    for decode in (_decode, decode_results):
        with pytest.raises(WireError) as e:
            decode(zstandard.ZstdCompressor().compress(b"\x91" * 2000 + b"\x01"))
        assert e.value.code == "bad_msgpack"


def _array32(n: int, item: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + item * n


@pytest.mark.parametrize("raw, code, match", [
    (_array32(8000, b"\x98" + b"\x90" * 8), "over_budget",
     "holds more than 9016 maps and arrays \\(one per 8 decoded bytes\\)"),
    (_array32(8000, b"\x88" + b"\xa1k\x80" * 8), "over_budget", "holds more than 25016 maps and arrays"),
    (_array32(8193, b"\xc0"), "bad_msgpack", "8193 exceeds max_array_len\\(8192\\)"),
    (msgpack.packb({f"k{i}": 1 for i in range(300)}), "bad_msgpack", "300 exceeds max_map_len\\(256\\)"),
    (msgpack.packb(["x" * 70_000]), "bad_msgpack", "70000 exceeds max_str_len\\(65536\\)"),
    (msgpack.packb(msgpack.ExtType(1, b"x")), "bad_msgpack", "exceeds max_ext_len\\(0\\)"),
    (msgpack.packb([msgpack.Timestamp(1)]), "bad_msgpack", "exceeds max_ext_len\\(0\\)"),
    (b"\xa2\xff\xfe", "bad_msgpack", "UnicodeDecodeError"),
    (msgpack.packb({1: 2}), "bad_msgpack", "ValueError"),  # keys must be str or bytes
], ids=["empty-arrays", "empty-maps", "long-array", "big-map", "long-str", "ext", "timestamp", "bad-utf8", "int-key"])
def test_unpacking_is_bounded(raw, code, match):
    with pytest.raises(WireError, match=match) as e:
        _decode(zstandard.ZstdCompressor().compress(raw))
    assert e.value.code == code


def test_results_allow_long_messages_but_not_bombs():
    long = _result(error={"code": "engine_error", "message": "m" * 500_000, "retry_after_s": None})
    assert len(decode_results(_raw([long]))[0].error.message) == 500_000
    with pytest.raises(WireError, match="holds more than") as e:
        decode_results(zstandard.ZstdCompressor().compress(_array32(8000, b"\x98" + b"\x90" * 8)))
    assert e.value.code == "over_budget"


def test_a_batch_of_many_invalid_slots_is_bounded():
    """8,192 slots at most (MAX_BATCH_REQUESTS, msgpack's max_array_len), each error message short."""
    items = _decode(zstandard.ZstdCompressor().compress(msgpack.packb(
        {"version": 1, "model_revision": "r", "requests": [None] * MAX_BATCH_REQUESTS}))).items
    assert len(items) == 8192 and all(isinstance(e, RequestError) and e.code == "bad_id" for e in items)
    assert max(len(e.message) for e in items) < 100
    with pytest.raises(ValueError, match="a batch holds at most 8192 requests; got 8193"):
        encode_requests([Request(f"r{i}", [1], SamplingParams()) for i in range(8193)], "r")


def test_container_bound_admits_the_densest_valid_batches():
    """Minimal requests (2 maps each, ~29 bytes) and results stay under one container per 8 bytes."""
    reqs = [{"id": f"{i}", "prompt": _TOK, "sampling": {"stop_token_ids": []}} for i in range(5000)]
    assert len(_decode(_raw({"version": 1, "model_revision": "r", "requests": reqs})).items) == 5000
    assert len(decode_results(_raw([_result(error=_err(0.1))] * 5000))) == 5000
    assert len(_decode(encode_requests([], "r")).items) == 0


def test_top_k_of_two_to_the_63_is_rejected_at_the_wire():
    err = _decode(_batch(_req("b", _TOK, {"top_k": 2**63, "temperature": 1.0}))).items[0]
    assert isinstance(err, RequestError) and (err.code, err.field, err.id) == ("bad_sampling", "top_k", "b")
    assert "in [1, 2147483647]" in err.message and err.message.endswith("got 9223372036854775808")


@pytest.mark.parametrize("leaf", [b"\xa2ab", b"\xcd\x01\x02", b"\x90"], ids=["2-char-str", "uint16", "empty-array"])
def test_the_densest_payloads_stay_within_24x_their_budget(leaf):
    """The most memory per wire byte msgpack can build within the bounds: full 8,192-item arrays of 3-byte
    items (a 2-char str is ~60 bytes in memory); empty arrays stop at the container bound."""
    budget = 512 << 10
    inner = b"\xdd" + (8192).to_bytes(4, "big") + leaf * 8192
    payload = zstandard.ZstdCompressor().compress(_array32((budget - 64) // len(inner), inner))
    tracemalloc.start()
    try:
        decode_results(payload, budget)
    except WireError as e:
        assert e.code in ("bad_result", "over_budget")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak <= 24 * budget
