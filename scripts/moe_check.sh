#!/usr/bin/env bash
# An MoE model end to end on one GPU: the default auto-profile (worst and balanced routing corners in its
# stress) with its report, `plan` beside it, then `autoprofile serve` under load: 256 concurrent fresh
# 1024/128 requests, then 256 concurrent context-filling requests (preemption); 0 OOM; SIGTERM drains.
#   OUT=dir MODEL=qwen3-30b-a3b bash scripts/moe_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/moe}; PORT=${PORT:-8125}; MODEL=${MODEL:-qwen3-30b-a3b}; FILL_LEN=${FILL_LEN:-8000}
GPU=${GPU:-h200}
mkdir -p "$OUT"
python3 -m autoprofile.cli plan --gpu "$GPU" --model "$MODEL" | tail -12
python3 -m autoprofile.cli serve --model "$MODEL" --port "$PORT" --report_dir "$OUT/report" \
  --profile_cache "" > "$OUT/server.log" 2>&1 &
PID=$!
URL=http://127.0.0.1:$PORT
T0=$(date +%s)
until python3 -c "import urllib.request as u; u.urlopen('$URL/health')" 2>/dev/null; do
  sleep 2; kill -0 $PID 2>/dev/null || { tail -60 "$OUT/server.log"; exit 1; }
done
echo "healthy after $(( $(date +%s) - T0 )) s"
grep -E "KV cache:|measure:|probe|validate|built:|peak|non-torch|stack" "$OUT/server.log" | head -30
B=(python3 scripts/bench_serving.py --base-url "$URL")
"${B[@]}" --random-input-len 1024 --random-output-len 128 --max-concurrency 256 --num-prompts 768 \
  --result-file "$OUT/c256.json" | tail -24
"${B[@]}" --random-input-len "$FILL_LEN" --random-output-len 64 --max-concurrency 256 --num-prompts 256 \
  --result-file "$OUT/fill.json" | tail -24
python3 -c "import urllib.request as u; print(u.urlopen('$URL/metrics').read().decode())" \
  | grep -E "^autoprofile_(preempt|kv_|num_|oom)" | head -14
kill -TERM $PID; wait $PID; echo "server exit: $?"
echo "OOM/Traceback lines: $(grep -cE 'Traceback|OutOfMemory' "$OUT/server.log")"
