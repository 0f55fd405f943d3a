#!/usr/bin/env bash
# Seconds from `autoprofile serve` to a healthy server, cold (an empty Triton cache) and warm, auto-profile
# against --max_total_token_num at the same size (issue 18's startup table).
#   MODEL=llama-3.1-8b TOKENS=500688 bash scripts/boot_time.sh
set -u
MODEL=${MODEL:-llama-3.1-8b}; TOKENS=${TOKENS:-500688}; PORT=${PORT:-8131}
boot() {  # label, cache dir, extra flags...
  local label=$1 cache=$2; shift 2
  local t0; t0=$(date +%s.%N)
  TRITON_CACHE_DIR=$cache python3 -m autoprofile.cli serve --model "$MODEL" --port "$PORT" --report_dir '' "$@" \
    > "/tmp/boot_$label.log" 2>&1 &
  local pid=$!
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null; do
    sleep 0.2; kill -0 $pid 2>/dev/null || { echo "$label: server died"; tail -5 "/tmp/boot_$label.log"; return; }
  done
  local t1; t1=$(date +%s.%N)
  kill -TERM $pid; wait $pid
  printf "%-14s %6.1f s   %s\n" "$label" "$(python3 -c "print($t1 - $t0)")" \
    "$(grep -oE 'phase [a-z+#0-9 ()]+: [0-9.]+ s|captured [0-9]+ decode graphs in [0-9.]+ s|KV cache: [0-9]+ tokens' \
       "/tmp/boot_$label.log" | tr '\n' ' ')"
}
# cold: an empty Triton cache and an empty profile cache; warm: both filled by the boot before
rm -rf /tmp/tc_a /tmp/tc_b /tmp/pc_a
boot cold-auto /tmp/tc_a --profile_cache /tmp/pc_a
boot warm-auto /tmp/tc_a --profile_cache /tmp/pc_a
boot warm-auto-probe /tmp/tc_a --profile_cache ''
boot warm-pinned /tmp/tc_a --max_total_token_num "$TOKENS"
boot cold-pinned /tmp/tc_b --max_total_token_num "$TOKENS"
