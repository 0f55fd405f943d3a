#!/usr/bin/env bash
# An FP8 KV boot behind `autoprofile serve` under load: 256 concurrent fresh 1024/128 requests, then 256
# concurrent context-filling requests (more K/V than the cache holds: preemption), 0 OOM; SIGTERM drains.
#   OUT=dir MODEL=llama-3.1-8b bash scripts/fp8_serving_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/fp8}; PORT=${PORT:-8124}; MODEL=${MODEL:-llama-3.1-8b}; FILL_LEN=${FILL_LEN:-8000}
mkdir -p "$OUT"
python3 -m autoprofile.cli serve --model "$MODEL" --kv_cache_dtype fp8_e4m3 --port "$PORT" --report_dir "" \
  > "$OUT/server.log" 2>&1 &
PID=$!
URL=http://127.0.0.1:$PORT
until python3 -c "import urllib.request as u; u.urlopen('$URL/health')" 2>/dev/null; do
  sleep 2; kill -0 $PID 2>/dev/null || { tail -40 "$OUT/server.log"; exit 1; }
done
grep -E "KV cache:|FP8|measure:" "$OUT/server.log"
B=(python3 scripts/bench_serving.py --base-url "$URL")
"${B[@]}" --random-input-len 1024 --random-output-len 128 --max-concurrency 256 --num-prompts 768 \
  --result-file "$OUT/c256.json" | tail -24
"${B[@]}" --random-input-len "$FILL_LEN" --random-output-len 64 --max-concurrency 256 --num-prompts 256 \
  --result-file "$OUT/fill.json" | tail -24
python3 -c "import urllib.request as u; print(u.urlopen('$URL/metrics').read().decode())" \
  | grep -E "^autoprofile_(preempt|kv_|num_)" | head -12
grep -E "FP8 KV scales set" "$OUT/server.log"
kill -TERM $PID; wait $PID; echo "server exit: $?"
echo "OOM/Traceback lines: $(grep -cE 'Traceback|OutOfMemory' "$OUT/server.log")"
