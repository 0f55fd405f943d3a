#!/usr/bin/env bash
# FP8 weights against bf16 on one card, side by side in one run (issue 31): for each model in $MODELS, a default
# auto-profile behind `autoprofile serve` (its KV tokens and weight format from the log), then through HTTP the
# batch-1 decode (32 fresh 1024/128 prompts at concurrency 1: TPOT) and c256 throughput (1,000 fresh 1024/128
# prompts, --roofline at the bf16 GEMM rate); SIGTERM must drain and exit 0. Results under $OUT.
#   OUT=/tmp/fp8w MODELS="llama-3.1-8b llama-3.1-8b-fp8" [C1=0: c256 only] bash scripts/fp8_weights_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/fp8w}; MODELS=${MODELS:-llama-3.1-8b llama-3.1-8b-fp8}; N256=${N256:-1000}
mkdir -p "$OUT"
for m in $MODELS; do
  echo "== $m"
  B=(python3 scripts/bench_serving.py --random-input-len 1024 --random-output-len 128)
  if [ "${C1:-1}" != 0 ]; then
    "${B[@]}" --launch "python3 -m autoprofile.cli serve --model $m --port 0 --report_dir $OUT/report-$m" \
      --max-concurrency 1 --num-prompts 32 --result-file "$OUT/$m-c1.json" 2>"$OUT/$m-c1.log" \
      | grep -E "Successful|Failed|Output token throughput|Median TPOT|Median TTFT|engine over"
    grep -E "KV cache:|weights|measure:" "$OUT/$m-c1.log" | grep -v "loading weights" | head -6
  fi
  "${B[@]}" --launch "python3 -m autoprofile.cli serve --model $m --port 0" --roofline --max-concurrency 256 \
    --num-prompts "$N256" --seed 1 --result-file "$OUT/$m-c256.json" 2>"$OUT/$m-c256.log" \
    | grep -E "Successful|Failed|Total Token throughput|Median TPOT|Median TTFT|P99 TTFT|roofline|engine over"
  grep -E "KV cache:" "$OUT/$m-c256.log" | head -1
  echo "OOM/Traceback lines: $(cat "$OUT/$m"-c*.log | grep -cE 'Traceback|OutOfMemory')"
done
