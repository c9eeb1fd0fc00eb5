"""vLLM's /tokenize and /detokenize on the front door (flame_llm/serving/openai_tokenize.py): the ids and text
the model's tokenizer gives, the prompt chat completions would make, and a 4xx naming the field for what the
routes do not take. Over HTTP on serve-http's app; `flame-llm serve`'s door runs the same app
(tests/test_external_clients.py runs vLLM's client, which calls /tokenize, against both)."""
import pytest
from test_http_server import KEY, _call, _serve

from flame_llm import AsyncEngine
from flame_llm.models.tokenizer import load_tokenizer
from flame_llm.protocol.types import EngineLimits
from flame_llm.serving import openai_tokenize
from flame_llm.serving.http_app import HttpConfig
from flame_llm.serving.http_server import EngineBackend
from flame_llm.serving.openai_errors import ApiError

TEXT = "The keeper climbed the steps"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("", "tiny")


@pytest.fixture(scope="module")
def door(tiny_llama):
    """serve-http's app over the tiny model with the tiny tokenizer (and a keyed door, a door without one)."""
    engine = AsyncEngine.from_args(tiny_llama, tokenizer="tiny", block_size=16, max_model_len=512,
                                   max_num_batched_tokens=512, cpu_kvcache_gib=0.01)
    plain = AsyncEngine.from_args(tiny_llama, block_size=16, max_model_len=512, max_num_batched_tokens=512,
                                  cpu_kvcache_gib=0.01)
    url, close = _serve(EngineBackend(engine, "cpu-0", "tiny"), HttpConfig(port=0, max_tokens_per_request=64))
    keyed, close_keyed = _serve(EngineBackend(engine, "cpu-0", "tiny"), HttpConfig(port=0, api_key=KEY))
    bare, close_bare = _serve(EngineBackend(plain, "cpu-0", "tiny"), HttpConfig(port=0))
    yield url, keyed, bare
    for close_one in (close, close_keyed, close_bare):
        close_one()
    engine.shutdown()
    plain.shutdown()


def test_tokenize_and_detokenize_are_the_models_tokenizer(door, tok):
    url, *_ = door
    status, out = _call(f"{url}/tokenize", {"model": "tiny", "prompt": TEXT, "add_special_tokens": False})
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert status == 200 and out == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    status, out = _call(f"{url}/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert status == 200 and out["tokens"] == tok.encode(TEXT)  # add_special_tokens: true by default, as vLLM's
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    status, out = _call(f"{url}/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200 and out == {"prompt": tok.decode(ids)} and out["prompt"] == TEXT
    # messages: the prompt /v1/chat/completions makes (its usage counts the same tokens)
    messages = [{"role": "user", "content": "Is the lamp lit?"}]
    status, out = _call(f"{url}/tokenize", {"messages": messages})
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert status == 200 and out["tokens"] == want
    status, chat = _call(f"{url}/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 200 and chat["usage"]["prompt_tokens"] == out["count"]


@pytest.mark.parametrize("route,body,status,param,words", [
    ("tokenize", {"prompt": TEXT, "truncate": 5}, 400, "truncate", "unrecognized field"),
    ("tokenize", {"prompt": TEXT, "messages": []}, 400, "prompt", "exactly one of"),
    ("tokenize", {}, 400, "messages", "exactly one of"),
    ("tokenize", {"prompt": [1, 2]}, 400, "prompt", "must be text"),
    ("tokenize", {"prompt": TEXT, "add_special_tokens": "yes"}, 400, "add_special_tokens", "true or false"),
    ("tokenize", {"prompt": TEXT, "add_generation_prompt": True}, 400, "add_generation_prompt", "with 'messages'"),
    ("tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}, 400,
     "add_generation_prompt", "only as true"),
    ("tokenize", {"messages": [{"role": "user"}]}, 400, "messages", "non-empty list"),
    ("tokenize", {"model": "gpt-4", "prompt": TEXT}, 404, "model", "does not exist"),
    ("tokenize", [TEXT], 400, "body", "JSON object"),
    ("detokenize", {"tokens": [1, -2]}, 400, "tokens", "integers >= 0"),
    ("detokenize", {"tokens": "1 2"}, 400, "tokens", "list of token ids"),
    ("detokenize", {"tokens": [1, 512]}, 400, "tokens", "token id 512 at position 1 is >= vocab_size 512"),
    ("detokenize", {"tokens": [1] * 65}, 413, "tokens", "the limit is 64 per request"),
    ("detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens", "unrecognized"),
])
def test_what_the_routes_do_not_take_is_an_error_naming_the_field(door, route, body, status, param, words):
    url, *_ = door
    got, out = _call(f"{url}/{route}", body)
    assert got == status and out["error"]["param"] == param and words in out["error"]["message"], out


def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized(tok):
    limits = EngineLimits.of(512, 512)
    with pytest.raises(ApiError) as e:
        openai_tokenize.tokenize({"prompt": "x" * 101}, tok, limits, text_limit=100)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert openai_tokenize.tokenize({"prompt": "x" * 100}, tok, limits, text_limit=100)["count"] > 0


def test_a_keyed_door_wants_the_key_and_a_door_without_tokenizer_says_so(door):
    url, keyed, bare = door
    assert _call(f"{keyed}/tokenize", {"prompt": TEXT})[0] == 401
    assert _call(f"{keyed}/detokenize", {"tokens": [5]}, headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    for route, body in (("tokenize", {"prompt": TEXT}), ("detokenize", {"tokens": [5]})):
        status, out = _call(f"{bare}/{route}", body)
        assert status == 400 and "needs a tokenizer" in out["error"]["message"], out
    status, out = _call(f"{url}/tokenize", raw=b"{not json")
    assert status == 400 and out["error"]["param"] == "body"
