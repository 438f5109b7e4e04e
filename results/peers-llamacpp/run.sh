#!/bin/bash
# specserve q4 (as stored), specserve float32, llama-server on the same GGUF; side by side, interleaved.
# Writes pair.json next to this script (OUT: elsewhere). LLAMA_SERVER: the llama-server binary
# (../shared/peers/README.md). SECOND: the second specserve's flags (default --dtype float32), NAME2 its name.
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
GGUF=$(.venv/bin/python -c "from engine.models.loader import default_gguf_path; print(default_gguf_path())")
LS=${LLAMA_SERVER:-/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server}
.venv/bin/specserve serve --port 8101 --max-model-len 2048 --max-num-seqs 32 > /tmp/peer_q4.log 2>&1 &
P1=$!
.venv/bin/specserve serve --port 8102 ${SECOND:---dtype float32} --max-model-len 2048 --max-num-seqs 32 > /tmp/peer_f32.log 2>&1 &
P2=$!
"$LS" -m "$GGUF" -c 8192 -np 32 -t 2 --port 8103 > /tmp/peer_llama.log 2>&1 &
P3=$!
for port in 8101 8102 8103; do
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 2; done
done
cd "$(mktemp -d)" && ROUNDS=${ROUNDS:-3} "$OLDPWD/.venv/bin/python" "${SIDE_BY_SIDE:-$OLDPWD/../shared/peers/side_by_side.py}" \
  specserve-q4=8101=SmolLM2-135M-Instruct ${NAME2:-specserve-f32}=8102=SmolLM2-135M-Instruct llama-server-q4_1=8103=x \
  && cp pair.json "${OUT:-$OLDPWD/results/peers-llamacpp/pair.json}"
kill $P1 $P2 $P3
