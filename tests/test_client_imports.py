"""Issue 38 item 1: the client imports no engine, torch or kernel module. Each entry point is imported in a
fresh interpreter and the project modules it pulled in (under flame_llm/, actors/ and router/) are counted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MAX_CLOSURE = 35  # the client's import closure, in project modules (issue 38's goal)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
ours = sorted(m for m in sys.modules if m.split(".")[0] in ("flame_llm", "actors", "router"))
print(json.dumps({"ours": ours, "torch": "torch" in sys.modules}))
"""


def closure(module: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["flame_llm.serving.client", "flame_llm.serving.dispatch"])
def test_client_import_closure(module):
    got = closure(module)
    ours = got["ours"]
    assert not got["torch"], f"{module} imports torch"
    engine = [m for m in ours if m.startswith(("flame_llm.engine", "flame_llm.kernels", "flame_llm.layers",
                                              "flame_llm.models", "actors"))]
    assert not engine, f"{module} imports engine-side modules: {engine}"
    assert len(ours) <= MAX_CLOSURE, f"{module} imports {len(ours)} project modules (limit {MAX_CLOSURE}): {ours}"
