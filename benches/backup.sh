#!/usr/bin/env bash
# D3: a backup of a node holding SESSIONS sessions (default 1,000,000) while
# gateways renew them at a fleet's rate, beside the same renewals without one.
#
#   bash benches/backup.sh                  # 400,000 users x 2.5 = 1M sessions
#   USERS=40000 bash benches/backup.sh      # a quick run
#
# What it does, on a fresh `presenced serve --min-renew-interval-ms 0` (every
# renewal a store write, as in compare.sh; release build, no data
# directory, so checkpoints do not run beside the backups):
#   1. `presence-loadgen load` registers USERS x 2.5 sessions (Leases batches),
#      then renews them for DURATION at sessions / 15 s (the modelled heartbeat
#      interval): the quiet run, renewal latency in quiet.json;
#   2. the same again, and once the sessions are registered, `presenced backup`
#      back to back until the run ends, so every renewal of the heartbeat
#      phase overlaps a backup: renewal latency in during.json, each backup's
#      summary line (users, sessions, bytes, ms) in backups.txt.
# Prints the renewal p50/p99 of both runs and the backups' times and sizes.
# The generator, the server and the backup client share this machine.
set -euo pipefail
cd "$(dirname "$0")/.."

USERS=${USERS:-400000}
DURATION=${DURATION:-30s}
RESULTS=${RESULTS:-$(mktemp -d /tmp/presenced-backup-bench.XXXXXX)}
mkdir -p "$RESULTS"
BIN=${PRESENCED_BIN:-target/release/presenced}   # another build's binary, to compare
LOADGEN=target/release/presence-loadgen

cargo build --release -p presenced -p presence-loadgen >&2

SERVER_PID=
stop_server() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null; SERVER_PID=; }
trap stop_server EXIT

start_server() {
    local out="$RESULTS/server-$1.out"
    "$BIN" serve --listen 127.0.0.1:0 --min-renew-interval-ms 0 >"$out" 2>"$RESULTS/server-$1.err" &
    SERVER_PID=$!
    for _ in $(seq 100); do
        if grep -q "listening on" "$out" 2>/dev/null; then break; fi
        sleep 0.1
    done
    ADDR=$(sed -n 's/^listening on //p' "$out")
}

load() {
    "$LOADGEN" load --target presenced --addr "$ADDR" --users "$USERS" --sessions-per-user 2.5 \
        --mode leases --batch 500 --concurrency 8 --connections 4 --rate interval \
        --ttl-ms 600000 --duration "$DURATION" --quiet --report "$RESULTS/$1.json" >"$RESULTS/$1.txt"
}

sessions() { "$BIN" stats --addr "$ADDR" --json | python3 -c "import json,sys; print(json.load(sys.stdin)['sessions'])"; }

p() { # percentile $2 of report $1, in ms
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print([x['latency'] for x in d['latencyDistribution'] if x['percentage']==int(sys.argv[2])][0]/1e6)" "$1" "$2"
}

start_server quiet
load quiet
stop_server

start_server during
load during &
LOAD_PID=$!
# The registers are done once (nearly) every session is held: 2.5 per user on average.
expected=$(python3 -c "print(int($USERS * 2.5 * 0.99))")
until [ "$(sessions || echo 0)" -ge "$expected" ] 2>/dev/null; do sleep 0.2; done
: >"$RESULTS/backups.txt"
while kill -0 "$LOAD_PID" 2>/dev/null; do
    "$BIN" backup --addr "$ADDR" "$RESULTS/node.backup" >>"$RESULTS/backups.txt"
done
wait "$LOAD_PID"
stop_server

echo "results in $RESULTS"
echo "renewals, no backup:      p50 $(p "$RESULTS/quiet.json" 50) ms, p99 $(p "$RESULTS/quiet.json" 99) ms"
echo "renewals, backups running: p50 $(p "$RESULTS/during.json" 50) ms, p99 $(p "$RESULTS/during.json" 99) ms"
python3 - "$RESULTS/backups.txt" <<'PY'
import re, statistics, sys
lines = open(sys.argv[1]).read().split("\n")
runs = [tuple(map(int, m.groups())) for m in (re.search(r"(\d+) sessions, .* (\d+) bytes in (\d+) ms", l) for l in lines) if m]
ms = sorted(r[2] for r in runs)
print(f"backups taken: {len(runs)}, of {runs[-1][0]} sessions, {runs[-1][1]} bytes; "
      f"time median {statistics.median(ms)} ms, min {ms[0]} ms, max {ms[-1]} ms")
PY
