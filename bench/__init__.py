"""The benchmarks by purpose (bench/README.md names each tool in one line): burst/ (paired burst runs and their
reports), load/ (sustained load, workloads, scheduler scenarios), service/ (the service path, streams, the router
simulation, soak and flood), engine/ (the engine and its kernels on one GPU); beside them the systems under test,
run options, provenance and the `flame-llm bench` / `report` commands. GPU figures: bench/RESULTS.md."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
MODELS = os.path.join(REPO, "configs", "models")  # model configs the GPU benchmarks load with dummy weights
