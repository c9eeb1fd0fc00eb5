"""`flame-llm demo`: local Ray, two CPU shards of the tiny default model, one batch that shows the router keeping
a document's questions on one shard and the prefix cache serving them, then text and chat through the model's
tokenizer. Also the results table `flame-llm submit` prints."""
from __future__ import annotations

import time

from flame_llm.cli_serve import print_placement

DEMO_CONFIG = {"model": "tiny", "engine": {"max_model_len": 1024, "max_num_batched_tokens": 1024, "max_num_seqs": 16,
                                            "cpu_kvcache_gib": 0.0625},
               "placement": {"num_shards": 2, "cpu_per_shard": 0.5}, "shard": {"torch_threads": 1},
               "router": {"policy": "cumulative"}, "ray": {"num_cpus": 2}}


def print_results(results: list[dict], elapsed: float) -> None:
    """The table of a batch's results (the demo's and `flame-llm submit`'s)."""
    print(f"{'request':<12} {'shard':>5}  {'device':<12} {'node':<10} {'prompt':>6} {'cached':>6}  output")
    for r in results:
        if r["error"]:
            out = f"ERROR {r['error']['code']}: {r['error']['message']}"
        else:
            ids = r["output_token_ids"]
            out = f"{ids[:8]}{' ...' if len(ids) > 8 else ''} ({r['finish_reason']})"
        print(f"{r['id'][-12:]:<12} {r['shard']:>5}  {r['device'][:12]:<12} {r['node'][:8]:<10} "
              f"{r['prompt_tokens']:>6} {r['cached_tokens']:>6}  {out}")
    ok = [r for r in results if not r["error"]]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    print(f"{len(ok)}/{len(results)} ok in {elapsed:.2f}s; prompt tokens {prompt}, cached {cached} "
          f"({100.0 * cached / max(prompt, 1):.1f}%)")


DEMO_DOCS, DEMO_QUESTIONS, DEMO_DOC_TOKENS, DEMO_QUESTION_TOKENS = 2, 4, 300, 12
DEMO_TEXT = "The lighthouse keeper climbed the steps and"
DEMO_CHAT = [{"role": "system", "content": "You keep the light."}, {"role": "user", "content": "Is the lamp lit?"}]


def demo(args) -> int:
    """Local Ray, two CPU shards of the tiny default model: one batch of two documents x four questions (token
    ids), then a text prompt and a chat exchange through the model's tokenizer and chat template."""
    import numpy as np
    import ray

    from flame_llm.config import CacheConfig
    from flame_llm.models.tokenizer import load_tokenizer
    from flame_llm.sampling_params import SamplingParams
    from flame_llm.serving.client import start_local
    from flame_llm.serving.service_config import config_from_dict, load_service_config

    cfg = load_service_config(args.config) if args.config else config_from_dict(dict(DEMO_CONFIG), "demo")
    print(f"starting local Ray with {cfg.placement.num_shards} CPU shards of model {cfg.model!r} ...", flush=True)
    client = start_local(cfg)
    failed = False
    try:
        print_placement(client.service.health)
        rng = np.random.default_rng(0)
        docs = [rng.integers(3, 512, size=DEMO_DOC_TOKENS).tolist() for _ in range(DEMO_DOCS)]
        prompts = [doc + rng.integers(3, 512, size=DEMO_QUESTION_TOKENS).tolist()
                   for doc in docs for _ in range(DEMO_QUESTIONS)]
        block = cfg.engine_kwargs().get("block_size", CacheConfig().block_size)
        shared = DEMO_DOC_TOKENS // block * block
        expect = 100.0 * DEMO_DOCS * (DEMO_QUESTIONS - 1) * shared / sum(map(len, prompts))
        print(f"\nsending {DEMO_DOCS} documents x {DEMO_QUESTIONS} questions: {len(prompts)} prompts of "
              f"{DEMO_DOC_TOKENS} + {DEMO_QUESTION_TOKENS} random token ids, sharing {DEMO_DOCS} prefixes (one "
              f"document each).\nThe router sends a document's questions to one shard. There the first question "
              f"computes the document's KV cache; the other {DEMO_QUESTIONS - 1} find its {shared} tokens in full "
              f"{block}-token blocks in the prefix cache (the last {DEMO_DOC_TOKENS - shared} fill no whole "
              f"block): expect ~{expect:.1f}% of prompt tokens cached.")
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        t0 = time.perf_counter()
        results = [r.to_dict() for r in client.generate(prompts, sp)]
        print_results(results, time.perf_counter() - t0)
        failed = any(r["error"] for r in results)
        tok = load_tokenizer(client.model_dir, client.tokenizer_field, client.limits.vocab_size, required=False)
        if tok is None:
            print(f"\n(the model directory {client.model_dir} has no tokenizer: no text or chat demo)")
        else:
            failed |= _demo_text(client, tok, args.max_tokens)
    finally:
        client.close()
        ray.shutdown()
    return 1 if failed else 0


def _demo_text(client, tok, max_tokens: int) -> bool:
    """A text prompt and a chat exchange through the client; True when either failed."""
    from flame_llm.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    print("\ntext in, text out (random weights: the words are noise, the path is real):")
    text = client.generate([DEMO_TEXT], sp)[0]
    chat_ids = tok.apply_chat_template(DEMO_CHAT, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]
    chat = client.generate([chat_ids], sp)[0]
    for r in (text, chat):
        if r.error is not None:
            print(f"  ERROR {r.error.code}: {r.error.message}")
            return True
    reply = tok.decode(text.output_token_ids, skip_special_tokens=True)
    print(f"  prompt: {DEMO_TEXT!r}\n  output: {reply!r} ({text.finish_reason})")
    print("chat (the model's chat template, as /v1/chat/completions applies it):")
    for m in DEMO_CHAT:
        print(f"  {m['role']}: {m['content']}")
    print(f"  assistant: {tok.decode(chat.output_token_ids, skip_special_tokens=True)!r} "
          f"({chat.finish_reason})")
    return False
