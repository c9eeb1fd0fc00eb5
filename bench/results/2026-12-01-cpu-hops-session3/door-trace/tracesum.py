"""The door's and serve-http's first token piece by piece: a trace JSONL written by trace-instrumentation.patch
(door lines carry the stream result's stamps, serve-http lines do not) matched in order with the bench.hops run's
JSON (its samples carry the bench's send time w0). python tracesum.py TRACE.jsonl HOPS.json"""
import json
import sys

import numpy as np


def show(name: str, samples: list, traces: list, pieces: dict) -> None:
    traces = traces[-len(samples):]  # the measured requests (the warmup ones came first)
    rows = []
    for d, t in zip(samples, traces, strict=True):
        first = d["w0"] + d["ttft"]
        rows.append({k: f(t, d["w0"], first) for k, f in pieces.items()} | {"total": d["ttft"]})
    print("==", name)
    for k in rows[0]:
        xs = np.array([x[k] for x in rows]) * 1e3
        print(f"{k:<44} p50 {np.median(xs):6.2f}  p90 {np.percentile(xs, 90):6.2f}")


def main() -> None:
    traces = [json.loads(line) for line in open(sys.argv[1])]
    r = json.load(open(sys.argv[2]))
    pre = {"bench -> handler entry": lambda t, w0, f: t["in"] - w0,
           "handler -> headers sent": lambda t, w0, f: t["prepared"] - t["in"]}
    post = {"first SSE write": lambda t, w0, f: t["written"] - t["dequeued"],
            "written -> bench has it": lambda t, w0, f: f - t["written"]}
    door = {"headers -> client sends (sent_at)": lambda t, w0, f: t["sent_at"] - t["prepared"],
            "Ray request hop": lambda t, w0, f: t["arrived_at"] - t["sent_at"],
            "actor: arrival -> first chunk leaves": lambda t, w0, f: t["first_chunk_at"] - t["arrived_at"],
            "  engine ttft (in the above)": lambda t, w0, f: t["ttft"],
            "Ray return hop": lambda t, w0, f: t["first_chunk_at_client"] - t["first_chunk_at"],
            "client push -> SSE loop has it": lambda t, w0, f: t["dequeued"] - t["first_chunk_at_client"]}
    engine = {"headers -> first token dequeued": lambda t, w0, f: t["dequeued"] - t["prepared"],
              "  engine ttft (in the above)": lambda t, w0, f: t["ttft"]}
    show("door", r["samples"]["door"], [t for t in traces if "sent_at" in t], pre | door | post)
    show("serve-http", r["samples"]["serve-http"], [t for t in traces if "sent_at" not in t], pre | engine | post)


if __name__ == "__main__":
    main()
