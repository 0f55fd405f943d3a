#!/usr/bin/env bash
# GPU check of images inside the envelope: a default auto-profile of qwen2.5-vl-7b behind `autoprofile serve`,
# then through HTTP: bench_serving random-mm at concurrency 1 and 64, 64 concurrent requests each with the most
# images (--max_images_per_request, default 4) larger than --max_image_pixels (resized down to it), and a soak
# mixing image and text requests with disconnects; SIGTERM must drain and exit 0. Results under $OUT.
#   OUT=/tmp/vl SOAK_MINUTES=4 bash scripts/vl_serving_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/vl}; SOAK_MINUTES=${SOAK_MINUTES:-4}; PORT=${PORT:-8123}; MODEL=${MODEL:-qwen2.5-vl-7b}
mkdir -p "$OUT"
python3 -m autoprofile.cli serve --model "$MODEL" --port "$PORT" --report_dir "$OUT/report" > "$OUT/server.log" 2>&1 &
PID=$!
URL=http://127.0.0.1:$PORT
until python3 -c "import urllib.request as u; u.urlopen('$URL/health')" 2>/dev/null; do
  sleep 2; kill -0 $PID 2>/dev/null || { tail -40 "$OUT/server.log"; exit 1; }
done
grep -E "KV cache:|local memory|measure:" "$OUT/server.log"
B=(python3 scripts/bench_serving.py --base-url "$URL" --dataset-name random-mm)
"${B[@]}" --random-mm-base-items-per-request 1 --random-mm-image-size 1280x720 --random-input-len 256 \
  --random-output-len 128 --max-concurrency 1 --num-prompts 16 --result-file "$OUT/c1.json" | tail -22
"${B[@]}" --random-mm-base-items-per-request 1 --random-mm-image-size 1280x720 --random-input-len 256 \
  --random-output-len 128 --max-concurrency 64 --num-prompts 256 --seed 1 --result-file "$OUT/c64.json" | tail -22
"${B[@]}" --random-mm-base-items-per-request 4 --random-mm-image-size 1400x1000 --random-input-len 64 \
  --random-output-len 64 --max-concurrency 64 --num-prompts 64 --seed 2 --result-file "$OUT/max_images.json" | tail -22
python3 scripts/bench_serving.py --base-url "$URL" --soak-minutes "$SOAK_MINUTES" --soak-images 4 \
  --random-output-len 128 --result-file "$OUT/soak.json" | tail -60
kill -TERM $PID; wait $PID; echo "server exit: $?"
grep -cE "Traceback|OutOfMemory" "$OUT/server.log"
