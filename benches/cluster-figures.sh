#!/usr/bin/env bash
# The cluster's figures (docs/benchmarks.md, "Cluster"): what routing costs at
# scale, how far a follower's copy lags under renewals, and what a slot move
# costs. Every process runs on this machine, on loopback.
#
#   bash benches/cluster-figures.sh scale    # 4 nodes, 4M sessions, vs one node with as many
#   bash benches/cluster-figures.sh lag      # follower lag while 100k renewals/s go on
#   bash benches/cluster-figures.sh move     # a slot move: time and bytes per 10k sessions
#   bash benches/cluster-figures.sh drain    # every slot of a node moved (SIGTERM) under 100k renewals/s
#   bash benches/cluster-figures.sh rooms    # room watchers and updates through 3 nodes vs one node
#   bash benches/cluster-figures.sh watch    # viewers' merged Watch through 3 nodes vs one node vs Redis
#   bash benches/cluster-figures.sh all
#
# Knobs: SESSIONS (scale, default 4000000), DURATION (scale, rooms and
# watch, default 20s), NODES (scale, default 4), RATE (lag, default 100000),
# PER_SLOT (move, default 10000 sessions per slot), ROOMS (rooms, default
# 10000), VIEWERS (watch, default 1000). Reports (the load generator's JSON)
# go to target/cluster-figures/.
# Needs etcd (bash .ci/install-etcd); builds the release binaries if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${PRESENCED_BIN:-target/release/presenced}
LOADGEN=${LOADGEN_BIN:-target/release/presence-loadgen}
ETCD=${PRESENCED_ETCD_BIN:-etcd}
OUT=target/cluster-figures
command -v "$ETCD" >/dev/null || { echo "no etcd: bash .ci/install-etcd" >&2; exit 1; }
[ -x "$BIN" ] || cargo build --release --bin presenced
[ -x "$LOADGEN" ] || cargo build --release -p presence-loadgen
mkdir -p "$OUT"

