#!/usr/bin/env bash
# Renewals/s of one Python process: through LeaseChannel against a fresh
# target/release/presenced (--min-renew-interval-ms 0: every renewal is a
# real one), then seed 000's design through redis-py against a fresh
# redis-server. Run from clients/python with its venv's python as PYTHON.
#   PYTHON=.venv/bin/python bash bench/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BIN=${PRESENCED_BIN:-../../target/release/presenced}
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
RUST_LOG=warn "$BIN" serve --listen "127.0.0.1:$port" --min-renew-interval-ms 0 >/dev/null &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
sleep 1
PYTHONPATH=. PRESENCED="127.0.0.1:$port" "$PYTHON" bench/renew.py
echo "presenced CPU over the whole run (registering included): $(ps -o cputime= -p $server)"
kill $server
"$PYTHON" bench/renew_redis.py
