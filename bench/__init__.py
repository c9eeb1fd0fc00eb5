"""Burst traces, systems, runners and paired reports (see bench/RESULTS.md for GPU figures)."""
