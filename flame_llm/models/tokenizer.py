"""The one tokenizer loader (engine, client, front door, demo). A model's tokenizer is the `tokenizer` config field
when set, as vLLM's --tokenizer: a Hugging Face tokenizer directory, or "tiny" for the embedded tiny BPE
(flame_llm/models/tiny_tokenizer.py, built on first use); unset (""), the model directory's own. So a model
without one (the dummy-weight 8B configs in configs/models/) serves text with a tokenizer given beside it. The
model's vocabulary must cover the tokenizer's ids: a larger tokenizer is an error naming `tokenizer` and both
sizes."""
from __future__ import annotations

import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
TINY = "tiny"  # the `tokenizer` value that names the embedded tiny BPE
TINY_TOKENIZER_DIR = os.path.join(os.path.expanduser("~"), ".cache", "flame_llm", "tiny-tokenizer")
WHAT = "an HF tokenizer directory or 'tiny'"  # what the field holds, in its errors


def has_tokenizer(path: str) -> bool:
    """Whether the directory holds a Hugging Face tokenizer's files."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def tokenizer_dir(model: str, tokenizer: str = "") -> str:
    """Where the tokenizer is: `tokenizer`'s directory ("tiny": the embedded BPE's, made on first use), or unset,
    the model directory."""
    if tokenizer != TINY:
        return tokenizer or model
    from flame_llm.models.tiny import TINY_VOCAB_SIZE
    from flame_llm.models.tiny_tokenizer import has_current_tokenizer, save_tokenizer

    if not has_current_tokenizer(TINY_TOKENIZER_DIR, TINY_VOCAB_SIZE):
        os.makedirs(TINY_TOKENIZER_DIR, exist_ok=True)
        save_tokenizer(TINY_TOKENIZER_DIR, TINY_VOCAB_SIZE)
    return TINY_TOKENIZER_DIR


def load_tokenizer(model: str, tokenizer: str = "", vocab_size: int | None = None, required: bool = True):
    """The tokenizer (a transformers PreTrainedTokenizerBase) of `model` with the `tokenizer` field's value. With
    `vocab_size` (the model's), ValueError naming `tokenizer` when the tokenizer has more ids. Unset `tokenizer`
    and a model directory without one: ValueError, or None when not `required` (token-id prompts only)."""
    path = tokenizer_dir(model, tokenizer)
    if not has_tokenizer(path):
        if tokenizer:
            raise ValueError(f"field 'tokenizer' must be {WHAT}; {path!r} has none of {', '.join(TOKENIZER_FILES)}")
        if not required:
            return None
        raise ValueError(f"text prompts need a tokenizer, and the model directory {model!r} has no usable tokenizer; "
                         f"pass token ids, or set 'tokenizer' ({WHAT})")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a broken or unsupported tokenizer: say which field points at it
        field = "field 'tokenizer'" if tokenizer else "the model directory's tokenizer"
        raise ValueError(f"{field} {path!r} cannot be loaded: {type(e).__name__}: {e}") from None
    if vocab_size is not None and len(tok) > vocab_size:
        raise ValueError(f"field 'tokenizer' ({tokenizer or path!r}) has {len(tok)} tokens, more than the model's "
                         f"vocab_size ({vocab_size}): its ids would fall outside the model's embeddings; use a "
                         "tokenizer the model's vocabulary covers")
    return tok
