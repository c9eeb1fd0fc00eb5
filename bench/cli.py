"""The installed `flame-llm` command: the service's commands (flame_llm.cli) plus the benchmarks'."""
from __future__ import annotations

import sys

from bench.pairs import ARGUMENTS as BENCH_ARGS
from bench.report import ARGUMENTS as REPORT_ARGS
from flame_llm import cli


def bench(args) -> int:
    from bench.pairs import run
    return run(args)


def report(args) -> int:
    from bench.report import run
    return run(args)


COMMANDS = {
    **cli.COMMANDS,
    "bench": (bench, "burst benchmark: fresh interleaved pairs of systems, then the paired report", BENCH_ARGS),
    "report": (report, "paired report (Markdown, JSON, PNG) from a bench run's raw records", REPORT_ARGS),
}


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
