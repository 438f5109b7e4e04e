"""`specserve bench` (loadtests/cli.py): every benchmark of the engine or the server end to end. The engine
never imports it; `tools/` keeps the microbenchmarks of one component (docs/load-tests.md)."""
