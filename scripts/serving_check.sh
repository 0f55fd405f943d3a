#!/usr/bin/env bash
# `autoprofile serve` under load after its default auto-profile: 256 concurrent fresh 1024/128 requests, then
# 256 concurrent context-filling requests (more K/V than the cache holds: preemption), 0 OOM; SIGTERM drains.
#   OUT=dir MODEL=llama-3.1-8b SERVE_FLAGS="--kv_cache_dtype fp8_e4m3" [FILL_LEN=N FILL_OUT=N] \
#     bash scripts/serving_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/serving}; PORT=${PORT:-8124}; MODEL=${MODEL:-llama-3.1-8b}; FILL_LEN=${FILL_LEN:-8000}
# FILL_OUT: output tokens of each fill request: long enough that requests outlive the cache filling up
FILL_OUT=${FILL_OUT:-64}
mkdir -p "$OUT"
# shellcheck disable=SC2086 # SERVE_FLAGS: several flags
python3 -m autoprofile.cli serve --model "$MODEL" --port "$PORT" --report_dir "$OUT/report" ${SERVE_FLAGS:-} \
  > "$OUT/server.log" 2>&1 &
PID=$!
URL=http://127.0.0.1:$PORT
T0=$(date +%s)
until python3 -c "import urllib.request as u; u.urlopen('$URL/health')" 2>/dev/null; do
  sleep 2; kill -0 $PID 2>/dev/null || { tail -60 "$OUT/server.log"; exit 1; }
done
echo "healthy after $(( $(date +%s) - T0 )) s"
grep -E "KV cache:|FP8|measure:|built:|experts:" "$OUT/server.log" | head -20
B=(python3 scripts/bench_serving.py --base-url "$URL")
"${B[@]}" --random-input-len 1024 --random-output-len 128 --max-concurrency 256 --num-prompts 768 \
  --result-file "$OUT/c256.json" | tail -24
"${B[@]}" --random-input-len "$FILL_LEN" --random-output-len "$FILL_OUT" --max-concurrency 256 \
  --num-prompts 256 \
  --result-file "$OUT/fill.json" | tail -24
python3 -c "import urllib.request as u; print(u.urlopen('$URL/metrics').read().decode())" \
  | grep -E "^autoprofile_(preempt|kv_|num_|oom)" | head -14
grep -E "FP8 KV scales set" "$OUT/server.log"
kill -TERM $PID; wait $PID; echo "server exit: $?"
echo "OOM/Traceback lines: $(grep -cE 'Traceback|OutOfMemory' "$OUT/server.log")"
