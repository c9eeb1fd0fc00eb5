"""Paired burst runs: traces, the runner, interleaved pairs (also through `ray job submit`) and the paired report."""
