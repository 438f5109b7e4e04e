"""Benchmarks: `python -m tools.benchmark.spec_benchmark` (offline speculative decoding)."""
