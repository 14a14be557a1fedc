#!/bin/bash
# Renewals/s through Leases batches on a fresh presenced (docs/benchmarks.md).
# usage: bash benches/runs/leases-batch.sh PORT BATCH IN_FLIGHT CONNECTIONS   (after cargo build --release --workspace)
set -u
PORT=$1; BATCH=$2; CONC=$3; CONNS=$4
cd "$(dirname "$0")/../.."
./target/release/presenced serve --listen 127.0.0.1:$PORT --min-renew-interval-ms 0 > /dev/null 2>&1 &
SP=$!
sleep 1
./target/release/presence-loadgen load --target presenced --addr 127.0.0.1:$PORT --users 200000 --sessions-per-user 2.5 --ttl-ms 600000 --duration 15s --register-mode leases --connections $CONNS --mode leases --batch $BATCH --concurrency $CONC --quiet 2>&1 | grep -E "heartbeats/s|99% in|Requests/sec"
kill $SP; wait $SP 2>/dev/null
