"""Load tests for OpenAI-compatible servers: `python -m loadtests {run,compare,plot,suite}`."""
