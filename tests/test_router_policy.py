import numpy as np
import pytest

from flame_llm.prefix import hash_block, revision_seed
from flame_llm.routing_key import (
    ATTN_CROSSOVER_TOKENS,
    estimate_decode_work,
    estimate_prefill_work,
    prefix_chain,
)

rng = np.random.default_rng(0)


def _tokens(n: int) -> list[int]:
    return rng.integers(0, 50_000, n).tolist()


# ---- prefix identity ----

def test_chain_is_block_hashes_seeded_with_the_revision():
    toks = _tokens(600)
    chain = prefix_chain(toks, "rev")
    h1 = hash_block(toks[:256], revision_seed("rev"))
    assert chain == [h1, hash_block(toks[256:512], h1)]  # the partial third block is not identity


def test_shared_prefix_shares_the_chain_prefix():
    doc = _tokens(512)
    a, b = prefix_chain(doc + _tokens(700), "r"), prefix_chain(doc + _tokens(700), "r")
    assert a[:2] == b[:2] and a[2] != b[2] and len(a) == len(b) == 4
    assert prefix_chain(np.array(doc + [1] * 300, np.uint32), "r")[:2] == a[:2]  # arrays hash like lists


def test_revision_salts_the_chain():
    toks = _tokens(1024)
    a, b = prefix_chain(toks, "rev-1"), prefix_chain(toks, "rev-2")
    assert not set(a) & set(b)


def test_only_the_first_1024_tokens_count():
    doc = _tokens(1024)
    a, b = prefix_chain(doc + _tokens(7000), "r"), prefix_chain(doc + _tokens(100), "r")
    assert a == b and len(a) == 4
    assert len(prefix_chain(_tokens(8192), "r", block=128, max_tokens=2048)) == 16


def test_short_prompt_gets_one_key_over_all_its_tokens():
    toks = _tokens(100)
    assert prefix_chain(toks, "r") == [hash_block(toks, revision_seed("r"))]
    assert prefix_chain(toks, "r") != prefix_chain(toks[:99], "r")
    assert prefix_chain(toks + _tokens(200), "r")[0] != prefix_chain(toks, "r")[0]  # documented


@pytest.mark.parametrize("kw, match", [
    ({"token_ids": []}, "at least 1 token"),
    ({"block": 0}, "block must be >= 1"),
    ({"block": 512, "max_tokens": 256}, "max_tokens >= block"),
])
def test_chain_rejects_bad_arguments(kw, match):
    args = {"token_ids": [1, 2], "model_revision": "r", **kw}
    with pytest.raises(ValueError, match=match):
        prefix_chain(**args)


def test_work_estimates():
    assert estimate_prefill_work(0) == 0.0
    assert estimate_prefill_work(1000) == pytest.approx(1000 + 1000**2 / 2 / ATTN_CROSSOVER_TOKENS)
    # quadratic: an 8K prompt costs more than 8x a 1K prompt; a cached prefix removes its share
    assert estimate_prefill_work(8192) > 8 * estimate_prefill_work(1024)
    assert estimate_prefill_work(8192, 8192) == 0.0
    # the uncached second half attends over more keys than the first half did
    assert estimate_prefill_work(8192) / 2 < estimate_prefill_work(8192, 4096) < estimate_prefill_work(8192)
    assert estimate_decode_work(16) > estimate_prefill_work(16)
    for n, c in [(-1, 0), (10, 11), (10, -1)]:
        with pytest.raises(ValueError, match=f"num_tokens={n}, cached_tokens={c}"):
            estimate_prefill_work(n, c)
