"""The benchmark commands of the installed `flame-llm` (flame_llm.cli): `bench` and `report`. pyproject.toml
registers COMMANDS in the entry point group flame_llm.commands, which flame_llm.cli reads at start, so the app
never imports the bench. `python -m bench.cli` runs flame-llm with them without an installed entry point."""
from __future__ import annotations

import os
import sys

from bench.burst.pairs import ARGUMENTS as BENCH_ARGS
from bench.burst.report import ARGUMENTS as REPORT_ARGS
from bench.run_options import BENCH_EPILOG
from flame_llm import cli


def bench(args) -> int:
    from bench.burst.pairs import run
    from bench.run_options import check_bench_memory

    check_bench_memory(args)  # with the machine's defaults filled in (the tiny model without a GPU)
    return run(args)


def report(args) -> int:
    """The paired burst report of a bench run, or the load report of a load run (raw/load-*.json[.gz])."""
    from bench.load.load_report import load_records

    if recs := load_records(args.raw_dir):
        from bench.load.load_report import write_load_report

        subject = next((s for s in args.systems.split(",") if s), "flame")
        recs.sort(key=lambda r: r["system"] != subject)
        out = args.out or args.raw_dir
        os.makedirs(out, exist_ok=True)
        print(write_load_report(out, recs))
        return 0
    from bench.burst.report import run

    return run(args)


# name: (function, help, arguments, epilog), as flame_llm.cli.COMMANDS
COMMANDS = {
    "bench": (bench, "burst benchmark: fresh interleaved pairs of systems, then the paired report", BENCH_ARGS,
              BENCH_EPILOG),
    "report": (report, "report (Markdown, JSON, PNG) from a run's raw records: paired bursts or load", REPORT_ARGS),
}


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, {**cli.COMMANDS, **COMMANDS})


if __name__ == "__main__":
    sys.exit(main())
