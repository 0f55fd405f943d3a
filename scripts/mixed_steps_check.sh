#!/usr/bin/env bash
# Serving before and after a change, on one GPU in one run (issue 19's table): for each tree (BEFORE=folders
# each holding an older autoprofile/, models/, scripts/, space-separated; and this checkout), a default
# auto-profile behind
# `autoprofile serve`, then fresh random 1024/128 prompts at concurrency 1, 64 and 256 (bench_serving, which
# measures the GPU's GEMM and copy rates before the server starts and prints the c256 roofline fraction).
#   OUT=dir BEFORE=before MODEL=llama-3.1-8b bash scripts/mixed_steps_check.sh
# C1=1 adds concurrency 1 (32 prompts); SERVE_FLAGS=--deterministic serves every tree with that flag;
# FLAGS_<name>=... serves the BEFORE tree named <name> (its folder's basename) alone with more flags (a copy of
# this checkout in sync/ with FLAGS_sync=--disable_overlap_schedule: one change, A/B).
set -uo pipefail
OUT=${OUT:-/tmp/mixed}; MODEL=${MODEL:-llama-3.1-8b}; BEFORE=${BEFORE:-}; PROMPTS=${PROMPTS:-1000}
mkdir -p "$OUT"
HERE=$(pwd); SITE=${SITE:-}
export PYTHONPATH=$SITE:$HERE  # the client: this checkout's bench_serving for both trees
for tree in ${BEFORE:+$BEFORE} .; do
  name=$([ "$tree" = . ] && echo after || basename "$tree")
  # NOTE: the server starts inside its tree: `python3 -m` puts the working directory ahead of PYTHONPATH,
  # so a server started here ran this checkout's code whatever PYTHONPATH said
  ENV="env -C $HERE/$tree PYTHONPATH=$SITE:$HERE/$tree"
  echo "== $name: $($ENV python3 -c 'import autoprofile; print(autoprofile.__file__)')"
  SERVE="$ENV python3 -m autoprofile.cli serve --model $MODEL --port 0"
  own="FLAGS_$name"
  SERVE="$SERVE --report_dir '' ${SERVE_FLAGS:-} ${!own:-}"
  B=(python3 scripts/bench_serving.py --launch "$SERVE" --random-input-len 1024 --random-output-len 128)
  "${B[@]}" --roofline --max-concurrency 256 --num-prompts "$PROMPTS" --result-file "$OUT/$name-c256.json" 2>"$OUT/$name-c256.err" \
    | grep -E "Successful|Failed|Benchmark duration|Total Token throughput|Median TPOT|Median TTFT|P99 TTFT|roofline|NOTE|engine over"
  echo "== $name c256 done"
  if [ "${C1:-0}" = 1 ]; then
    "${B[@]}" --max-concurrency 1 --num-prompts 32 --result-file "$OUT/$name-c1.json" 2>/dev/null \
      | grep -E "Successful|Total Token throughput|Median TPOT|Median TTFT|P99 TTFT|engine over"
    echo "== $name c1 done"
  fi
  if [ "${SMALL:-1}" = 1 ]; then
    "${B[@]}" --max-concurrency 64 --num-prompts 256 --result-file "$OUT/$name-c64.json" 2>/dev/null \
      | grep -E "Successful|Total Token throughput|Median TPOT|Median TTFT|P99 TTFT|engine over"
    echo "== $name c64 done"
  fi
done
