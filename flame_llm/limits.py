"""Limits shared by the engine and its front doors, in a light module (no torch) the protocol can import."""
from __future__ import annotations


def max_prompt_tokens(max_model_len: int) -> int:
    """The longest prompt an engine of this max_model_len accepts: it must leave room for one output token.
    The one rule: the engine, the wire decoder and the HTTP front doors all apply it."""
    return max_model_len - 1


def max_output_tokens(prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """The output tokens a request can produce: max_tokens, cut where the sequence reaches max_model_len (at
    least one). What admission charges and the router estimates, so a max_tokens of 10**9 weighs what fits."""
    return max(1, min(max_tokens, max_model_len - prompt_tokens))


def max_kv_blocks_in_use(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most KV blocks the running sequences can hold at once: max_num_seqs sequences of max_model_len
    tokens. A CPU engine's KV pool is no larger (its memory is the host's, held from startup)."""
    return max_num_seqs * ((max_model_len + block_size - 1) // block_size)
