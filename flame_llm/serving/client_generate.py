"""One generate call of the client (Client.generate, agenerate, as_completed): its prompts checked and made into
requests (prompts.py), handed to the Dispatcher (dispatch.py), whose shard channels coalesce them with other calls'
requests, and each Result handed on as it lands (its text decoded when the prompts were text, a progress bar
advanced); the call returns them in input order. A call its caller gives up on (cancelled) takes its unanswered
requests out of the client's queues unsent and has the shards abort the others."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from flame_llm.protocol.types import Result
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.dispatch import Dispatcher
from flame_llm.serving.prompts import RequestMaker
from flame_llm.validate import check_number


async def generate_call(d: Dispatcher, requests: RequestMaker, prompts: list,
                        sampling_params: SamplingParams | list[SamplingParams], use_tqdm: bool,
                        deadline_s: float | None, on_result: Callable[[int, Result], None] | None = None,
                        user: str = "") -> list[Result]:
    """Each prompt's Result in input order, through dispatcher `d` on its loop; on_result(index, result) is called
    as each lands. deadline_s: the requests' overload deadline (None: ClientConfig.overload_deadline_s)."""
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"sampling_params has {len(sampling_params)} entries; prompts has {len(prompts)}")
    check_number("overload_deadline_s", deadline_s, 0, optional=True, where="argument")  # as ClientConfig's
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    bar = None
    if use_tqdm:
        from tqdm import tqdm
        bar = tqdm(total=len(prompts), desc="requests")

    def landed(i: int, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return
        r = fut.result()
        r.timings["client_s"] = time.perf_counter() - t0  # this request's time in the call
        tok = requests.tokenizer
        if tok is not None and r.error is None:
            r.text = tok.decode(r.output_token_ids)
        if bar is not None:
            bar.update(1)
        if on_result is not None:
            on_result(i, r)

    pend = [requests.prepare(prompt, sp, loop, deadline_s) for prompt, sp in zip(prompts, sampling_params,
                                                                               strict=True)]
    for i, p in enumerate(pend):
        p.request.user = user
        p.future.add_done_callback(lambda f, i=i: landed(i, f))
    try:
        routed = [p for p in pend if not p.future.done()]
        if routed:
            await d.route(routed)
        return await asyncio.gather(*(p.future for p in pend))  # after each `landed`: added first
    except asyncio.CancelledError:
        d.abandon(pend)
        raise
    finally:
        if bar is not None:
            bar.close()

