#!/usr/bin/env bash
# Images under --tp (issue 32): one vision-language model served at --tp 1, then at --tp $TP, each answering
# $PROMPTS chat requests that all carry the same $SIZE picture (random words after it), sent at once; prints
# each run's wall time and the ratio. Under --tp the step broadcast ships an image's pixels only with the step
# that encodes it (rank 0's log, at shutdown: "step broadcast: N steps shipped X MiB of steps and Y MiB of
# pixels"). Target: --tp 2 within 1.3x of --tp 1.
#   OUT=/tmp/tpimg bash scripts/tp_images_check.sh        # on a host with >= 2 GPUs
set -uo pipefail
OUT=${OUT:-/tmp/tpimg}; MODEL=${MODEL:-qwen2.5-vl-7b}; TP=${TP:-2}; PROMPTS=${PROMPTS:-200}
SIZE=${SIZE:-1200x900}; IN=${IN:-64}; OUTLEN=${OUTLEN:-64}
export NCCL_NVLS_ENABLE=0  # NVLink multicast off on these hosts (the ranks set it too)
mkdir -p "$OUT"
for tp in 1 "$TP"; do
  SERVE="python3 -m autoprofile.cli serve --model $MODEL --port 0 --report_dir $OUT/report-tp$tp --tp $tp ${SERVE_FLAGS:-}"
  python3 scripts/bench_serving.py --launch "$SERVE" --dataset-name random-mm --random-mm-shared-images \
    --random-mm-image-size "$SIZE" --random-input-len "$IN" --random-output-len "$OUTLEN" \
    --num-prompts "$PROMPTS" --seed 1 --result-file "$OUT/tp$tp.json" 2>"$OUT/tp$tp.log" \
    | grep -E "Successful|Failed|Benchmark duration|Total Token throughput|Median TTFT|Median TPOT|engine over"
  grep -E "step broadcast:|KV cache:|Traceback|OutOfMemory" "$OUT/tp$tp.log" | head -5
done
python3 - "$OUT" "$TP" <<'PY'
import json, sys
out, tp = sys.argv[1], sys.argv[2]
one, many = (json.load(open(f"{out}/tp{n}.json")) for n in ("1", tp))
ratio = many["duration"] / one["duration"]
print(f"--tp 1: {one['duration']:.1f} s ({one['completed']} ok, {one['failed']} failed); --tp {tp}: "
      f"{many['duration']:.1f} s ({many['completed']} ok, {many['failed']} failed); ratio {ratio:.2f} "
      f"({'within' if ratio <= 1.3 else 'OVER'} the 1.3x target)")
PY
