import re
import resource
import threading
import tracemalloc

import msgpack
import numpy as np
import pytest
import zstandard

from flame_llm.protocol.types import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_ID_BYTES,
    RESULT_FIELDS,
    EngineLimits,
    ErrorCode,
    ErrorInfo,
    Request,
    RequestError,
    Result,
    WireError,
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
from flame_llm.sampling_params import SamplingParams

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
    sp = SamplingParams(temperature=0.5, top_k=2**62, top_p=0.5, max_tokens=2**62, ignore_eos=True,
                        stop_token_ids=(2**62,) * 3, seed=2**63 - 1)
    counts = [1, 300, 70_000]
    reqs = [Request("é" * (MAX_ID_BYTES // 2 - i), np.zeros(n, np.uint32), sp)
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
    ([_result(timings={"t": "x"})], "bad_result", "timings must map str to numbers"),
    ([_result(error={"code": "x"})], "bad_result", "error must be a map"),
    ([_result(error={"code": "x", "message": 1, "retry_after_s": None})], "bad_result",
     "error must be a map"),
    ([_result(error={"code": "queue_full", "message": "m", "retry_after_s": None})], "bad_result",
     "error code 'queue_full' is not one of the protocol's codes"),
])
def test_decode_results_errors(obj, code, match):
    with pytest.raises(WireError, match=match) as e:
        decode_results(_raw(obj))
    assert e.value.code == code


def test_decode_results_over_budget():
    payload = encode_results([Result("a", [1] * 100)])
    with pytest.raises(WireError, match="max_payload_bytes is 100") as e:
        decode_results(payload, max_payload_bytes=100)
    assert e.value.code == "over_budget"