work=$(mktemp -d)
pids=()
stop_all() {
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT

# shellcheck source=benches/cluster-common.sh
source benches/cluster-common.sh
rss_mib() { awk '/VmRSS/ {printf "%.0f", $2/1024}' "/proc/$1/status"; }

# Starts nodes node-1..node-$1 of a cluster of $2 slots under prefix $3;
# sets node_addr[i], node_pid[i], node_metrics[i]; returns once every slot has an owner.
declare -a node_addr node_pid node_metrics
start_nodes() {
    local count=$1 slots=$2 prefix=$3 n port metrics
    node_addr=(); node_pid=(); node_metrics=()
    for n in $(seq 1 "$count"); do
        port=$(free_port); metrics=$(free_port)
        RUST_LOG=warn "$BIN" serve --listen "127.0.0.1:$port" --etcd "$endpoint" --node-id "node-$n" \
            --advertise "127.0.0.1:$port" --slots "$slots" --etcd-prefix "$prefix" \
            --metrics-listen "127.0.0.1:$metrics" --min-renew-interval-ms 0 >"$work/node-$n.log" 2>&1 &
        pids+=($!)
        node_addr[n]="127.0.0.1:$port"; node_pid[n]=$!; node_metrics[n]="127.0.0.1:$metrics"
    done
    until "$BIN" cluster status --etcd "$endpoint" --etcd-prefix "$prefix" --slots "$slots" --json 2>/dev/null |
        python3 -c 'import sys,json; s=json.load(sys.stdin); sys.exit(0 if s["unowned"] == 0 and len(s["nodes"]) == int(sys.argv[1]) else 1)' "$count"; do
        sleep 0.1
    done
}

# Starts one presenced node without etcd, the cluster's figures' baseline;
# sets single_addr and single_pid once it answers.
start_single() {
    local port
    port=$(free_port)
    RUST_LOG=warn "$BIN" serve --listen "127.0.0.1:$port" --min-renew-interval-ms 0 >"$work/single.log" 2>&1 &
    pids+=($!)
    single_pid=$!
    single_addr="127.0.0.1:$port"
    until "$BIN" get nobody --addr "$single_addr" >/dev/null 2>&1; do sleep 0.1; done
}

# Starts one redis-server that keeps nothing on disk, for the seed's design;
# sets redis_url and redis_pid once it answers.
start_redis() {
    local port
    port=$(free_port)
    redis-server --port "$port" --bind 127.0.0.1 --dir "$work" --save '' --appendonly no >"$work/redis.log" 2>&1 &
    pids+=($!)
    redis_pid=$!
    redis_url="redis://127.0.0.1:$port"
    until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.05; done
}

# A field of a load generator report: report_field FILE python-expression-on-r
report_field() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print($2)" "$1" "${@:3}"; }

scale() {
    local sessions=${SESSIONS:-4000000} duration=${DURATION:-20s} nodes=${NODES:-4}
    local users=$((sessions * 2 / 5))
    local gen=(--mode leases --batch 500 --concurrency 16 --users "$users" --sessions-per-user 2.5
        --duration "$duration" --quiet)
    echo "== scale: $nodes nodes, $sessions sessions, renewals through the cluster client"
    start_etcd scale
    start_nodes "$nodes" 1024 /figures/
    "$LOADGEN" load --addr "${node_addr[1]}" --cluster-slots 1024 "${gen[@]}" --report "$OUT/scale-cluster.json" \
        >"$OUT/scale-cluster.txt"
    for n in $(seq 1 "$nodes"); do echo "  node-$n resident: $(rss_mib "${node_pid[n]}") MiB"; done
    report_field "$OUT/scale-cluster.json" \
        '"  cluster: %.0f renewals/s, p50 %.2f ms, p99 %.2f ms, registers %.0f/s, generator %.0f%% of the cores" % (r["rps"], r["scenario"]["percentiles_ns"]["p50"]/1e6, r["scenario"]["percentiles_ns"]["p99"]/1e6, r["scenario"]["registers_per_s"], 100*r["scenario"]["generator_cpu_share"])'
    report_field "$OUT/scale-cluster.json" '"  statuses: %s" % r["statusCodeDistribution"]'
    stop_all
    echo "== scale: one node (no etcd), $sessions sessions, the same generator"
    start_single
    "$LOADGEN" load --addr "$single_addr" "${gen[@]}" --report "$OUT/scale-single.json" >"$OUT/scale-single.txt"
    echo "  single node resident: $(rss_mib "$single_pid") MiB"
    report_field "$OUT/scale-single.json" \
        '"  single: %.0f renewals/s, p50 %.2f ms, p99 %.2f ms, registers %.0f/s, generator %.0f%% of the cores" % (r["rps"], r["scenario"]["percentiles_ns"]["p50"]/1e6, r["scenario"]["percentiles_ns"]["p99"]/1e6, r["scenario"]["registers_per_s"], 100*r["scenario"]["generator_cpu_share"])'
    stop_all
    # The Redis + Lua design of seed 000 beside them: one redis-server (the
    # load generator speaks no Redis Cluster), the same population and batches.
    command -v redis-server >/dev/null || { echo "  (no redis-server: apt-get install redis-server)"; return; }
    echo "== scale: one redis-server with the seed's scripts, $sessions sessions, the same generator"
    start_redis
    "$LOADGEN" load --target redis --redis-url "$redis_url" "${gen[@]}" --report "$OUT/scale-redis.json" \
        >"$OUT/scale-redis.txt"
    echo "  redis-server resident: $(rss_mib "$redis_pid") MiB"
    report_field "$OUT/scale-redis.json" \
        '"  redis: %.0f renewals/s, p50 %.2f ms, p99 %.2f ms, registers %.0f/s, generator %.0f%% of the cores" % (r["rps"], r["scenario"]["percentiles_ns"]["p50"]/1e6, r["scenario"]["percentiles_ns"]["p99"]/1e6, r["scenario"]["registers_per_s"], 100*r["scenario"]["generator_cpu_share"])'
    stop_all
}

# The follower lag histogram summed over the nodes: "le count" lines.
lag_buckets() {
    local n
    for n in "$@"; do curl -s "http://$n/metrics"; done |
        awk -F'[{}" ]+' '/^presenced_follower_lag_seconds_bucket/ {c[$3]+=$4} END {for (le in c) print le, c[le]}' |
        sort -g
}

lag() {
    local rate=${RATE:-100000}
    echo "== lag: 3 nodes; 1M sessions renewed at $rate/s while 200k more register beside them"
    start_etcd lag
    start_nodes 3 1024 /lag/
    lag_buckets "${node_metrics[@]:1}" >"$work/lag-before"
    "$LOADGEN" load --addr "${node_addr[1]}" --cluster-slots 1024 --mode leases --batch 500 --concurrency 8 \
        --users 400000 --sessions-per-user 2.5 --duration 20s --rate "$rate" --quiet \
        --report "$OUT/lag-renewals.json" >"$OUT/lag-renewals.txt" &
    local renewing=$!
    # Registers (changes a follower receives) once the renewals run.
    sleep 12
    lag_buckets "${node_metrics[@]:1}" >"$work/lag-before"
    "$LOADGEN" load --addr "${node_addr[1]}" --cluster-slots 1024 --mode leases --batch 100 --concurrency 4 \
        --users 80000 --sessions-per-user 2.5 --first-user 10000000 --duration 1s --gateway-id second --quiet \
        --report "$OUT/lag-registers.json" >"$OUT/lag-registers.txt"
    lag_buckets "${node_metrics[@]:1}" >"$work/lag-after"
    wait "$renewing"
    report_field "$OUT/lag-renewals.json" \
        '"  renewals: %.0f/s achieved, p99 %.2f ms, statuses %s" % (r["rps"], r["scenario"]["percentiles_ns"]["p99"]/1e6, r["statusCodeDistribution"])'
    report_field "$OUT/lag-registers.json" '"  registers beside them: %.0f/s" % r["scenario"]["registers_per_s"]'
    python3 - "$work/lag-before" "$work/lag-after" <<'EOF'
import sys
def read(path):
    return {float(le) if le != "+Inf" else float("inf"): float(c) for le, c in (line.split() for line in open(path))}
before, after = read(sys.argv[1]), read(sys.argv[2])
les = sorted(after)
counts = [after[le] - before.get(le, 0) for le in les]
total = counts[-1]
def quantile(q):
    for le, c in zip(les, counts):
        if c >= q * total:
            return le
print(f"  follower updates applied meanwhile: {total:.0f}; lag p50 <= {quantile(0.5)*1000:g} ms, "
      f"p99 <= {quantile(0.99)*1000:g} ms, max <= {quantile(1.0)*1000:g} ms (histogram bucket bounds)")
EOF
    stop_all
}

move() {
    local per_slot=${PER_SLOT:-10000} slots=8
    local sessions=$((per_slot * slots))
    echo "== move: 2 nodes, $slots slots, $sessions sessions (~$per_slot a slot)"
    start_etcd move
    start_nodes 2 "$slots" /move/
    "$LOADGEN" load --addr "${node_addr[1]}" --cluster-slots "$slots" --mode leases --batch 500 --concurrency 8 \
        --users $((sessions * 2 / 5)) --sessions-per-user 2.5 --duration 1s --quiet >"$OUT/move-load.txt"
    # Each of node-1's slots in turn (a slot of node-2's is refused, and skipped), three in all.
    local moved=0 slot answer
    for slot in $(seq 0 $((slots - 1))); do
        answer=$("$BIN" cluster move "$slot" node-2 --etcd "$endpoint" --etcd-prefix /move/ --slots "$slots" \
            --json 2>/dev/null) || continue
        python3 -c 'import json,sys; m=json.loads(sys.argv[1]); s=max(m["sessions"],1)
print("  slot %d: %d users, %d sessions, %d bytes, %d ms: %.0f bytes and %.1f ms per 10k sessions" % (m["slot"], m["users"], m["sessions"], m["bytes"], m["elapsed_ms"], m["bytes"]*1e4/s, m["elapsed_ms"]*1e4/s))' "$answer"
        moved=$((moved + 1))
        [ "$moved" -lt 3 ] || break
    done
    stop_all
}

# 100k sessions renewed at 100k/s through the cluster client for 20 s,
# entering at node-1; with `sigterm`, node-2 is stopped with SIGTERM after
# 8 s and hands every slot it owns to the others (a planned move of all of
# a node's slots). Prints the renewals' statuses and latency, the OFFLINE
# flips, and the sessions the cluster holds at the end.
drain_run() {
    local label=$1
    start_etcd "drain-$label"
    start_nodes 3 1024 "/drain-$label/"
    local all=("${node_metrics[@]:1}")
    "$LOADGEN" load --addr "${node_addr[1]}" --cluster-slots 1024 --mode leases --batch 500 --concurrency 8 \
        --users 40000 --sessions-per-user 2.5 --duration 20s --rate 100000 --quiet \
        --report "$OUT/drain-$label.json" >"$OUT/drain-$label.txt" &
    local renewing=$!
    until [ "$(metric_sum 'presenced_sessions ' "${all[@]}")" -ge 100000 ]; do sleep 0.1; done
    sleep 8
    local offline_before held
    offline_before=$(metric_sum 'presenced_flips_total{state="offline"}' "${all[@]}")
    local survivors=("${all[@]}")
    if [ "$label" = sigterm ]; then
        held=$(metric_sum 'presenced_sessions ' "${node_metrics[2]}")
        survivors=("${node_metrics[1]}" "${node_metrics[3]}")
        local stopped
        stopped=$(date +%s%3N)
        kill -TERM "${node_pid[2]}"
        wait "${node_pid[2]}" || true
        echo "  node-2 handed $held sessions over and exited $(( $(date +%s%3N) - stopped )) ms after SIGTERM"
    fi
    wait "$renewing"
    echo "  OFFLINE flips: $(( $(metric_sum 'presenced_flips_total{state="offline"}' "${survivors[@]}") - offline_before ));" \
        "sessions held at the end: $(metric_sum 'presenced_sessions ' "${survivors[@]}") of 100000"
    report_field "$OUT/drain-$label.json" \
        '"  renewals: %.0f/s, p50 %.2f ms, p99 %.2f ms, p99.9 %.2f ms, max %.2f ms; statuses %s" % (r["rps"], r["scenario"]["percentiles_ns"]["p50"]/1e6, r["scenario"]["percentiles_ns"]["p99"]/1e6, r["scenario"]["percentiles_ns"]["p999"]/1e6, r["scenario"]["percentiles_ns"]["max"]/1e6, r["statusCodeDistribution"])'
    stop_all
}

drain() {
    echo "== drain: 3 nodes, 100k sessions renewed at 100k/s for 20 s, nothing else happening"
    drain_run steady
    echo "== drain: the same, node-2 stopped with SIGTERM 8 s in (every slot it owns moves with its state)"
    drain_run sigterm
}

# room-members (tools/loadgen/README.md) through a cluster of 3 nodes and on
# one node: rooms of 50 members (distinct users spread over every node),
# 5 member watchers per room, every watcher and every batch entering at
# node-1 (the cluster client sends each item to its user's owner; node-1
# forwards a WatchRoom to its room's owner), members updating their room
# metadata, stamped with the send time, at 2,000/s. A member's update goes
# from its owner to its room's owner (Cluster/TakeRoomFacts) before the
# batch is answered, then to the watchers, relayed by node-1 where the room
# lives elsewhere.
rooms_run() {
    local label=$1
    shift
    "$LOADGEN" room-members "$@" --rooms "${ROOMS:-10000}" --members 50 --watchers-per-room 5 --churn-rate 2000 \
        --duration "${DURATION:-20s}" --quiet --report "$OUT/rooms-$label.json" >"$OUT/rooms-$label.txt"
    report_field "$OUT/rooms-$label.json" \
        '"  %s: %d watchers open in %.1f s (%d refused); updates %.0f/s of %.0f asked (%d errors), batch p99 %.2f ms; changes delivered %.0f/s (%d of %d), %d resyncs; change -> watcher p50 %.2f ms, p99 %.2f ms, max %.2f ms" % (sys.argv[2], r["scenario"]["watchers_open"], r["scenario"]["watchers_opened_in_ms"]/1e3, r["scenario"]["watchers_refused"], r["scenario"]["updates"]["per_s"], r["scenario"]["updates"]["rate_asked"], r["scenario"]["updates"]["errors"], r["scenario"]["updates"]["batch_p99_ns"]/1e6, r["scenario"]["events_per_s"], r["scenario"]["events"], r["scenario"]["events_expected"], r["scenario"]["resyncs"], r["scenario"]["delivery_p50_ns"]/1e6, r["scenario"]["delivery_p99_ns"]/1e6, r["scenario"]["delivery_max_ns"]/1e6)' \
        "$label"
}

rooms() {
    echo "== rooms: 3 nodes, ${ROOMS:-10000} rooms x 50 members, 5 member watchers a room, 2,000 updates/s, all entering at node-1"
    start_etcd rooms
    start_nodes 3 1024 /rooms/
    rooms_run cluster --addr "${node_addr[1]}" --cluster-slots 1024 --etcd "$endpoint" --etcd-prefix /rooms/
    for n in 1 2 3; do echo "  node-$n resident: $(rss_mib "${node_pid[n]}") MiB"; done
    stop_all
    echo "== rooms: one node (no etcd), the same generator"
    start_single
    rooms_run single --addr "$single_addr"
    echo "  single node resident: $(rss_mib "$single_pid") MiB"
    stop_all
}

# fanout (tools/loadgen/README.md) through a cluster of 3 nodes, on one node
# and against one redis-server running the seed's design: VIEWERS viewers
# (default 1000), each watching 500 of 100,000 users, at node-1, which
# relays the other nodes' users, each once, and merges (C2); users flipping at
# 1,000/s and a gateway renewing 10,000 other sessions, both through Leases
# batches (the cluster client sends each item to its owner).
watch_run() {
    local label=$1
    shift
    "$LOADGEN" fanout "$@" --viewers "${VIEWERS:-1000}" --watch 500 --population 100000 --churn-rate 1000 \
        --duration "${DURATION:-20s}" --quiet-phase 5s --mode leases --churn-mode leases --quiet \
        --report "$OUT/watch-$label.json" >"$OUT/watch-$label.txt"
    report_field "$OUT/watch-$label.json" \
        '"  %s: flips %.0f/s (%d errors), events delivered %.0f/s, %d resyncs; flip -> viewer p50 %.2f ms, p99 %.2f ms; gateway renewal p99 quiet %.2f ms, during %.2f ms" % (sys.argv[2], r["scenario"]["phase_plain"]["flips_per_s"], r["scenario"]["phase_plain"]["flip_errors"], r["scenario"]["phase_plain"]["events_per_s"], r["scenario"]["phase_plain"]["resyncs"], r["scenario"]["phase_plain"]["delivery_p50_ns"]/1e6, r["scenario"]["phase_plain"]["delivery_p99_ns"]/1e6, r["scenario"]["phase_quiet_gateway_renew"]["p99_ns"]/1e6, r["scenario"]["phase_plain"]["gateway_renew"]["p99_ns"]/1e6)' \
        "$label"
}

watch() {
    echo "== watch: 3 nodes, ${VIEWERS:-1000} viewers x 500 of 100,000 users at node-1, 1,000 flips/s"
    start_etcd watch
    start_nodes 3 1024 /watch/
    watch_run cluster --addr "${node_addr[1]}" --cluster-slots 1024 --etcd "$endpoint" --etcd-prefix /watch/
    for n in 1 2 3; do echo "  node-$n resident: $(rss_mib "${node_pid[n]}") MiB"; done
    stop_all
    echo "== watch: one node (no etcd), the same generator"
    start_single
    watch_run single --addr "$single_addr"
    echo "  single node resident: $(rss_mib "$single_pid") MiB"
    stop_all
    command -v redis-server >/dev/null || { echo "  (no redis-server: apt-get install redis-server)"; return; }
    echo "== watch: one redis-server with the seed's scripts and pub/sub, the same generator"
    start_redis
    watch_run redis --target redis --redis-url "$redis_url"
    stop_all
}

case "${1:-all}" in
    scale) scale ;;
    lag) lag ;;
    move) move ;;
    drain) drain ;;
    rooms) rooms ;;
    watch) watch ;;
    all) move; drain; lag; rooms; watch; scale ;;
    *) echo "usage: $0 scale|lag|move|drain|rooms|watch|all" >&2; exit 2 ;;
esac
