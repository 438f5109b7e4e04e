#!/bin/bash
# specserve q4 (the default model as stored) and vLLM-CPU (bfloat16, OMP_NUM_THREADS=2) on the same model,
# each measured alone: vLLM's Intel OpenMP workers spin for a while after each request and slow a server
# beside them. Writes specserve.json and vllm.json (side_by_side.py's pair.json) next to this script.
# Needs the vLLM venv and an HF folder of the model (../shared/peers/README.md; the folder:
# `.venv/bin/python -m loadtests.export_f32 /tmp/models/smollm2-f32`).
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
OUT=$PWD/results/peers-vllm
SBS=${SIDE_BY_SIDE:-$PWD/../shared/peers/side_by_side.py}
MODEL_DIR=${MODEL_DIR:-/tmp/models/smollm2-f32}
wait_up() { for i in $(seq 1 60); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return; sleep 5; done; exit 1; }
.venv/bin/specserve serve --port 8101 --max-model-len 2048 --max-num-seqs 32 > /tmp/peer_q4.log 2>&1 &
P=$!; wait_up 8101
(cd "$(mktemp -d)" && ROUNDS=${ROUNDS:-3} "$OLDPWD/.venv/bin/python" "$SBS" specserve-q4=8101=SmolLM2-135M-Instruct \
  && cp pair.json "$OUT/specserve.json")
kill $P; sleep 3
OMP_NUM_THREADS=2 bash "${VLLM_SERVE:-$PWD/../shared/peers/vllm_serve.sh}" vllm-bf16 8202 "$MODEL_DIR" bfloat16 \
  --served-model-name smollm2 --max-num-seqs 32
wait_up 8202
(cd "$(mktemp -d)" && ROUNDS=${ROUNDS:-3} "$OLDPWD/.venv/bin/python" "$SBS" vllm-bf16=8202=smollm2 \
  && cp pair.json "$OUT/vllm.json")
kill "$(cat /tmp/vllmprobe/logs/vllm-bf16.pid)"
