"""The benchmark harness behind `specserve bench serve|offline|sweep` (loadtests/cli.py). The engine never
imports it; `tools/` keeps the kernel and engine microbenchmarks."""
