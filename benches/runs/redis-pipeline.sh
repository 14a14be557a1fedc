#!/bin/bash
# The same renewal load as leases-batch.sh against redis-server running the seed 000 scripts, pipelines of 1,000.
# usage: bash benches/runs/redis-pipeline.sh   (needs redis-server; benches/compare.sh installs it)
set -u
cd "$(dirname "$0")/../.."
PORT=$((20000 + RANDOM % 20000)); DIR=$(mktemp -d)
redis-server --port $PORT --bind 127.0.0.1 --dir $DIR --save '' --appendonly no --daemonize yes --pidfile $DIR/r.pid --logfile $DIR/r.log
sleep 0.5
./target/release/presence-loadgen load --target redis --redis-url redis://127.0.0.1:$PORT --users 200000 --sessions-per-user 2.5 --ttl-ms 600000 --duration 15s --register-mode leases --connections 2 --mode leases --batch 1000 --concurrency 4 --quiet 2>&1 | grep -E "heartbeats/s|99% in|Requests/sec"
redis-cli -p $PORT shutdown nosave >/dev/null 2>&1; rm -rf $DIR
