#!/usr/bin/env bash
# scripts/serving_check.sh after an FP8 KV boot.
#   OUT=dir MODEL=llama-3.1-8b bash scripts/fp8_serving_check.sh
SERVE_FLAGS="--kv_cache_dtype fp8_e4m3 ${SERVE_FLAGS:-}" exec bash "$(dirname "$0")/serving_check.sh"
