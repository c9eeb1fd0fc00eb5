"""Results as they finish (issue 18 item 1) and the one retry policy (item 7), without Ray: the engine actor's
grouping of finished results (actors/as_finished.py), the new shard fields' checks, and retry.decide."""
import asyncio
import math
import time

import numpy as np
import pytest

from actors.as_finished import as_finished
from actors.engine_actor import ShardOptions
from flame_llm.protocol.errors import ErrorCode, ErrorInfo
from flame_llm.protocol.types import Request, Result
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.pending import Pending
from flame_llm.serving.retry import Action, decide


async def _groups(delays: list[float], window_s: float) -> list[tuple[list[int], float]]:
    """Tasks that finish after `delays`; the groups as_finished hands out, each with when it came."""
    t0 = time.perf_counter()

    async def after(i, d):
        await asyncio.sleep(d)
        return i
    tasks = [asyncio.ensure_future(after(i, d)) for i, d in enumerate(delays)]
    return [(g, time.perf_counter() - t0) async for g in as_finished(tasks, window_s)]


def test_results_leave_as_they_finish_and_close_ones_travel_together():
    groups = asyncio.run(_groups([0.0, 0.01, 0.6, 0.6, 1.2], window_s=0.1))
    assert [g for g, _ in groups] == [[0, 1], [2, 3], [4]]
    assert groups[0][1] < 0.4 and 0.55 < groups[1][1] < 1.0  # the first did not wait for the later ones


def test_a_lone_result_waits_for_no_timer():
    """No other request of the batch runs: the result leaves at once, not after the window (the Ray Serve LLM
    batcher's 50 ms, ray-project/ray#59681)."""
    ((group, at),) = asyncio.run(_groups([0.0], window_s=5.0))
    assert group == [0] and at < 1.0
    groups = asyncio.run(_groups([0.0, 0.3], window_s=5.0))  # the last one of a batch leaves at once too
    assert [g for g, _ in groups] == [[0, 1]] and groups[0][1] < 2.0


def test_zero_window_sends_each_result_alone():
    assert [g for g, _ in asyncio.run(_groups([0.0, 0.2, 0.4], window_s=0.0))] == [[0], [1], [2]]


@pytest.mark.parametrize("field, value", [("result_window_ms", -1.0), ("result_window_ms", True),
                                          ("result_window_ms", 1e9)])
def test_shard_fields_are_checked(field, value):
    with pytest.raises(ValueError, match=f"shard field '{field}'"):
        ShardOptions(**{field: value})


# ---- the retry policy ----

def _pending(attempts=0, deadline=math.inf):
    loop = asyncio.new_event_loop()
    p = Pending(Request("r", np.zeros(3, dtype=np.uint32), SamplingParams()), [], 0.0, 0, loop.create_future(),
                attempts=attempts, deadline=deadline)
    loop.close()
    return p


def _answer(code=None, retry_after_s=None):
    return Result("r", error=None if code is None else ErrorInfo(code, "x", retry_after_s))


@pytest.mark.parametrize("code", [None, ErrorCode.INVALID_REQUEST, ErrorCode.ENGINE_ERROR, ErrorCode.BAD_PROMPT])
def test_answers_a_resend_cannot_cure_are_done(code):
    assert decide(_pending(), 3, _answer(code)).action is Action.DONE


def test_overloaded_waits_its_hint_until_the_callers_deadline():
    now = 100.0
    d = decide(_pending(attempts=50), 3, _answer(ErrorCode.OVERLOADED, 0.25), now=now)
    assert d.action is Action.RETRY and d.delay_s == 0.25  # not counted against max_retries
    assert decide(_pending(deadline=now + 0.2), 3, _answer(ErrorCode.OVERLOADED, 0.25), now=now).action is Action.DONE
    assert decide(_pending(deadline=now + 0.3), 3, _answer(ErrorCode.OVERLOADED, 0.25), now=now).action is Action.RETRY


def test_draining_reroutes_while_retries_are_left():
    assert decide(_pending(attempts=2), 3, _answer(ErrorCode.DRAINING)).action is Action.REROUTE
    assert decide(_pending(attempts=3), 3, _answer(ErrorCode.DRAINING)).action is Action.DONE


def test_a_lost_shard_is_waited_for_unless_retries_are_spent():
    """A stream that had tokens out is waited for too: it is resumed (test_stream_retry.py)."""
    lost = RuntimeError("actor died")
    assert decide(_pending(), 3, lost=lost, shard=1).action is Action.RESTART
    spent = decide(_pending(attempts=3), 3, lost=lost, shard=1)
    assert spent.action is Action.FAIL and spent.error.code is ErrorCode.SHARD_DIED and "4 times" in spent.error.message
    assert decide(_pending(), 3, lost=lost, shard=1, streamed=True).action is Action.RESTART
    streamed = decide(_pending(attempts=3), 3, lost=lost, shard=1, streamed=True)
    assert streamed.action is Action.FAIL and "while streaming" in streamed.error.message


def test_a_streamed_request_is_never_sent_again():
    assert decide(_pending(), 3, _answer(ErrorCode.DRAINING), streamed=True).action is Action.DONE
    assert decide(_pending(), 3, _answer(ErrorCode.OVERLOADED, 0.1), streamed=True).action is Action.DONE


def test_overload_retries_leave_max_retries_for_draining_and_deaths():
    """21 overloaded answers, each resent by the shard's channel (batches: retry; streams: apply), then draining:
    still rerouted; a death then: still waited for (the overload resends are not retries)."""
    from flame_llm.serving.channel import ShardChannel
    from flame_llm.serving.client_config import ClientConfig
    from flame_llm.serving.dispatch import Dispatcher
    from flame_llm.serving.pending import ClientCounters

    d = Dispatcher.__new__(Dispatcher)  # the retry bookkeeping only: no router, no shards
    d.counters, d.config = ClientCounters(), ClientConfig(max_retries=3)
    ch = ShardChannel.__new__(ShardChannel)
    ch.d, ch.shard, ch.retrying = d, 0, {}

    async def run(resend) -> Pending:
        p = _pending()
        p.future = asyncio.get_running_loop().create_future()
        for _ in range(21):
            dec = decide(p, d.config.max_retries, _answer(ErrorCode.OVERLOADED, 0.0))
            assert dec.action is Action.RETRY
            await resend(p, dec)
        return p

    def batch_resend(p, dec):
        ch.retry(p, 3600.0)  # the timer never fires in this test
        return asyncio.sleep(0)

    async def main():
        for resend in (batch_resend, lambda p, dec: ch.apply(p, dec, None, None)):
            p = await run(resend)
            assert p.attempts == 21 and d.config.max_retries == 3
            assert decide(p, d.config.max_retries, _answer(ErrorCode.DRAINING)).action is Action.REROUTE
            assert decide(p, d.config.max_retries, lost=RuntimeError("died"), shard=0).action is Action.RESTART
            p.attempts += 3  # three reroutes or restarts: now the retries are spent
            spent = decide(p, d.config.max_retries, lost=RuntimeError("died"), shard=0)
            assert spent.action is Action.FAIL and "4 times" in spent.error.message
        for handle, _ in ch.retrying.values():
            handle.cancel()

    asyncio.run(main())
