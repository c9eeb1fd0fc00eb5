"""The step timeline (engine/step_timeline.py, issue 39): GPU busy and idle time between steps from timing events,
the engine thread's host time apart from its waits, carried through serve-http's /metrics into load windows."""
import pytest

from bench.load.load_report import _timeline
from bench.load.load_stalls import TIMELINE_KEYS, parse_metrics
from flame_llm import LLM, SamplingParams
from flame_llm.engine.step_timeline import StepEvents, StepTimeline
from flame_llm.serving.metrics import render_engine


class FakeCudaEvent:
    """Stands in for torch.cuda.Event, which needs a GPU (none here): it holds the GPU time it was reached at, and
    like torch's refuses elapsed_time until both events have completed."""

    def __init__(self, t_ms: float, done: bool = True) -> None:
        self.t_ms, self.done = t_ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: "FakeCudaEvent") -> float:
        if not (self.done and other.done):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return other.t_ms - self.t_ms


def _step(t0: float, t1: float, path: str = "decode graph", rows: int = 16) -> StepEvents:
    return StepEvents(FakeCudaEvent(t0), FakeCudaEvent(t1), path, rows)


def test_busy_idle_and_late_launch_gaps():
    tl = StepTimeline(cuda=False)
    tl.finish(_step(0.0, 10.0))                    # the first step: no step before it, no idle counted
    tl.finish(_step(10.2, 20.2))                   # 0.2 ms idle: jitter, not a gap
    tl.finish(_step(23.2, 40.0, "eager", 3))       # 3 ms idle: a late launch
    tl.idle_break()                                # the engine had nothing to run
    tl.finish(_step(1000.0, 1010.0, "mixed graph", 9))  # after an idle engine: no idle counted
    c = tl.stats()
    assert c["timeline_steps"] == 4
    assert c["gpu_busy_s"] == pytest.approx((10 + 10 + 16.8 + 10) / 1000)
    assert c["gpu_idle_s"] == pytest.approx(3.2 / 1000)
    assert c["gpu_idle_gaps"] == 1 and c["gpu_idle_gaps_s"] == pytest.approx(0.003)
    assert (c["decode_graph_timed_steps"], c["decode_graph_rows"]) == (2, 32)
    assert c["decode_graph_gpu_s"] == pytest.approx(0.020)
    assert (c["eager_timed_steps"], c["eager_rows"], c["mixed_graph_timed_steps"]) == (1, 3, 1)
    tl.finish(None)  # a CPU step (no events) counts nothing
    tl.finish(StepEvents(FakeCudaEvent(0.0)))  # a step whose end was never recorded neither
    assert tl.stats()["timeline_steps"] == 4
    tl.count_host(0.005, 0.003)
    assert tl.stats()["host_step_s"] == pytest.approx(0.002) and tl.stats()["sync_wait_s"] == pytest.approx(0.003)


def test_a_step_read_before_its_end_event_completes_is_counted_later_in_order():
    """On an H100 (session 20) a step's tokens were read while its end event had not completed, and elapsed_time
    raised inside the engine loop, failing every request: finish() must defer such a step, not wait or raise."""
    tl = StepTimeline(cuda=False)
    tl.finish(_step(0.0, 10.0))
    late = _step(12.0, 20.0)
    late.end.done = False
    tl.finish(late)                                # not completed: nothing raised, not yet counted
    tl.idle_break()                                # an idle break after it applies after it
    assert tl.stats()["timeline_steps"] == 1
    nxt = _step(500.0, 510.0)
    nxt.end.done = False
    tl.finish(nxt)
    late.end.done = nxt.end.done = True
    c = tl.stats()                                 # both counted now, in order: idle 2 ms before `late`, none after
    assert c["timeline_steps"] == 3
    assert c["gpu_busy_s"] == pytest.approx(0.028)
    assert c["gpu_idle_s"] == pytest.approx(0.002) and c["gpu_idle_gaps"] == 1


def test_cpu_engine_counts_host_time_only(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=256, max_num_seqs=4)
    llm.generate([[1, 2, 3, 4]] * 3, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    s = llm.engine.stats()
    assert s["timeline_steps"] == 0 and s["gpu_busy_s"] == 0.0  # no timing events on CPU
    assert s["host_step_s"] > 0 and s["sync_wait_s"] == 0.0
    assert set(TIMELINE_KEYS) <= set(s)


def test_serve_http_metrics_carry_the_timeline_into_load_windows():
    stats = {"num_decode_steps": 90, "num_prefill_steps": 10, "timeline_steps": 100, "gpu_busy_s": 1.0,
             "gpu_idle_s": 0.25, "gpu_idle_gaps": 40, "gpu_idle_gaps_s": 0.2, "host_step_s": 0.15,
             "sync_wait_s": 0.9, "decode_graph_timed_steps": 80, "decode_graph_gpu_s": 0.8, "decode_graph_rows": 1600}
    text = render_engine({"device": "cpu"}, stats, {"requests": 0}).decode()
    got = parse_metrics(text)
    for k, v in stats.items():
        assert got[k] == pytest.approx(v), k
    rec = {"windows": [{"offered_rps": 8.0, "stalls": {"engine": stats}}]}
    line = _timeline(rec)[1]
    assert "100 timed steps: GPU busy 1.00 s (10.00 ms a step), idle between steps 0.25 s (40 gaps" in line
    assert "host 1.50 ms a step apart from 9.00 ms waiting" in line and "GPU 10.00 ms at 20.0 rows" in line
    assert _timeline({"windows": [{"offered_rps": 8.0, "stalls": {"engine": {}}}]}) == []  # vLLM: no timeline
