"""The tiny default model's tokenizer: a byte-level BPE trained here, without downloads, on prose the repository
ships (tiny_corpus.txt), to exactly the tiny model's vocabulary size, with a chat template. Training is
deterministic (merges are chosen by count, ties by token ids), so every machine builds the same tokenizer; it is
saved beside the tiny weights as a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json) and rebuilt
only when its recipe or corpus changes (TOKENIZER_STAMP holds their digest).

Ids 0, 1, 2 are <pad>, <s> (bos) and </s> (eos), as in the tiny model's config; 3..5 mark chat roles; then the
256 byte symbols, then the merges. The weights are random, so what the model writes is gibberish: the point is
that text goes in and text comes out, by the same code path a real model's tokenizer takes."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

CORPUS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_corpus.txt")
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
ROLES = ("system", "user", "assistant")
# each message: its role's marker, its content, </s>; the prompt for a reply ends with the assistant's marker
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                 "{{ raise_exception('chat roles are system, user and assistant; got ' + m['role']) }}{% endif %}"
                 "<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
RECIPE_VERSION = "bytelevel-bpe-1"  # change when the training recipe changes: cached tokenizers are rebuilt
TOKENIZER_STAMP = "flame_tokenizer.stamp"  # beside the tokenizer files: the digest of what built them


def corpus_text() -> str:
    with open(CORPUS_PATH, encoding="utf-8") as f:
        return f.read()


def recipe_digest(vocab_size: int) -> str:
    """What the tokenizer is a function of: recipe, vocabulary size, specials, template and corpus."""
    h = hashlib.sha256()
    for part in (RECIPE_VERSION, str(vocab_size), *SPECIAL_TOKENS, CHAT_TEMPLATE, corpus_text()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def train_tokenizer(vocab_size: int = 512):
    """The tokenizer (a transformers PreTrainedTokenizerFast) of exactly `vocab_size` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size < floor:
        raise ValueError(f"vocab_size must be >= {floor} (specials and 256 byte symbols); got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_text().split("\n\n"), trainer)
    # the corpus holds more pairs than merges fit: the vocabulary is full, so ids line up with the model's
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=SPECIAL_TOKENS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def has_current_tokenizer(model_dir: str, vocab_size: int) -> bool:
    try:
        with open(os.path.join(model_dir, TOKENIZER_STAMP)) as f:
            return f.read().strip() == recipe_digest(vocab_size)
    except OSError:
        return False


def save_tokenizer(model_dir: str, vocab_size: int) -> None:
    """Train and save the tokenizer into model_dir (its files replaced one by one, the stamp last, so a reader
    never takes a half-written file; a stale stamp makes the next call build it again)."""
    fast = train_tokenizer(vocab_size)
    tmp = tempfile.mkdtemp(dir=model_dir, prefix=".tokenizer-")
    try:
        fast.save_pretrained(tmp)
        with open(os.path.join(tmp, TOKENIZER_STAMP), "w") as f:
            f.write(recipe_digest(vocab_size) + "\n")
        names = sorted(os.listdir(tmp), key=lambda n: n == TOKENIZER_STAMP)
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(model_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
