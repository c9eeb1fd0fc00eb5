"""The requests an engine actor serves (actors/inflight.py), keyed by owner (a stream connection) and id: an abort
reaching one request twice counts once; one owner's abort never reaches another's request; an abort before its
request arrives is remembered; a duplicate id of one owner is refused before it registers."""
import asyncio

import pytest

from actors.inflight import DuplicateRequestId, Inflight


def test_a_request_aborted_twice_counts_once():
    """Two aborts reaching one running request (its client's abort and its stream's end) count one abort."""
    async def scenario() -> tuple[list[int], bool, int]:
        inf = Inflight()
        started = asyncio.Event()

        async def serve() -> bool:
            assert inf.add("r", "o")
            started.set()
            try:
                await asyncio.sleep(30)
                return False
            except asyncio.CancelledError:
                return inf.was_aborted("r", "o")
            finally:
                inf.forget("r", "o")
                inf.remove("r", "o")

        task = asyncio.ensure_future(serve())
        await started.wait()
        found = [inf.abort(["r"], "o"), inf.abort(["r", "unknown"], "o")]
        return found, await asyncio.wait_for(task, 5), inf.counters["aborted"]

    assert asyncio.run(scenario()) == ([1, 1], True, 1)


def test_owners_are_apart_an_early_abort_is_remembered_and_a_duplicate_id_refused():
    async def scenario() -> None:
        inf = Inflight()
        assert inf.abort(["early"], "a") == 0  # on its way: remembered, the request never starts
        assert inf.add("early", "a") is False
        assert inf.add("r", "a") and inf.add("r", "b")  # two owners' equal ids are two requests
        with pytest.raises(DuplicateRequestId, match="field 'id'"):
            inf.add("r", "a")
        assert inf.abort(["r"], "c") == 0 and not inf.was_aborted("r", "a")  # another owner's id reaches nothing
        inf.remove("r", "a")
        assert set(inf.tasks) == {("b", "r")}

    asyncio.run(scenario())
