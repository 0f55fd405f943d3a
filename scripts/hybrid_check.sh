#!/usr/bin/env bash
# A hybrid model (Qwen3.5) served after its default auto-profile (issue 45's Show lines on one GPU):
#   1. cold boot (no profile cache) under bench_serving's --launch with --roofline: state slots, KV tokens,
#      c256 1024/128 tok/s against the roofline, SIGTERM;
#   2. warm boot (the profile cache), c1 1024/128 TPOT, then hostile traffic: HOSTILE_N concurrent requests
#      at 1,000 tokens in / HOSTILE_OUT out (more K/V and state than the GPU holds: waits and preemption),
#      /metrics (0 OOM, state slots), SIGTERM drains and exits 0.
#   3. REPEATED_N > 0 (MoE models): REPEATED_N concurrent prompts of one token repeated 1,000 times, the worst
#      routing sent from outside (scripts/repeated_prompts.py), every one whole.
#   TP > 1: --tp TP on the visible GPUs, the roofline of TP GPUs. Any model, not only hybrids.
#   OUT=dir MODEL=qwen3.5-27b PORT=8124 [SERVE_FLAGS=...] [HOSTILE_N=512 HOSTILE_OUT=2000] [TP=4 REPEATED_N=512] \
#     [HOSTILE_MAX_S=S: cut the hostile run at S s and report what completed] bash scripts/hybrid_check.sh
#   Past one device call (10 minutes): bash scripts/detached.sh start NAME bash scripts/hybrid_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/hybrid}; PORT=${PORT:-8124}; MODEL=${MODEL:-qwen3.5-27b}
TP=${TP:-1}; REPEATED_N=${REPEATED_N:-0}; HOSTILE_N=${HOSTILE_N:-512}; HOSTILE_OUT=${HOSTILE_OUT:-2000}; HOSTILE_IN=${HOSTILE_IN:-1000}
mkdir -p "$OUT"
summary() { grep -E "Successful|Failed req|duration|Output token thr|Mean TTFT|P99 TTFT|Mean TPOT|P99 TPOT|roofline|oom_while|Cut|CUT"; }
CACHE="$OUT/profile_cache"
SERVE="python3 -m autoprofile.cli serve --model $MODEL --port $PORT --profile_cache $CACHE --tp $TP ${SERVE_FLAGS:-}"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null | grep -qi h200 && echo h200 || echo h100)
python3 -m autoprofile.cli plan --model "$MODEL" --gpu "$GPU" --tp "$TP" ${PLAN_FLAGS:-} 2>&1 \
  | grep -E "predicted|state slots  |max_num_reqs" | head -4
T0=$(date +%s)
python3 scripts/bench_serving.py --launch "$SERVE" ${ROOFLINE---roofline} --roofline-tp "$TP" --random-input-len 1024 --random-output-len 128 \
  --max-concurrency 256 --num-prompts ${C256_N:-768} --seed 1 --result-file "$OUT/c256.json" > "$OUT/c256.txt" \
  2> "$OUT/cold.log"
RC=$?
echo "cold run (boot + c256 + drain): $(( $(date +%s) - T0 )) s, exit $RC"
grep -E "state slots:|KV cache:|healthy|ready after|phases|prefix cach" "$OUT/cold.log" | head -12
summary < "$OUT/c256.txt"
T0=$(date +%s)
$SERVE > "$OUT/warm.log" 2>&1 &
PID=$!
URL=http://127.0.0.1:$PORT
until python3 -c "import urllib.request as u; u.urlopen('$URL/health')" 2>/dev/null; do
  sleep 1; kill -0 $PID 2>/dev/null || { tail -60 "$OUT/warm.log"; exit 1; }
done
echo "warm boot (profile cache): healthy after $(( $(date +%s) - T0 )) s"
B=(python3 scripts/bench_serving.py --base-url "$URL" --seed 2)
"${B[@]}" --random-input-len 1024 --random-output-len 128 --max-concurrency 1 --num-prompts 6 \
  --result-file "$OUT/c1.json" | summary
[ "$HOSTILE_N" -gt 0 ] && "${B[@]}" --random-input-len "$HOSTILE_IN" --random-output-len "$HOSTILE_OUT" \
  --max-concurrency "$HOSTILE_N" --num-prompts "$HOSTILE_N" --temperature 0.8 --top-p 0.95 \
  --max-duration "${HOSTILE_MAX_S:-1800}" --result-file "$OUT/hostile.json" | summary
if [ "$REPEATED_N" -gt 0 ]; then
  echo "worst routing from outside: $REPEATED_N prompts of one token x 1000, 64 out"
  python3 scripts/repeated_prompts.py --base-url "$URL" --prompts "$REPEATED_N" --len 1000 --out 64
fi
python3 -c "import urllib.request as u; print(u.urlopen('$URL/metrics').read().decode())" \
  | grep -E "^autoprofile_(num_preempt|kv_|serving_oom|state)" | head -16
python3 -c "import urllib.request as u; print(u.urlopen('$URL/health').read().decode())"
kill -TERM $PID; wait $PID; echo "server exit: $?"
echo "OOM/Traceback lines: $(grep -cE 'Traceback|OutOfMemory' "$OUT/warm.log" "$OUT/cold.log" | tr '\n' ' ')"
