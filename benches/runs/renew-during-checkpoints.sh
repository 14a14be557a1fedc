#!/bin/bash
# Unary renewal latency at a steady 20,000/s with 1M sessions; pass presenced flags to compare,
# e.g. `--data-dir DIR --checkpoint-interval-ms 1000` against none.
# usage: bash benches/runs/renew-during-checkpoints.sh PORT [presenced flags...]
set -u
PORT=$1; shift
cd "$(dirname "$0")/../.."
./target/release/presenced serve --listen 127.0.0.1:$PORT --min-renew-interval-ms 0 "$@" > /dev/null 2>/tmp/presenced-checkpoint-run.log &
SP=$!
sleep 1
./target/release/presence-loadgen load --target presenced --addr 127.0.0.1:$PORT --users 400000 --sessions-per-user 2.5 --ttl-ms 600000 --duration 20s --register-mode leases --connections 4 --mode unary --concurrency 16 --rate 20000 --quiet 2>&1 | grep -E "heartbeats/s|99% in|Requests/sec"
kill $SP; wait $SP 2>/dev/null
