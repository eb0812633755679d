#!/usr/bin/env bash
# NVIDIA's aiperf (a standard OpenAI-compatible load client, no torch) against our server with
# image inputs, on the CPU with the shipped tiny model: a handful of streamed chat requests,
# each one synthetic PNG + a synthetic text prompt. Not a CI leg (aiperf's venv is ~1.2 GB);
# the recorded run is in docs/PERFORMANCE.md ("aiperf against the server").
#
#   ci/aiperf_run.sh [OUT_DIR]          # default OUT_DIR: ci/results/aiperf-cpu-tiny
#   AIPERF=/path/to/aiperf MODEL_DIR=/models/PaddleOCR-VL-0.9B DEVICE=cuda ci/aiperf_run.sh
#
# aiperf lives in its own venv (it pins its own fastapi/transformers):
#   python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-ci/results/aiperf-cpu-tiny}
AIPERF=${AIPERF:-/tmp/aiperf-venv/bin/aiperf}
PY=${PYTHON:-python3}
MODEL_DIR=${MODEL_DIR:-$($PY -c "from fastdeploy_ext.conformance.references import Manifest; print(Manifest.load().path('tiny_vl'))")}
DEVICE=${DEVICE:-cpu}
PORT=${PORT:-$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")}
REQUESTS=${REQUESTS:-8}
CONCURRENCY=${CONCURRENCY:-2}
mkdir -p "$OUT"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
$PY -m fastdeploy_ext.entrypoints.cli serve --model "$MODEL_DIR" --device "$DEVICE" --dtype float32 \
    --kv-cache-memory 64MiB --max-model-len 2048 --host 127.0.0.1 --port "$PORT" \
    --served-model-name paddleocr-vl --log-file "$OUT/server.log" --log-stats-interval 2 \
    >"$OUT/server.stderr" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "server exited; see $OUT/server.stderr" >&2; exit 1; }
    sleep 0.5
done

# --tokenizer: the model dir's own tokenizer.json; --use-server-token-count: the counts of the
# usage field (re-tokenizing a random model's text client-side counts other tokens)
CMD=("$AIPERF" profile --model paddleocr-vl --url "http://127.0.0.1:$PORT" --endpoint-type chat --streaming
     --tokenizer "$MODEL_DIR" --use-server-token-count
     --image-batch-size 1 --image-width-mean 320 --image-height-mean 180 --image-format png
     --synthetic-input-tokens-mean 16 --output-tokens-mean 16 --extra-inputs ignore_eos:true
     --request-count "$REQUESTS" --concurrency "$CONCURRENCY" --ui-type simple
     --output-artifact-dir "$OUT/artifacts")
printf '%q ' "${CMD[@]}" > "$OUT/command.txt"; echo >> "$OUT/command.txt"
"${CMD[@]}" 2>&1 | tee "$OUT/aiperf.txt"
