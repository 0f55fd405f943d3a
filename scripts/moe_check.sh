#!/usr/bin/env bash
# An MoE model on one GPU: `plan`, then scripts/serving_check.sh (the default auto-profile, whose stress runs
# the worst and balanced routing corners, with its report in $OUT/report; 256 concurrent requests; a KV fill).
#   OUT=dir MODEL=qwen3-30b-a3b GPU=h200 bash scripts/moe_check.sh
set -uo pipefail
MODEL=${MODEL:-qwen3-30b-a3b}; GPU=${GPU:-h200}
python3 -m autoprofile.cli plan --gpu "$GPU" --model "$MODEL" | tail -12
MODEL="$MODEL" SERVE_FLAGS="--profile_cache= ${SERVE_FLAGS:-}" exec bash "$(dirname "$0")/serving_check.sh"
