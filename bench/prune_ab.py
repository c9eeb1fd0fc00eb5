"""Config.prune_last_layer offline, A-B-B-A in one process: `python -m bench.flag_ab --flag prune_last_layer`
(bench/flag_ab.py), kept under its old name. `python -m bench.prune_ab --out prune.json` (a GPU)."""
from __future__ import annotations

import sys

from bench.flag_ab import main

if __name__ == "__main__":
    sys.exit(main(["--flag", "prune_last_layer", *sys.argv[1:]], prog="python -m bench.prune_ab"))
