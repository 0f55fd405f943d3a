#!/usr/bin/env bash
# The FP8 KV cache on one GPU, in one run: the kernel tests, a default auto-profile of each text model with
# --kv_cache_dtype fp8_e4m3 (and plan's prediction beside it), the accuracy against bf16 KV, and the decode
# step against its floor in both dtypes.
#   OUT=dir GPU=h100 MODELS="llama-3.1-8b qwen2.5-7b qwen3-8b" bash scripts/fp8_kv_check.sh
set -u
OUT=${OUT:-fp8_out}
GPU=${GPU:-h100}
MODELS=${MODELS:-"llama-3.1-8b qwen2.5-7b qwen3-8b"}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${KERNELS:-1}" = 1 ]; then
  python3 -m pytest -q -x tests/test_kernels.py -k "fp8 or rope or paged_decode or store_kv or prefix" 2>&1 | tail -4
fi
for m in $MODELS; do
  for dt in ${DTYPES:-fp8_e4m3}; do
    start=$(date +%s)
    python3 -m autoprofile.cli profile --model "$m" --kv_cache_dtype "$dt" --report_dir "$OUT/$m-$dt" \
      > "$OUT/$m-$dt.log" 2>&1
    echo "== $m $dt: exit $? in $(( $(date +%s) - start )) s"
    grep -E "max_total_token_num =|CUDA context|non-KV peak|local memory|KV cache  |scales|Error|error" \
      "$OUT/$m-$dt.log" | tail -8
    python3 -m autoprofile.cli plan --model "$m" --kv_cache_dtype "$dt" --gpu "$GPU" 2>&1 | grep -iE "predict|max_total"
    rm -f "$OUT/$m-$dt/budget_timeline.png"
  done
done
if [ "${ACCURACY:-1}" = 1 ]; then
  python3 scripts/kv_accuracy.py --model llama-3.1-8b --prompts 4 --prompt-len 1024 --steps 64 2>&1 | tail -4
fi
if [ "${DECODE:-1}" = 1 ]; then
  for dt in auto fp8_e4m3; do
    python3 scripts/bench_decode.py --batches 1,256 --contexts 131072 --kv_cache_dtype "$dt" 2>&1 \
      | grep -E "b1|b256|131072 |floor|copy" | head -8
  done
fi
