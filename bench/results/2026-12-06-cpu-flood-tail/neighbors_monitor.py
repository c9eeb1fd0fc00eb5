"""Every 0.5 s: per-process CPU deltas (top 6 by CPU) with time.monotonic(), as JSON lines; bounded to 45 min."""
import json, os, time
tick = os.sysconf("SC_CLK_TCK")
def snap():
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
            name = s[s.index("(") + 1:s.rindex(")")]
            fl = s.rpartition(")")[2].split()
            out[int(d)] = (name, (int(fl[11]) + int(fl[12])) / tick)
        except (OSError, ValueError):
            pass
    return out
cmd = {}
prev, pt = snap(), time.monotonic()
end = pt + 45 * 60
with open("/tmp/s22-mon.jsonl", "a") as f:
    while time.monotonic() < end:
        time.sleep(0.5)
        cur, t = snap(), time.monotonic()
        deltas = []
        for pid, (name, c) in cur.items():
            d = c - prev.get(pid, (name, 0.0))[1] if pid in prev else c
            if d > 0:
                if pid not in cmd:
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as g:
                            cmd[pid] = g.read().replace(b"\0", b" ").decode(errors="replace").replace("/root/.pyenv/versions/3.11.7/", "")[:110]
                    except OSError:
                        cmd[pid] = name
                deltas.append((round(d / (t - pt), 2), pid, cmd[pid]))
        deltas.sort(reverse=True)
        f.write(json.dumps({"t0": pt, "t1": t, "top": deltas[:10]}) + "\n")
        f.flush()
        prev, pt = cur, t
