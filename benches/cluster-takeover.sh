#!/usr/bin/env bash
# How long a cluster takes to give a dead node's slots to the others.
#
#   bash benches/cluster-takeover.sh                # 10 runs, 3 nodes, 1024 slots, lease TTL 5 s
#   RUNS=3 TTL_MS=2000 bash benches/cluster-takeover.sh
#
# Each run starts one etcd (default raft timers, throwaway dir, private loopback
# ports) and three `presenced serve --etcd ...` nodes, waits until the slots
# are shared, then `kill -9`s the node that owns the most, and polls etcd
# (its JSON gateway, every 20 ms) until no slot names that node any more.
# It prints, per run, the time from the kill to that point, then p50 and max.
#
# This is the slot map's takeover only, with no sessions: each slot goes to
# its follower, which would take in its copy of the dead node's users before
# answering (C4, docs/cluster.md); that part is not timed here. etcd expires the lease TTL after the last
# keep-alive it received (sent every TTL/3), so a kill lands between TTL*2/3
# and TTL before the expiry, plus etcd's expiry check and the coordinator's claims.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-10}
TTL_MS=${TTL_MS:-5000}
SLOTS=${SLOTS:-1024}
BIN=${PRESENCED_BIN:-target/release/presenced}
ETCD=${PRESENCED_ETCD_BIN:-etcd}

command -v "$ETCD" >/dev/null || { echo "no etcd: bash .ci/install-etcd" >&2; exit 1; }
[ -x "$BIN" ] || cargo build --release --bin presenced

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now_ms() { date +%s%3N; }

# How many slots each node owns: "node count" lines, from etcd's JSON gateway.
owners() {
    local endpoint=$1 prefix=$2
    local key end
    key=$(printf '%sslots/' "$prefix" | base64 -w0)
    end=$(printf '%sslots0' "$prefix" | base64 -w0)
    curl -s -X POST "$endpoint/v3/kv/range" -d "{\"key\":\"$key\",\"range_end\":\"$end\"}" |
        python3 -c 'import sys,json,base64,collections
kvs=json.load(sys.stdin).get("kvs",[])
c=collections.Counter(base64.b64decode(kv["value"]).decode() for kv in kvs)
for node,n in sorted(c.items()): print(node, n)'
}

times=()
for run in $(seq 1 "$RUNS"); do
    pids=()
    client=$(free_port); peer=$(free_port)
    endpoint="http://127.0.0.1:$client"
    "$ETCD" --name bench --data-dir "$work/etcd-$run" \
        --listen-client-urls "$endpoint" --advertise-client-urls "$endpoint" \
        --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
        --initial-cluster "bench=http://127.0.0.1:$peer" >"$work/etcd-$run.log" 2>&1 &
    pids+=($!)
    until curl -sf "$endpoint/health" >/dev/null; do sleep 0.05; done
    prefix="/bench-$run/"
    declare -A node_pid=()
    for n in 1 2 3; do
        port=$(free_port)
        RUST_LOG=warn "$BIN" serve --listen "127.0.0.1:$port" --etcd "$endpoint" --node-id "node-$n" \
            --advertise "127.0.0.1:$port" --slots "$SLOTS" --etcd-prefix "$prefix" \
            --etcd-lease-ttl-ms "$TTL_MS" >"$work/node-$n-$run.log" 2>&1 &
        pids+=($!)
        node_pid["node-$n"]=$!
    done
    # Formed: every slot owned, by all three.
    until [ "$(owners "$endpoint" "$prefix" | awk '{s+=$2; n++} END {print (n==3 ? s : 0)}')" = "$SLOTS" ]; do sleep 0.05; done
    map=$(owners "$endpoint" "$prefix")
    victim=$(sort -k2 -n <<<"$map" | tail -1 | cut -d' ' -f1)
    held=$(awk -v v="$victim" '$1==v {print $2}' <<<"$map")
    killed=$(now_ms)
    kill -9 "${node_pid[$victim]}"
    # (The map is read whole before grep looks at it: with pipefail, an early
    # exit of grep would fail the reader and end the wait too soon.)
    while map=$(owners "$endpoint" "$prefix") && grep -q "^$victim " <<<"$map"; do sleep 0.02; done
    took=$(( $(now_ms) - killed ))
    times+=("$took")
    echo "run $run: $victim held $held slots; all owned by the others $took ms after kill -9 (lease TTL $TTL_MS ms)"
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    unset node_pid
    sleep 0.2
done
sorted=$(printf '%s\n' "${times[@]}" | sort -n)
p50=$(echo "$sorted" | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
max=$(echo "$sorted" | tail -1)
echo "takeover of a dead node's slots over $RUNS runs: p50 $p50 ms, max $max ms (lease TTL $TTL_MS ms, $SLOTS slots, 3 nodes)"
