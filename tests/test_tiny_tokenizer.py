"""The tiny default model's tokenizer: trained here from the shipped corpus, deterministic across processes, exactly
the model's vocabulary, a chat template, cached beside the weights and added to a cache made before it existed."""
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from flame_llm.models.tiny import TINY_VOCAB_SIZE, ensure_tiny_default, make_tiny_model
from flame_llm.models.tiny_tokenizer import TOKENIZER_STAMP, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_vocabulary_specials_and_round_trip():
    tok = train_tokenizer(TINY_VOCAB_SIZE)
    assert len(tok) == TINY_VOCAB_SIZE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)  # the tiny config's bos/eos
    text = "The keeper climbed the steps, and wrote: wind from the west. Ünïcode ✓"
    ids = tok.encode(text)
    assert max(ids) < TINY_VOCAB_SIZE and tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # merges learned from the corpus, not bytes alone
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<s><|user|>hi</s><|assistant|>"
    with pytest.raises(Exception, match="chat roles are system, user and assistant"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_training_is_deterministic_across_processes():
    code = ("import json; from flame_llm.models.tiny_tokenizer import train_tokenizer; "
            "print(json.dumps(json.loads(train_tokenizer(512).backend_tokenizer.to_str())['model']))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": REPO, "PYTHONHASHSEED": str(seed)}).stdout
            for seed in (1, 2)]
    assert runs[0] == runs[1] and json.loads(runs[0])["merges"]


def test_default_model_is_cached_with_its_tokenizer_and_an_old_cache_gets_one(tmp_path):
    from transformers import AutoTokenizer

    fresh = ensure_tiny_default(str(tmp_path / "fresh"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", TOKENIZER_STAMP} <= \
        set(os.listdir(fresh))
    tok = AutoTokenizer.from_pretrained(fresh)
    assert len(tok) == TINY_VOCAB_SIZE and tok.chat_template
    mtime = os.path.getmtime(os.path.join(fresh, "tokenizer.json"))
    ensure_tiny_default(fresh)  # cached: nothing is written again
    assert os.path.getmtime(os.path.join(fresh, "tokenizer.json")) == mtime
    # a cache made before the tokenizer existed: weights only; the tokenizer is added, the weights untouched
    old = make_tiny_model(str(tmp_path / "old"), "llama")
    weights = load_file(os.path.join(old, "model.safetensors"))
    assert not os.path.isfile(os.path.join(old, "tokenizer.json"))
    ensure_tiny_default(old)
    assert AutoTokenizer.from_pretrained(old).encode("the lighthouse") == tok.encode("the lighthouse")
    same = load_file(os.path.join(old, "model.safetensors"))
    assert all((weights[k] == same[k]).all() for k in weights)
    # the fresh default's weights are the tests' tiny llama's (same seed and shapes): recorded digests hold
    fresh_weights = load_file(os.path.join(fresh, "model.safetensors"))
    assert all((weights[k] == fresh_weights[k]).all() for k in weights)
    # a stale stamp (another recipe or corpus) rebuilds it
    with open(os.path.join(old, TOKENIZER_STAMP), "w") as f:
        f.write("stale\n")
    ensure_tiny_default(old)
    assert open(os.path.join(old, TOKENIZER_STAMP)).read() == open(os.path.join(fresh, TOKENIZER_STAMP)).read()
