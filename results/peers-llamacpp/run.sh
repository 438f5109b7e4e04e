#!/bin/bash
# specserve as stored, a second specserve (SECOND, default --dtype float32), llama-server on the same GGUF; side by
# side, interleaved. Writes pair.json next to this script (OUT: elsewhere). LLAMA_SERVER: the llama-server binary
# (../shared/peers/README.md). GGUF: another file than the default model's; SERVE_FLAGS / LLAMA_FLAGS: flags both
# specserve servers / llama-server get (e.g. a chat template for a file without one).
OUT=${OUT:+$(realpath -m "$OUT")}
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
GGUF=${GGUF:-$(.venv/bin/python -c "from engine.models.loader import default_gguf_path; print(default_gguf_path())")}
NAME=$(.venv/bin/python -c "from engine.models.loader import DEFAULT_MODEL_NAME, default_gguf_path as d; import sys; \
p = sys.argv[1]; print(DEFAULT_MODEL_NAME if p == str(d()) else p.rsplit('/', 1)[-1].removesuffix('.gguf'))" "$GGUF")
LS=${LLAMA_SERVER:-/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server}
.venv/bin/specserve serve --model "$GGUF" $SERVE_FLAGS --port 8101 --max-model-len 2048 --max-num-seqs 32 > /tmp/peer_q4.log 2>&1 &
P1=$!
.venv/bin/specserve serve --model "$GGUF" $SERVE_FLAGS ${SECOND:---dtype float32} --port 8102 --max-model-len 2048 --max-num-seqs 32 > /tmp/peer_f32.log 2>&1 &
P2=$!
"$LS" -m "$GGUF" -c 8192 -np 32 -t 2 $LLAMA_FLAGS --port 8103 > /tmp/peer_llama.log 2>&1 &
P3=$!
for port in 8101 8102 8103; do
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 2; done
done
cd "$(mktemp -d)" && ROUNDS=${ROUNDS:-3} "$OLDPWD/.venv/bin/python" "${SIDE_BY_SIDE:-$OLDPWD/../shared/peers/side_by_side.py}" \
  ${NAME1:-specserve-q4}=8101=$NAME ${NAME2:-specserve-f32}=8102=$NAME ${NAME3:-llama-server-q4_1}=8103=x \
  && cp pair.json "${OUT:-$OLDPWD/results/peers-llamacpp/pair.json}"
kill $P1 $P2 $P3
