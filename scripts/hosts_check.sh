#!/usr/bin/env bash
# Tensor parallelism across simulated hosts on one 2-GPU machine (issue 49's GPU lines): NCCL kept off shared
# memory and P2P so its traffic takes the network path (sockets on loopback), as between two hosts.
#   1. --tp 2 on one host (both GPUs): greedy tokens of a few prompts (the reference), the same NCCL settings;
#   2. --tp 2 --nnodes 2: host 0 on GPU 0, host 1 on GPU 1, two launchers: the same tokens, the profile's MIN
#      across the hosts in the log, hostile traffic (more K/V than the cache holds) with 0 OOM;
#   3. host 1's launcher killed mid-generation: host 0 ends with exit != 0 and one message within 60 s.
#   TP=4: --tp 4 --nnodes 2, two GPUs a host (GPUs 0,1 and 2,3; one host: all four).
#   OUT=dir MODEL=llama-3.1-8b [TP=2] bash scripts/hosts_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/hosts}; MODEL=${MODEL:-llama-3.1-8b}; PORT=${PORT:-8130}; DIST=${DIST:-29731}; TP=${TP:-2}
PER=$(( TP / 2 ))  # GPUs a host
GPUS0=$(seq -s, 0 $(( PER - 1 ))); GPUS1=$(seq -s, $PER $(( TP - 1 )))
mkdir -p "$OUT"
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_SOCKET_IFNAME=lo
SERVE=(python3 -m autoprofile.cli serve --model "$MODEL" --port "$PORT" --profile_cache "" ${SERVE_FLAGS:-})
URL=http://127.0.0.1:$PORT
ready() {  # $1: pid of host 0's launcher, $2: its log
  local t0; t0=$(date +%s)
  until python3 -c "import urllib.request as u; u.urlopen('$URL/health')" 2>/dev/null; do
    sleep 1; kill -0 "$1" 2>/dev/null || { tail -40 "$2"; return 1; }
  done
  echo "healthy after $(( $(date +%s) - t0 )) s"
}
tokens() {
  python3 - "$URL" <<'PY'
import json, sys, urllib.request
out = []
for ids in ([5, 6, 7, 8], [9] * 12, list(range(30, 70)), list(range(1000, 1300))):
    body = json.dumps({"input_ids": [ids], "max_new_tokens": 24}).encode()
    req = urllib.request.Request(sys.argv[1] + "/generate", body, {"Content-Type": "application/json"})
    out.append(json.loads(urllib.request.urlopen(req).read())["output_ids"][0])
print(json.dumps(out))
PY
}
echo "== one host, --tp $TP"
CUDA_VISIBLE_DEVICES="$GPUS0,$GPUS1" "${SERVE[@]}" --tp "$TP" > "$OUT/one.log" 2>&1 &
P=$!
ready $P "$OUT/one.log" || exit 1
tokens > "$OUT/one.json"; kill -TERM $P; wait $P; echo "one host exit: $?"
grep -E "KV cache:|MIN|ranks" "$OUT/one.log" | head -5
echo "== two hosts, --tp $TP --nnodes 2 ($PER GPUs each)"
H=(--tp "$TP" --nnodes 2 --dist_init_addr "127.0.0.1:$DIST")
CUDA_VISIBLE_DEVICES=$GPUS0 setsid "${SERVE[@]}" "${H[@]}" --node_rank 0 > "$OUT/host0.log" 2>&1 &
H0=$!
CUDA_VISIBLE_DEVICES=$GPUS1 setsid "${SERVE[@]}" "${H[@]}" --node_rank 1 > "$OUT/host1.log" 2>&1 &
H1=$!
ready $H0 "$OUT/host0.log" || { tail -30 "$OUT/host1.log"; exit 1; }
tokens > "$OUT/two.json"
python3 -c "import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:]); print('tokens, two hosts == one host:', a == b, [len(x) for x in a])" "$OUT/one.json" "$OUT/two.json"
grep -hE "KV cache:|MIN|across|hosts|rank" "$OUT/host0.log" | head -8
python3 scripts/bench_serving.py --base-url "$URL" --random-input-len 4000 --random-output-len 64 \
  --max-concurrency 256 --num-prompts 256 --seed 3 --result-file "$OUT/fill.json" \
  | grep -E "Successful|Failed req|duration|Output token thr|oom_while"
python3 scripts/bench_serving.py --base-url "$URL" --random-input-len 1024 --random-output-len 128 \
  --max-concurrency 64 --num-prompts 128 --seed 4 | grep -E "Successful|Failed req|Output token thr|Mean TPOT"
echo "== host 1 killed mid-generation"
python3 - "$URL" <<'PY' &
import json, sys, urllib.request
body = json.dumps({"input_ids": [[5, 6, 7, 8]], "max_new_tokens": 2000}).encode()
try:
    urllib.request.urlopen(urllib.request.Request(sys.argv[1] + "/generate", body,
                                                  {"Content-Type": "application/json"}), timeout=120)
    print("long request: answered")
except Exception as e:
    print("long request:", type(e).__name__, str(e)[:200])
PY
sleep 3
T0=$(date +%s.%N)
kill -KILL -- -$H1
wait $H0; RC=$?
echo "host 0 exit $RC after $(python3 -c "import time; print(round(time.time() - $T0, 1))") s"
tail -3 "$OUT/host0.log"
sleep 2
echo "autoprofile processes left: $(pgrep -fc 'autoprofile.cli serve' || true)"
