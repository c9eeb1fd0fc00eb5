"""bench/service/stream_cpu.py: the engine thread's share found by its id or as the busiest non-main thread, py-spy's
raw
stacks summed into own and inclusive shares, bad flags refused before anything starts; and (slow) a short run of
both systems on the tiny model whose figures add up."""
import json

import pytest

from bench.service import stream_cpu


def test_the_engine_threads_share_and_py_spy_stacks():
    before, after = {100: 1.0, 101: 2.0, 102: 0.5}, {100: 1.5, 101: 5.0, 102: 0.7, 103: 0.1}
    assert stream_cpu.engine_thread_share(before, after, 102) == (pytest.approx(0.2), "its AsyncEngine thread")
    assert stream_cpu.engine_thread_share(before, after, None) == (pytest.approx(3.0),
                                                                   "the busiest thread but the main one")


def test_py_spy_raw_stacks_are_summed_into_own_and_inclusive_shares(tmp_path):
    raw = tmp_path / "s.txt"
    raw.write_text("run (a.py:1);step (b.py:2);forward (c.py:3) 6\nrun (a.py:1);push (b.py:9) 3\n"
                   "run (a.py:1);step (b.py:2) 1\n")
    t = stream_cpu.top_functions(str(raw))
    assert t["samples"] == 10
    assert t["own_pct"] == [("forward (c.py)", 60.0), ("push (b.py)", 30.0), ("step (b.py)", 10.0)]
    assert dict(t["inclusive_pct"]) == {"run (a.py)": 100.0, "step (b.py)": 70.0, "forward (c.py)": 60.0,
                                        "push (b.py)": 30.0}


@pytest.mark.parametrize("flags,msg", [(["--streams", "0"], "--streams is out of range: 0"),
                                       (["--output-tokens", "1"], "--output-tokens is out of range: 1"),
                                       (["--rounds", "0"], "--rounds is out of range: 0")])
def test_bad_flags_are_refused_before_anything_starts(flags, msg):
    with pytest.raises(SystemExit, match=msg):
        stream_cpu.main(flags)


@pytest.mark.slow
def test_a_short_run_of_both_systems_adds_up(tmp_path):
    out = tmp_path / "s.json"
    assert stream_cpu.main(["--streams", "2", "--output-tokens", "12", "--duration-s", "1.5", "--rounds", "1",
                            "--logs", str(tmp_path / "logs"), "--out", str(out)]) == 0
    rows = json.load(open(out))["rows"]
    assert [r["system"] for r in rows] == ["serve-http", "flame door"]
    for r in rows:
        assert r["tokens"] == 12 * r["streams"] > 0 and r["tok_s"] > 0
        c = r["cpu_us_per_token"]
        procs = ["serve-http"] if r["system"] == "serve-http" else ["engine actor", "front door", "router"]
        assert set(c) == {*procs, "load generator"} and all(v >= 0 for v in c.values())
        assert r["system_cpu_us_per_token"] == pytest.approx(sum(c[p] for p in procs))
        split = r["engine_process_split"]
        assert split["engine thread"] + split["other threads"] == pytest.approx(c[procs[0]])
        assert split["found as"] == ("its AsyncEngine thread" if r["system"] == "flame door" else
                                     "the busiest thread but the main one")
        if r["system"] == "flame door":  # the stream server's output counters were read around the window
            assert r["stream_out"]["socket_out_frames"] >= r["stream_out"]["socket_out_writes"] > 0
            assert r["frames_per_write"] >= 1.0
        else:
            assert r["frames_per_write"] is None
