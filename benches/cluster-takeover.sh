#!/usr/bin/env bash
# How long a cluster takes to give a dead node's slots, with their users, to
# the others, and whether anyone flips.
#
#   bash benches/cluster-takeover.sh                # 10 runs, 3 nodes, 1024 slots, lease TTL 5 s, 100k sessions
#   RUNS=3 TTL_MS=2000 SESSIONS=0 bash benches/cluster-takeover.sh
#
# Each run starts one etcd (default raft timers, throwaway dir, private loopback
# ports) and three `presenced serve --etcd ...` nodes, waits until the slots
# are shared, registers SESSIONS sessions through the cluster client
# (presence-loadgen --cluster-slots) entering at a node other than the victim
# and keeps renewing them (TTL 45 s, every session every few hundred ms),
# then `kill -9`s the node that owns the most slots. It polls, every 20 ms:
# - etcd (its JSON gateway) until no slot names that node any more: the map;
# - the survivors' `presenced_taken_over_users_total` until it reaches the
#   users the victim held: the followers have taken their copies in and
#   answer for every one of them (C4).
# It prints, per run, both times from the kill, and the OFFLINE flips the
# survivors published meanwhile (every session keeps renewing, so any is
# spurious; target 0), then p50 and max.
#
# etcd expires the lease TTL after the last keep-alive it received (sent
# every TTL/3), so a kill lands between TTL*2/3 and TTL before the expiry,
# plus etcd's expiry check and the coordinator's claims.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-10}
TTL_MS=${TTL_MS:-5000}
SLOTS=${SLOTS:-1024}
SESSIONS=${SESSIONS:-100000}
BIN=${PRESENCED_BIN:-target/release/presenced}
LOADGEN=${LOADGEN_BIN:-target/release/presence-loadgen}
ETCD=${PRESENCED_ETCD_BIN:-etcd}

command -v "$ETCD" >/dev/null || { echo "no etcd: bash .ci/install-etcd" >&2; exit 1; }
[ -x "$BIN" ] || cargo build --release --bin presenced
[ "$SESSIONS" = 0 ] || [ -x "$LOADGEN" ] || cargo build --release -p presence-loadgen

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

# shellcheck source=benches/cluster-common.sh
source benches/cluster-common.sh
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
state_times=()
flip_counts=()
for run in $(seq 1 "$RUNS"); do
    pids=()
    start_etcd "$run"
    prefix="/bench-$run/"
    declare -A node_pid=() node_addr=() node_metrics=()
    for n in 1 2 3; do
        port=$(free_port); metrics=$(free_port)
        RUST_LOG=warn "$BIN" serve --listen "127.0.0.1:$port" --etcd "$endpoint" --node-id "node-$n" \
            --advertise "127.0.0.1:$port" --slots "$SLOTS" --etcd-prefix "$prefix" \
            --etcd-lease-ttl-ms "$TTL_MS" --metrics-listen "127.0.0.1:$metrics" >"$work/node-$n-$run.log" 2>&1 &
        pids+=($!)
        node_pid["node-$n"]=$!
        node_addr["node-$n"]="127.0.0.1:$port"
        node_metrics["node-$n"]="127.0.0.1:$metrics"
    done
    # Formed: every slot owned, by all three.
    until [ "$(owners "$endpoint" "$prefix" | awk '{s+=$2; n++} END {print (n==3 ? s : 0)}')" = "$SLOTS" ]; do sleep 0.05; done
    map=$(owners "$endpoint" "$prefix")
    victim=$(sort -k2 -n <<<"$map" | tail -1 | cut -d' ' -f1)
    held=$(awk -v v="$victim" '$1==v {print $2}' <<<"$map")
    survivors=()
    for n in 1 2 3; do [ "node-$n" = "$victim" ] || survivors+=("${node_metrics[node-$n]}"); done
    gateway=
    statuses=
    victim_users=0
    if [ "$SESSIONS" != 0 ]; then
        entry=node-1; [ "$victim" != node-1 ] || entry=node-2
        "$LOADGEN" load --addr "${node_addr[$entry]}" --cluster-slots "$SLOTS" --mode leases --batch 500 \
            --concurrency 4 --users $((SESSIONS * 2 / 5)) --sessions-per-user 2.5 --rate 100000 \
            --duration $(( TTL_MS / 1000 + 15 ))s --quiet --report "$work/load-$run.json" >"$work/load-$run.txt" 2>&1 &
        gateway=$!
        # Registered, and the followers' copies a few intervals behind at most.
        until [ "$(metric_sum 'presenced_sessions ' "${node_metrics[@]}")" -ge "$SESSIONS" ]; do sleep 0.1; done
        sleep 1
        victim_users=$(metric_sum 'presenced_online_users ' "${node_metrics[$victim]}")
    fi
    offline_before=$(metric_sum 'presenced_flips_total{state="offline"}' "${survivors[@]}")
    taken_before=$(metric_sum 'presenced_taken_over_users_total' "${survivors[@]}")
    killed=$(now_ms)
    kill -9 "${node_pid[$victim]}"
    # (The map is read whole before grep looks at it: with pipefail, an early
    # exit of grep would fail the reader and end the wait too soon.)
    while map=$(owners "$endpoint" "$prefix") && grep -q "^$victim " <<<"$map"; do sleep 0.02; done
    took=$(( $(now_ms) - killed ))
    times+=("$took")
    with_state=-
    if [ "$SESSIONS" != 0 ]; then
        while [ $(( $(metric_sum 'presenced_taken_over_users_total' "${survivors[@]}") - taken_before )) -lt "$victim_users" ]; do
            sleep 0.02
        done
        with_state=$(( $(now_ms) - killed ))
        state_times+=("$with_state")
        wait "$gateway" || true
        statuses=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["statusCodeDistribution"])' "$work/load-$run.json")
    fi
    flips=$(( $(metric_sum 'presenced_flips_total{state="offline"}' "${survivors[@]}") - offline_before ))
    flip_counts+=("$flips")
    echo "run $run: $victim held $held slots, $victim_users users; the map gave them to the others $took ms after" \
        "kill -9, the followers answered for all its users $with_state ms after; $flips OFFLINE flips" \
        "(lease TTL $TTL_MS ms)${statuses:+; renewals: $statuses}"
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    unset node_pid node_addr node_metrics
    sleep 0.2
done
p50_max() {
    local sorted
    sorted=$(printf '%s\n' "$@" | sort -n)
    echo "p50 $(echo "$sorted" | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}') ms, max $(echo "$sorted" | tail -1) ms"
}
echo "over $RUNS runs (lease TTL $TTL_MS ms, $SLOTS slots, 3 nodes, $SESSIONS sessions):"
echo "  the map: $(p50_max "${times[@]}")"
[ "$SESSIONS" = 0 ] || echo "  the users answered for by the followers: $(p50_max "${state_times[@]}")"
echo "  OFFLINE flips: $(IFS=+; echo $(( ${flip_counts[*]} ))) in all"
