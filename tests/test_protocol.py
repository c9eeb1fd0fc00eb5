"""The protocol's types: field errors name their field (no message parsing), prompts are checked against the
limits engines publish with the engine's own length rule, results convert to the client's dicts."""
import numpy as np
import pytest

from flame_llm.limits import max_prompt_tokens
from flame_llm.protocol.errors import ErrorCode, ErrorInfo, RequestError
from flame_llm.protocol.types import DEFAULT_MAX_PAYLOAD_BYTES, EngineLimits, Result, sampling_from_map
from flame_llm.sampling_params import SamplingParams, brief

LIMITS = EngineLimits.of(vocab_size=100, max_model_len=8)


@pytest.mark.parametrize("sampling, field, words", [
    ({"top_p": 0}, "top_p", "'top_p' must be in (0, 1]"),
    ({"temperature": 0.5, "top_k": 0}, "top_k", "'top_k' must be -1 (off) or an integer in [1, 2147483647]"),
    ({"top_k": 2**63}, "top_k", "'top_k' must be -1 (off) or an integer in [1, 2147483647] (above the vocabulary: "
                                "off); got 9223372036854775808"),
    ({"temperature": float("nan")}, "temperature", "'temperature' must be a number in [0, 100]; got nan"),
    ({"top_p": float("inf")}, "top_p", "'top_p' must be in (0, 1]; got inf"),
    ({"max_tokens": 2**40}, "max_tokens", "'max_tokens' must be an integer >= 1 and <= 2147483647"),
    ({"stop_token_ids": [2**32]}, "stop_token_ids", "'stop_token_ids' must be non-negative integers < 2**32"),
    ({"stop_token_ids": [1] * 257}, "stop_token_ids", "'stop_token_ids' must be at most 256 token ids; got (1, 1,"),
    ({"seed": 2**64 - 1}, "seed", "'seed' must be None or an integer in [0, 2**63); got 18446744073709551615"),
    ({"max_tokens": "8"}, "max_tokens", "'max_tokens' must be an integer >= 1"),
    ({"max_tokens": True}, "max_tokens", "field 'max_tokens' must be a number, not True"),
    ({"seed": -1}, "seed", "'seed' must be None or an integer"),
    ({"ignore_eos": "yes"}, "ignore_eos", "field 'ignore_eos' must be true or false"),
    ({"stop_token_ids": 5}, "stop_token_ids", "field 'stop_token_ids' must be a list of token ids; got int"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids", "'stop_token_ids' must be non-negative integers"),
    ({"temp": 1.0}, "sampling", "unknown sampling fields ['temp']"),
    ({f"k{i:02}": 1 for i in range(40)}, "sampling", "unknown sampling fields ['k00', 'k01', 'k02', 'k03', 'k04', "
                                                      "'k05', 'k06', 'k07', ... (40 in all)]; known: temperature"),
    ({"ignore_eos": "y" * 1000}, "ignore_eos", "field 'ignore_eos' must be true or false; got 'yyyyyyyyyyyyy"),
    ([1], "sampling", "sampling must be a map; got list"),
])
def test_sampling_errors_carry_their_field(sampling, field, words):
    with pytest.raises(RequestError) as e:
        sampling_from_map(sampling)
    assert e.value.field == field and e.value.code is ErrorCode.BAD_SAMPLING
    assert words in str(e.value) and e.value.message == str(e.value)


def test_sampling_from_map_builds_the_params():
    sp = sampling_from_map({"temperature": 0.0, "max_tokens": 3, "stop_token_ids": [4, 5], "ignore_eos": True})
    assert sp == SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=(4, 5), ignore_eos=True)
    assert sampling_from_map({}) == SamplingParams()


@pytest.mark.parametrize("tokens, code, words", [
    ([], ErrorCode.EMPTY_PROMPT, "prompt must hold at least 1 token; got 0"),
    ([1] * 8, ErrorCode.PROMPT_TOO_LONG, "prompt has 8 tokens; the limit is 7 (max_model_len 8, and a prompt "
                                         "must leave room for one output token)"),
    ([1, 100, 3], ErrorCode.TOKEN_OUT_OF_RANGE, "token id 100 at position 1 is >= vocab_size 100"),
    ([1, 2, -4], ErrorCode.TOKEN_OUT_OF_RANGE, "token id -4 at position 2 is < 0"),
])
def test_prompt_checks_name_the_prompt_and_the_limit(tokens, code, words):
    with pytest.raises(RequestError) as e:
        LIMITS.check_prompt(np.asarray(tokens, dtype=np.int64))
    assert (e.value.code, e.value.field) == (code, "prompt") and words in str(e.value)


def test_limits_use_the_engines_rule_and_the_tightest_shard_wins():
    assert LIMITS.max_prompt_tokens == max_prompt_tokens(8) == 7
    LIMITS.check_prompt(np.full(7, 99))  # at the limits: accepted
    assert EngineLimits.tightest([LIMITS, EngineLimits.of(50, 16, 1 << 20)]) == EngineLimits(50, 8, 7, 1 << 20)
    assert LIMITS.to_dict() == {"vocab_size": 100, "max_model_len": 8, "max_prompt_tokens": 7,
                                "max_payload_bytes": DEFAULT_MAX_PAYLOAD_BYTES}


def test_result_dict_is_the_clients_plain_dict():
    r = Result("x", np.array([3, 4], np.uint32), "stop", 5, 2, shard=1, device="cpu-1",
               error=None, prompt_digest="d")
    d = r.to_dict()
    assert d["output_token_ids"] == [3, 4] and type(d["output_token_ids"][0]) is int and "text" not in d
    r.text, r.error = "hi", ErrorInfo(ErrorCode.DRAINING, "shard cpu-1 is draining")
    d = r.to_dict()
    assert d["text"] == "hi" and d["error"] == {"code": "draining", "message": "shard cpu-1 is draining",
                                                "retry_after_s": None}
    assert type(d["error"]["code"]) is str


def _nested(depth: int, leaf: object = "x") -> list:
    out = leaf
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize("value, text", [
    (_nested(5000), "[[<list of 1>]]"),  # repr() would raise RecursionError
    ("a" * 10**6, "'" + "a" * 76 + "..."),  # repr() would build a megabyte first
    (10**5000, "<int of 16610 bits>"),  # repr() would raise ValueError (int max str digits)
    ({"k": [1, 2]}, "{'k': [1, 2]}"),  # short values read as their repr
    ((1, -2), "(1, -2)"),
    ((7,), "(7,)"),
    (list(range(100)), "[0, 1, 2, 3, 4, 5, 6, 7, ... (100 in all)]"),
    (b"\x00\x01", "b'\\x00\\x01'"),
    (float("nan"), "nan"),
    (object(), "<object>"),
], ids=["deep", "long-str", "huge-int", "dict", "tuple", "1-tuple", "long-list", "bytes", "nan", "object"])
def test_brief_never_builds_the_full_repr(value, text):
    out = brief(value)
    assert out == text and len(out) <= 80


def test_brief_of_a_deep_id_is_a_short_request_error():
    from flame_llm.protocol.types import Request

    err = Request.from_wire({"id": _nested(1000), "prompt": b"\x01\x00\x00\x00", "sampling": {}}, LIMITS, set())
    assert isinstance(err, RequestError) and err.code is ErrorCode.BAD_ID
    assert err.message == "id must be a non-empty str of at most 256 UTF-8 bytes; got [[<list of 1>]]"
