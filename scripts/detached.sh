#!/usr/bin/env bash
# A job that outlives one device call (a run past the 10 minutes a call may take: a hostile run to completion,
# a soak). Each call of the device replaces the checkout it runs in, and a job started from it dies with it
# (its current folder is gone). This starts the job from a copy of the tree outside the checkout, in a new
# session (setsid: the device keeps it running between calls while the machine is held), and waits for it
# from later calls, returning as soon as it ends.
#   bash scripts/detached.sh start NAME COMMAND...  # copy the tree to $ROOT/NAME/src; run COMMAND there;
#                                                   # its output in $ROOT/NAME/log, $OUT=$ROOT/NAME/out
#   bash scripts/detached.sh wait NAME SECONDS      # up to SECONDS, polling; prints the state and the
#                                                   # log's tail; exit 0 ended (its status in $ROOT/NAME/rc),
#                                                   # 3 running, 1 no such job or it died without a status
#   bash scripts/detached.sh collect NAME DIR       # copy its out/ and log into DIR (the call's $OUT)
# ROOT defaults to /tmp/detached. Keep the machine held between calls: the device gives it back when idle.
set -uo pipefail
ROOT=${ROOT:-/tmp/detached}
cmd=${1:-}; name=${2:-}
[ -n "$cmd" ] && [ -n "$name" ] || { sed -n 2,15p "$0"; exit 2; }
job="$ROOT/$name"
case "$cmd" in
  start)
    shift 2
    [ $# -gt 0 ] || { echo "detached: start $name: no command" >&2; exit 2; }
    [ -e "$job" ] && { echo "detached: $job exists: another name, or remove it" >&2; exit 2; }
    top=$(cd "$(dirname "$0")/.." && pwd)
    mkdir -p "$job/src" "$job/out"
    (cd "$top" && tar --exclude=./.git -cf - .) | tar -xf - -C "$job/src"
    printf '%q ' "$@" > "$job/cmd"
    # the job's status is written when it ends; a job killed outright leaves none (wait says it died)
    cd "$job/src" || exit 1
    OUT="$job/out" setsid bash -c "$(cat "$job/cmd") > '$job/log' 2>&1; echo \$? > '$job/rc'" \
      < /dev/null > /dev/null 2>&1 &
    echo $! > "$job/pid"
    echo "detached: $name started (pid $(cat "$job/pid")) in $job/src"
    ;;
  wait)
    secs=${3:-0}
    [ -d "$job" ] || { echo "detached: no job $name under $ROOT" >&2; exit 1; }
    end=$(( $(date +%s) + secs ))
    while [ ! -e "$job/rc" ] && kill -0 "$(cat "$job/pid")" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do
      sleep 2
    done
    tail -n "${TAIL:-20}" "$job/log" 2>/dev/null
    if [ -e "$job/rc" ]; then echo "detached: $name ended, status $(cat "$job/rc")"; exit 0; fi
    if kill -0 "$(cat "$job/pid")" 2>/dev/null; then echo "detached: $name still running"; exit 3; fi
    echo "detached: $name died without a status"; exit 1
    ;;
  collect)
    dir=${3:?collect NAME DIR}
    mkdir -p "$dir" && cp -r "$job/out/." "$dir/" && cp "$job/log" "$dir/$name.log"
    ;;
  *) sed -n 2,15p "$0"; exit 2 ;;
esac
