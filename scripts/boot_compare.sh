#!/usr/bin/env bash
# Boots side by side on one host: seconds from `autoprofile serve` to /health 200, then the first
# response_format json_object request's seconds, and the report's phases, for this tree and each tree in
# BEFORE (directories holding a `git archive REV autoprofile models scripts`), cold then warm.
#   MODEL=llama-3.1-8b BEFORE="before" WARM=2 OUT=dir bash scripts/boot_compare.sh
# (FLAGS: more `serve` flags for every boot, e.g. FLAGS="--device cpu" MODEL=tiny to try it without a GPU)
# cold: an empty Triton cache and profile cache for each tree; warm: both filled by that tree's boot before.
# The trees alternate, so a host's drift falls on both. Each boot's line is kept in $OUT/summary.txt too.
set -u
MODEL=${MODEL:-llama-3.1-8b}; FLAGS=${FLAGS:-}; PORT=${PORT:-8131}; WARM=${WARM:-2}; OUT=${OUT:-/tmp/boot_compare}
TREES=". ${BEFORE:-}"
mkdir -p "$OUT"
boot() {  # label, tree, cache dir
  local label=$1 tree=$2 cache=$3 t0 t1 t2 pid
  t0=$(date +%s.%N)
  (cd "$tree" && TRITON_CACHE_DIR=$cache/triton PYTHONPATH=$PWD python3 -m autoprofile.cli serve --model "$MODEL" \
     --port "$PORT" --profile_cache "$cache/profile" --report_dir '' $FLAGS > "$OUT/boot_$label.log" 2>&1) &
  pid=$!
  until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null; do
    sleep 0.2; kill -0 $pid 2>/dev/null || { echo "$label: server died"; tail -5 "$OUT/boot_$label.log"; return; }
  done
  t1=$(date +%s.%N)
  curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d \
    '{"messages":[{"role":"user","content":"hi"}],"max_tokens":16,"response_format":{"type":"json_object"}}' \
    > /dev/null
  t2=$(date +%s.%N)
  pkill -TERM -P $pid; wait $pid
  printf "%-24s boot %6.1f s   first JSON request %5.2f s\n" "$label" "$(python3 -c "print($t1 - $t0)")" \
    "$(python3 -c "print($t2 - $t1)")" | tee -a "$OUT/summary.txt"
  grep -E "^  phases:|^    [a-z+#0-9]+: graphs|slowest of|non-KV peak|max_total_token_num =" "$OUT/boot_$label.log"
}
i=0
for tree in $TREES; do rm -rf "$OUT/cache$i"; i=$((i + 1)); done
for round in cold $(seq -s ' ' -f 'warm%g' 1 "$WARM"); do
  i=0
  for tree in $TREES; do
    boot "$round-$(basename "$(cd "$tree" && pwd)")" "$tree" "$OUT/cache$i"
    i=$((i + 1))
  done
done
