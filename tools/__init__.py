"""Microbenchmarks of one component, never shipped: `python -m tools.X`. End to end: `specserve bench`."""
