#!/usr/bin/env bash
# The host KV tier on one GPU, in one run (issue 36): its GPU tests (exact copies, the page-transfer kernel's
# bandwidth against per-run copies and a pinned copy, loads beside the compute stream, deterministic hits),
# then the multi-turn benchmark, tier on against off: CONVS conversations of TURNS turns at RATE requests/s,
# histories outgrowing a GPU KV pinned at KV tokens.
#   OUT=dir CONVS=64 TURNS=10 RATE=2 KV=200000 bash scripts/host_kv_check.sh
# On a 2-GPU host, TP=1 adds tests/test_tp_host_kv_gpu.py (each rank its own shard of the tier).
set -u
OUT=${OUT:-host_kv_out}; CONVS=${CONVS:-64}; TURNS=${TURNS:-10}; RATE=${RATE:-2}; KV=${KV:-200000}
MODEL=${MODEL:-llama-3.1-8b}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest -q -s tests/test_host_kv_gpu.py 2>&1 | grep -E "GiB/s|passed|failed|Error"
if [ "${TP:-0}" = 1 ]; then
  NCCL_NVLS_ENABLE=0 python3 -m pytest -q tests/test_tp_host_kv_gpu.py 2>&1 | tail -2
fi
serve="python3 -m autoprofile.cli serve --model $MODEL --port 0 --max_total_token_num $KV"
python3 scripts/bench_serving.py --multi-turn "$CONVS" --num-turns "$TURNS" --random-input-len 1024 \
  --random-output-len 128 --request-rate "$RATE" --seed 2 --launch "$serve --host_kv auto" \
  --compare-launch "$serve" --result-file "$OUT/multi_turn.json" 2>&1 | grep -E "TTFT|launch|host tier|NOTE"
