#!/usr/bin/env bash
# presenced against the Redis + Lua baseline of seed 000, with the same workloads.
#
#   bash benches/compare.sh            # defaults: about 12 minutes on 2 cores
#   LOAD_USERS=1200000 EXPIRY_USERS=100000 bash benches/compare.sh   # the issue's full sizes
#   SCENARIOS="expiry-scale h2load" bash benches/compare.sh           # a subset
#   SCENARIOS="room-count room-counts room-members typing damping notify-targets" bash benches/compare.sh   # rooms, signals, damping (presenced only)
#   SCENARIOS=tls bash benches/compare.sh        # TLS beside plaintext: throughput, handshake storms, memory
#   SCENARIOS="memory feed-flips" bash benches/compare.sh   # what the change feed's defaults cost: memory, flips
#   BENCH_AUTH=credentials SCENARIOS="load batches" bash benches/compare.sh   # gateways with a token
#   PRESENCED_BIN=../before/target/release/presenced BENCH_AUTH=service-token SCENARIOS=load bash benches/compare.sh
#                                                # another build's presenced (before/after); the same generator
#
# BENCH_AUTH (load and batches): open (default: no credentials), service-token
# (--service-token), credentials (--credentials, a file of hashed tokens with scopes).
#
# What it does:
#   1. builds target/release/presenced and target/release/presence-loadgen;
#   2. installs redis-server (and, for the h2load and overload scenarios, h2load: nghttp2-client) from
#      the Debian packages when missing (needs root);
#   3. for every scenario, starts a fresh redis-server (private loopback port, throwaway
#      dir, no persistence) with the seed's 5 Lua scripts loaded (SCRIPT LOAD), and a fresh
#      `presenced serve --listen 127.0.0.1:0 --min-renew-interval-ms 0`, runs the scenario
#      against both back to back with the same parameters, and stops them;
#   4. writes one JSON report per run (ghz's field names) and the console output to
#      $RESULTS, and prints a side-by-side table with ratios.
# Both servers are stopped on exit, whatever happens. Nothing here is needed by cargo test.
#
# The generator and the servers share this machine: on 2 cores the generator takes a
# large share of the CPU, so absolute numbers understate both servers. Compare ratios.
set -euo pipefail
cd "$(dirname "$0")/.."

# ---- sizes (override through the environment) -----------------------------------------
LOAD_USERS=${LOAD_USERS:-200000}              # users; sessions = users x SESSIONS_PER_USER
SESSIONS_PER_USER=${SESSIONS_PER_USER:-2.5}
LOAD_DURATION=${LOAD_DURATION:-20s}           # heartbeat phase of each load run
LOAD_TTL_MS=${LOAD_TTL_MS:-600000}            # long enough that no lease expires during a run
CONCURRENCY=${CONCURRENCY:-64}                # unary: calls in flight (redis: connections)
CONNECTIONS=${CONNECTIONS:-4}                 # presenced HTTP/2 connections / Leases streams
BATCH=${BATCH:-100}                           # Leases batch / redis pipeline depth
BATCH_CONCURRENCY=${BATCH_CONCURRENCY:-8}     # batches in flight
MEMORY_SESSIONS=${MEMORY_SESSIONS:-1000000 3000000}   # presenced sizes; redis runs the first
EXPIRY_USERS=${EXPIRY_USERS:-50000}           # redis drains 500 users / 2 s: N/250 seconds
FANOUT_VIEWERS=${FANOUT_VIEWERS:-1000}
FANOUT_WATCH=${FANOUT_WATCH:-500}
FANOUT_POPULATION=${FANOUT_POPULATION:-100000}
FANOUT_CHURN=${FANOUT_CHURN:-1000}
FANOUT_DURATION=${FANOUT_DURATION:-10s}
BATCH_SWEEP=${BATCH_SWEEP:-100:8 1000:8 4000:4}  # batches: size:in-flight pairs, each run on both
FANOUT_MILLION_CHURN=${FANOUT_MILLION_CHURN:-15000}   # fanout-million: flips/s asked (5,000 users)
FANOUT_MILLION_WINDOW_MS=${FANOUT_MILLION_WINDOW_MS:-50}
TLS_ROUNDS=${TLS_ROUNDS:-2}                    # tls: plaintext and TLS runs alternate this many times
TLS_STORM_CLIENTS=${TLS_STORM_CLIENTS:-10000}  # tls: clients in each handshake storm
TLS_IDLE_CONNECTIONS=${TLS_IDLE_CONNECTIONS:-2000}   # tls: idle connections held for the memory figure
TLS_SATURATED_BATCHES=${TLS_SATURATED_BATCHES:-32}   # tls: batches of 100 in flight that keep the server busy
EXPIRY_SCALE_USERS=${EXPIRY_SCALE_USERS:-1000000}       # expiry-scale: leases ending within the window
EXPIRY_SCALE_WINDOW_MS=${EXPIRY_SCALE_WINDOW_MS:-10000}
EXPIRY_SCALE_GATEWAY_SESSIONS=${EXPIRY_SCALE_GATEWAY_SESSIONS:-10000}  # renewed throughout, unary
EXPIRY_SCALE_GATEWAY_RATE=${EXPIRY_SCALE_GATEWAY_RATE:-1000}          # renewals/s, steady
EXPIRY_SCALE_REDIS_USERS=${EXPIRY_SCALE_REDIS_USERS:-0}  # 0 = no Redis run (see expiry-scale below)
FEED_USERS=${FEED_USERS:-1000000}             # feed: leases ending within FEED_WINDOW_MS, followed through Changes
FEED_WINDOW_MS=${FEED_WINDOW_MS:-10000}
FEED_AWAY_MS=${FEED_AWAY_MS:-2000}           # feed: the consumer (or Redis subscriber) is away this long
FEED_REDIS_USERS=${FEED_REDIS_USERS:-50000}  # feed: Redis's run (its sweeper drains 250 users/s)
FEED_COST_ROUNDS=${FEED_COST_ROUNDS:-2}      # feed-cost: feed on and off alternate this many times
FEED_FLIPS_USERS=${FEED_FLIPS_USERS:-600000}  # feed-flips: users registered, one session each (every register flips)
FEED_FLIPS_BATCHES=${FEED_FLIPS_BATCHES:-100 1000}   # feed-flips: Leases batch sizes
FEED_FLIPS_ROUNDS=${FEED_FLIPS_ROUNDS:-3}     # feed-flips: feed on and off alternate this many times per size
H2LOAD_THREADS=${H2LOAD_THREADS:-2}           # h2load -t: one per core, as the generator's default
ROOMS_DURATION=${ROOMS_DURATION:-10s}         # room-count, room-members, typing, damping: the measured phase
ROOM_COUNT_MEMBERS=${ROOM_COUNT_MEMBERS:-100000}      # room-count: one room this big, 1,000 count watchers
ROOM_COUNT_CHURN=${ROOM_COUNT_CHURN:-5000}            # room-count: joins + leaves/s
ROOM_MEMBERS_ROOMS=${ROOM_MEMBERS_ROOMS:-10000}       # room-members: rooms of 50, 5 member watchers each
ROOM_MEMBERS_WATCHERS_PER_ROOM=${ROOM_MEMBERS_WATCHERS_PER_ROOM:-5}
ROOM_MEMBERS_CHURN=${ROOM_MEMBERS_CHURN:-2000}        # room-members: metadata updates/s
TYPING_ROOMS=${TYPING_ROOMS:-10000}                   # typing: rooms of 3, one member watcher each
DAMPING_GRACE_MS=${DAMPING_GRACE_MS:-1000}            # damping: the damped server's --offline-grace-ms
SOAK_SESSIONS=${SOAK_SESSIONS:-3000000}               # soak (not in the defaults: 30 min and more)
SOAK_DURATION=${SOAK_DURATION:-30m}
SOAK_STORM_SESSIONS=${SOAK_STORM_SESSIONS:-1000000}
OVERLOAD_PHASE=${OVERLOAD_PHASE:-20s}                 # overload (not in the defaults): quiet and shedding phases
SCENARIOS=${SCENARIOS:-load unary-defaults h2load pinned batches memory feed-flips expiry expiry-scale fanout fanout-million resume room-count room-counts notify-targets room-members typing damping room-memory}
RESULTS=${RESULTS:-target/compare/$(date -u +%Y%m%dT%H%M%SZ)}
REDIS_PORT=${REDIS_PORT:-$((20000 + RANDOM % 20000))}
METRICS_PORT=${METRICS_PORT:-$((40000 + RANDOM % 20000))}   # presenced --metrics-listen (h2load)

LOADGEN=target/release/presence-loadgen
# Another build of presenced (an earlier commit's, for a before/after comparison).
PRESENCED=${PRESENCED_BIN:-target/release/presenced}
# How the gateway authenticates: open (no credentials), service-token
# (--service-token), or credentials (--credentials: a file of hashed tokens with scopes).
BENCH_AUTH=${BENCH_AUTH:-open}
AUTH_SERVE=()
AUTH_DIAL=()
mkdir -p "$RESULTS"
WORK=$(mktemp -d /tmp/presence-compare.XXXXXX)
REDIS_PID=""
PRESENCED_PID=""

log() { printf '\n== %s\n' "$*"; }

stop_servers() {
    if [[ -n $PRESENCED_PID ]]; then
        kill "$PRESENCED_PID" 2>/dev/null || true
        wait "$PRESENCED_PID" 2>/dev/null || true
        PRESENCED_PID=""
    fi
    if [[ -n $REDIS_PID ]]; then
        redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || kill "$REDIS_PID" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$REDIS_PID" 2>/dev/null || break; sleep 0.1; done
        REDIS_PID=""
    fi
}
cleanup() {
    stop_servers
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# pinned: servers on CPU 0 (presenced with one connection thread and one worker thread),
# the generator on CPU 1 with one thread.
SERVER_PIN=()
LOADGEN_PIN=()
pin_one_core_each() {
    SERVER_PIN=(taskset -c 0)
    LOADGEN_PIN=(taskset -c 1)
    PRESENCED_EXTRA=(--connection-threads 1 --worker-threads 1)
}
unpin() {
    SERVER_PIN=()
    LOADGEN_PIN=()
    PRESENCED_EXTRA=()
}
PRESENCED_EXTRA=()

start_redis() {
    local dir="$WORK/redis"
    rm -rf "$dir" && mkdir -p "$dir"
    "${SERVER_PIN[@]}" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$dir" --save '' --appendonly no \
        --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" >/dev/null
    for _ in $(seq 100); do
        redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break
        sleep 0.05
    done
    REDIS_PID=$(cat "$dir/redis.pid")
    # The seed's five scripts, verbatim (the generator loads them too and checks the SHA1s).
    local f sha want
    for f in tools/loadgen/lua/*.lua; do
        sha=$(redis-cli -p "$REDIS_PORT" -x script load <"$f")
        want=$(sha1sum "$f" | cut -d' ' -f1)
        [[ $sha == "$want" ]] || { echo "SCRIPT LOAD $f answered $sha, expected $want" >&2; exit 1; }
    done
}

start_presenced() {
    local out="$WORK/presenced.out"
    "${SERVER_PIN[@]}" "$PRESENCED" serve --listen 127.0.0.1:0 --min-renew-interval-ms 0 "${PRESENCED_EXTRA[@]}" "${AUTH_SERVE[@]}" \
        >"$out" 2>"$WORK/presenced.err" &
    PRESENCED_PID=$!
    # Up to 30 s: a busy machine (a build beside the benchmark) can take a while to start it.
    for _ in $(seq 600); do
        grep -q '^listening on ' "$out" 2>/dev/null && break
        kill -0 "$PRESENCED_PID" 2>/dev/null || break
        sleep 0.05
    done
    PRESENCED_ADDR=$(sed -n 's/^listening on //p' "$out" | head -1)
    [[ -n $PRESENCED_ADDR ]] || { echo "presenced did not start:" >&2; cat "$WORK/presenced.err" >&2; exit 1; }
}

# make_tls_certs: a throwaway CA and a certificate for 127.0.0.1 in $WORK/tls (openssl).
make_tls_certs() {
    local dir="$WORK/tls"
    mkdir -p "$dir"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=compare-ca \
        -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" 2>/dev/null
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=127.0.0.1 \
        -keyout "$dir/server-key.pem" -out "$dir/server.csr" 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' >"$dir/ext.cnf"
    openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" -CAcreateserial -days 2 \
        -extfile "$dir/ext.cnf" -out "$dir/server.pem" 2>/dev/null
    TLS_SERVE=(--tls-cert "$dir/server.pem" --tls-key "$dir/server-key.pem")
    TLS_DIAL=(--tls --tls-ca "$dir/ca.pem")
}

# utime + stime of a process (all its threads), in clock ticks: fields 14 and 15 of
# /proc/PID/stat, counted after the command name, which may hold spaces.
server_cpu_ticks() {
    sed 's/^.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'
}

fresh_servers() {
    stop_servers
    start_redis
    start_presenced
}

# scrape FILE: presenced's /metrics (started with --metrics-listen 127.0.0.1:$METRICS_PORT) into FILE.
scrape() {
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' \
        "http://127.0.0.1:$METRICS_PORT/metrics" >"$1"
}

# run NAME TARGET SCENARIO ARGS...: one run, its report in $RESULTS/NAME.json.
run() {
    local name=$1 target=$2 scenario=$3
    shift 3
    local where pid
    if [[ $target == presenced ]]; then where=(--addr "$PRESENCED_ADDR" "${AUTH_DIAL[@]}"); pid=$PRESENCED_PID; else where=(--redis-url "redis://127.0.0.1:$REDIS_PORT"); pid=$REDIS_PID; fi
    # Server CPU per heartbeat, from /proc: a rate alone would hide a server that spends more cores on it.
    if [[ $scenario == load || $scenario == room-counts || $scenario == notify-targets || ($scenario == fanout && $target == presenced) ]]; then
        where+=(--server-pid "$pid")
    fi
    log "$name: $scenario --target $target $*"
    "${LOADGEN_PIN[@]}" "$LOADGEN" "$scenario" --target "$target" "${where[@]}" --report "$RESULTS/$name.json" "$@" \
        | tee "$RESULTS/$name.txt"
}

# ---- build and install ------------------------------------------------------------------
log "building release binaries"
cargo build --release -p presenced -p presence-loadgen
case $BENCH_AUTH in
    open) ;;
    service-token)
        AUTH_SERVE=(--service-token compare-service-token-0123456789)
        AUTH_DIAL=(--token compare-service-token-0123456789) ;;
    credentials)
        target/release/presenced token new compare-gateway --scope gateway,read >"$WORK/token.out"
        tail -n +2 "$WORK/token.out" >"$WORK/credentials.toml"
        AUTH_SERVE=(--credentials "$WORK/credentials.toml")
        AUTH_DIAL=(--token "$(head -1 "$WORK/token.out")") ;;
    *) echo "BENCH_AUTH: open, service-token or credentials, not $BENCH_AUTH" >&2; exit 2 ;;
esac

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    log "installing redis-server (Debian package)"
    if [[ $(id -u) -ne 0 ]]; then echo "redis-server is missing and this is not root: install it first" >&2; exit 1; fi
    apt-get update && apt-get install -y redis-server
fi
if [[ " $SCENARIOS " == *" h2load "* || " $SCENARIOS " == *" overload "* ]] && ! command -v h2load >/dev/null; then
    log "installing h2load (Debian package nghttp2-client)"
    if [[ $(id -u) -ne 0 ]]; then echo "h2load is missing and this is not root: install nghttp2-client first" >&2; exit 1; fi
    apt-get update && apt-get install -y nghttp2-client
fi
log "$(redis-server --version)"
echo "machine: $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB; the generator and both servers share them"
echo "results: $RESULTS"

for scenario in $SCENARIOS; do
    case $scenario in
    load)
        common=(--users "$LOAD_USERS" --sessions-per-user "$SESSIONS_PER_USER" --ttl-ms "$LOAD_TTL_MS"
            --duration "$LOAD_DURATION" --register-mode leases --connections "$CONNECTIONS")
        for t in presenced redis; do
            # Unary: one core's worth of server each. Redis is one thread; presenced gets one
            # connection thread (docs/guide.md, "--connection-threads"). The generator is one event
            # loop (--threads 1) for both, and has the other core.
            PRESENCED_EXTRA=(--connection-threads 1)
            fresh_servers
            run "load-unary-$t" "$t" load "${common[@]}" --mode unary --concurrency "$CONCURRENCY" --batch "$BATCH" \
                --threads 1
            PRESENCED_EXTRA=()
            fresh_servers
            run "load-batch-$t" "$t" load "${common[@]}" --mode leases --concurrency "$BATCH_CONCURRENCY" --batch "$BATCH"
        done
        ;;
    feed)
        # The change feed (F1, F2), durable (--data-dir): FEED_USERS leases end within
        # FEED_WINDOW_MS and one Changes consumer follows them, away for FEED_AWAY_MS from
        # the first deadline and back from its last cursor; a gateway renews other
        # sessions throughout (its p99 quiet and during the storm). Then a consumer reads
        # the whole feed from its oldest change (catching up, from the log on disk).
        # Beside it, the seed's Redis design the same way: the sweeper's pub/sub, its
        # subscriber away as long (what was published meanwhile is lost, and counted).
        PRESENCED_EXTRA=(--data-dir "$WORK/feed-data" --metrics-listen "127.0.0.1:$METRICS_PORT")
        rm -rf "$WORK/feed-data"
        fresh_servers
        storm=(--window-ms "$FEED_WINDOW_MS" --viewer-away-ms "$FEED_AWAY_MS" --gateway-sessions 10000
            --gateway-rate 1000 --quiet-ms 5000 --mode leases --batch "$BATCH" --concurrency "$BATCH_CONCURRENCY"
            --connections 2)
        run "feed-presenced" presenced expiry --users "$FEED_USERS" --viewer feed --catch-up "${storm[@]}" --timeout 60s
        scrape "$RESULTS/feed-metrics.txt"
        du -sb "$WORK/feed-data/feed" | tee "$RESULTS/feed-bytes.txt"
        PRESENCED_EXTRA=()
        run "feed-redis" redis expiry --users "$FEED_REDIS_USERS" "${storm[@]}" --timeout "$((FEED_REDIS_USERS / 250 + 60))s"
        ;;
    feed-cost)
        # Renewals write nothing to the feed: the load scenario's unary and batch
        # renewals with the feed on (in memory, the default) and off, alternating,
        # which goes first changing each round.
        common=(--users "$LOAD_USERS" --sessions-per-user "$SESSIONS_PER_USER" --ttl-ms "$LOAD_TTL_MS"
            --duration "$LOAD_DURATION" --register-mode leases --connections "$CONNECTIONS")
        for round in $(seq "$FEED_COST_ROUNDS"); do
            order=(on off)
            if (( round % 2 == 0 )); then order=(off on); fi
            for feed in "${order[@]}"; do
                if [[ $feed == off ]]; then off=(--feed-retention-bytes 0); else off=(); fi
                PRESENCED_EXTRA=(--connection-threads 1 "${off[@]}")
                fresh_servers
                run "feed-cost-unary-$feed-$round" presenced load "${common[@]}" --mode unary \
                    --concurrency "$CONCURRENCY" --batch "$BATCH" --threads 1
                PRESENCED_EXTRA=("${off[@]}")
                fresh_servers
                run "feed-cost-batch-$feed-$round" presenced load "${common[@]}" --mode leases \
                    --concurrency "$BATCH_CONCURRENCY" --batch "$BATCH"
            done
        done
        PRESENCED_EXTRA=()
        ;;
    unary-defaults)
        # Unary with everything at its default (presenced: a connection thread per core and
        # the shared runtime beside them), the generator running a thread per core: the
        # first load test a user runs. Both sides' threads compete for the same cores.
        common=(--users "$LOAD_USERS" --sessions-per-user "$SESSIONS_PER_USER" --ttl-ms "$LOAD_TTL_MS"
            --duration "$LOAD_DURATION" --register-mode leases --connections "$CONNECTIONS")
        for t in presenced redis; do
            fresh_servers
            run "load-unarydefaults-$t" "$t" load "${common[@]}" --mode unary --concurrency "$CONCURRENCY"
        done
        ;;
    h2load)
        # An outside witness of the unary figures: h2load (nghttp2), which knows nothing of
        # gRPC or of the generator, sends unary Renews with the unary-defaults layout
        # (CONCURRENCY in flight over CONNECTIONS connections: -c 4 -m 16) to presenced at
        # its defaults (plus --min-renew-interval-ms 0, as everywhere here, so that every
        # renewal writes, and --metrics-listen). h2load sends one request body (-d FILE),
        # so it renews one session: the hot-user case, one shard lock, not the fleet of
        # unary-defaults. The generator therefore drives that same one-session workload
        # too, so that the two clients can be compared on one workload.
        # h2load sees only HTTP statuses, and gRPC answers its errors with HTTP 200 (the
        # code is in the trailers): the gRPC outcomes come from presenced's
        # presenced_renewals_total{result} read before and after the run, the latency
        # percentiles from h2load's --log-file (it prints only min/max/mean/sd).
        # presenced only: h2load has no Redis counterpart.
        PRESENCED_EXTRA=(--metrics-listen "127.0.0.1:$METRICS_PORT")
        fresh_servers
        # Registers the session and writes its Renew as a gRPC frame; fails unless the
        # frame, sent once from the file, is answered OK.
        "$LOADGEN" h2load-prepare --addr "$PRESENCED_ADDR" --out "$WORK/renew.frame" --ttl-ms "$LOAD_TTL_MS" \
            --report "$RESULTS/h2load-prepare.json" | tee "$RESULTS/h2load-prepare.txt"
        scrape "$RESULTS/h2load-metrics-before.txt"
        h2cmd=(h2load -c "$CONNECTIONS" -m $((CONCURRENCY / CONNECTIONS)) -t "$H2LOAD_THREADS" -D "$LOAD_DURATION"
            -d "$WORK/renew.frame" -H 'content-type: application/grpc' -H 'te: trailers'
            --log-file "$WORK/h2load.log" "http://$PRESENCED_ADDR/presence.v1.Presence/Renew")
        h2line=$(printf '%q ' "${h2cmd[@]}")
        log "h2load-presenced: $h2line"
        cpu_before=$(server_cpu_ticks "$PRESENCED_PID")
        "${h2cmd[@]}" | tee "$RESULTS/h2load-presenced.out"
        cpu_after=$(server_cpu_ticks "$PRESENCED_PID")
        printf '{"ticks_before": %s, "ticks_after": %s, "clk_tck": %s}\n' "$cpu_before" "$cpu_after" "$(getconf CLK_TCK)" \
            >"$RESULTS/h2load-server-cpu.json"
        scrape "$RESULTS/h2load-metrics-after.txt"
        "$LOADGEN" h2load-report --addr "$PRESENCED_ADDR" --output "$RESULTS/h2load-presenced.out" --log "$WORK/h2load.log" \
            --metrics-before "$RESULTS/h2load-metrics-before.txt" --metrics-after "$RESULTS/h2load-metrics-after.txt" \
            --connections "$CONNECTIONS" --concurrency "$CONCURRENCY" --command "$h2line" \
            --report "$RESULTS/h2load-presenced.json" | tee "$RESULTS/h2load-presenced.txt"
        fresh_servers
        run "load-onesession-presenced" presenced load --users 1 --sessions-per-user 1 --ttl-ms "$LOAD_TTL_MS" \
            --duration "$LOAD_DURATION" --mode unary --concurrency "$CONCURRENCY" --connections "$CONNECTIONS"
        PRESENCED_EXTRA=()
        ;;
    pinned)
        # One core each, so that neither side's threads preempt the other's: the tail latency
        # then shows the servers, not the scheduler.
        common=(--users "$LOAD_USERS" --sessions-per-user "$SESSIONS_PER_USER" --ttl-ms "$LOAD_TTL_MS"
            --duration "$LOAD_DURATION" --register-mode leases --connections "$CONNECTIONS" --threads 1)
        pin_one_core_each
        for t in presenced redis; do
            fresh_servers
            run "load-pinned-$t" "$t" load "${common[@]}" --mode unary --concurrency "$CONCURRENCY"
        done
        unpin
        ;;
    batches)
        common=(--users "$LOAD_USERS" --sessions-per-user "$SESSIONS_PER_USER" --ttl-ms "$LOAD_TTL_MS"
            --duration "$LOAD_DURATION" --register-mode leases --connections 4 --mode leases)
        for pair in $BATCH_SWEEP; do
            for t in presenced redis; do
                fresh_servers
                run "load-batch${pair%%:*}-$t" "$t" load "${common[@]}" --batch "${pair%%:*}" --concurrency "${pair##*:}"
            done
        done
        ;;
    fanout-million)
        # presenced only: 1,000 viewers x 500 of 5,000 users, flips sent through a coalescing
        # LeaseChannel, viewers asking for a batch window (docs/guide.md, "batch_window_ms").
        # Then the same without a window: one event per change.
        for window in "$FANOUT_MILLION_WINDOW_MS" 0; do
            name=fanout-million-presenced
            [[ $window == 0 ]] && name=fanout-million-nowindow-presenced
            fresh_servers
            run "$name" presenced fanout --viewers 1000 --watch 500 --population 5000 \
                --churn-rate "$FANOUT_MILLION_CHURN" --churn-concurrency 256 --churn-mode coalesced \
                --batch-window-ms "$window" --duration "$FANOUT_DURATION" --stalled-viewer \
                --mode leases --batch 100 --concurrency 16 --connections 2
        done
        ;;
    room-memory)
        # Memory per room membership at 1M: presenced's store (the core's room_memory bench, a
        # whole process holding 1M online users, then 20,000 rooms x 50 members) against the
        # Redis design of seed 002 (one SET per room, SADD room user), resident growth of the
        # redis-server process for the same 1M memberships.
        log "room-memory: cargo bench -p presence-core --bench room_memory"
        cargo bench -q -p presence-core --bench room_memory 2>/dev/null | tee "$RESULTS/room-memory-presenced.txt"
        fresh_servers
        rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
        before=$(rss_kb "$REDIS_PID")
        python3 -c '
import sys
out = sys.stdout.buffer
for room in range(20000):
    for member in range(50):
        key, user = b"room:r%d" % room, b"u%d" % (room * 50 + member)
        out.write(b"*3\r\n$4\r\nSADD\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(key), key, len(user), user))
' | redis-cli -p "$REDIS_PORT" --pipe >/dev/null
        after=$(rss_kb "$REDIS_PID")
        python3 -c 'import json, sys; b, a = int(sys.argv[1]), int(sys.argv[2]); json.dump({"memberships": 1000000, "rss_growth_bytes": (a - b) * 1024, "bytes_per_membership": (a - b) * 1024 / 1e6}, open(sys.argv[3], "w"))' \
            "$before" "$after" "$RESULTS/room-memory-redis.json"
        log "room-memory redis: $(cat "$RESULTS/room-memory-redis.json")"
        ;;
    resume)
        # presenced only (the Redis design has no resume): 1,000 viewers x 500 of 5,000 users
        # reopen their Watch at once after nothing changed, without and with known_versions (E8).
        fresh_servers
        run resume-presenced presenced resume --viewers 1000 --watch 500 --population 5000
        ;;
    room-count)
        # presenced only (the Redis design has no rooms): one room of ROOM_COUNT_MEMBERS,
        # 1,000 count-mode watchers (one frame a second at most), ROOM_COUNT_CHURN joins +
        # leaves/s by 10,000 other sessions, and a gateway renewing 10,000 more at 2,000/s,
        # quiet for 5 s and then through the churn (R3).
        fresh_servers
        run room-count-presenced presenced room-count --members "$ROOM_COUNT_MEMBERS" --watchers 1000 \
            --churn-rate "$ROOM_COUNT_CHURN" --duration "$ROOMS_DURATION"
        ;;
    room-counts)
        # presenced only: 100 WatchRoomCounts streams of 10,000 rooms each (one message a
        # second at most), 5,000 joins + leaves/s spread over 5,000 of the rooms, then batched
        # RoomCounts reads of 1,000 rooms, 8 in flight; a gateway renewing 10,000 sessions at
        # 2,000/s quiet, through the churn and through the reads (R7).
        fresh_servers
        run room-counts-presenced presenced room-counts --rooms 10000 --streams 100 \
            --churn-rate "$ROOM_COUNT_CHURN" --duration "$ROOMS_DURATION"
        ;;
    notify-targets)
        # presenced only: 100,000 users whose sessions said their attention (a quarter
        # active on a desktop, the rest in the background on a phone), NotifyTargets of
        # 1,000 users, 4 in flight, for ROOMS_DURATION; a gateway renewing 10,000 sessions
        # at 2,000/s quiet and through the calls (A3, A4; the heartbeat first).
        fresh_servers
        run notify-targets-presenced presenced notify-targets --users 100000 --duration "$ROOMS_DURATION"
        ;;
    room-members)
        # presenced only: ROOM_MEMBERS_ROOMS rooms x 50 members (distinct users), 5
        # member-mode watchers per room, 100 streams per HTTP/2 connection, members updating
        # their metadata (stamped with the send time) at ROOM_MEMBERS_CHURN/s.
        fresh_servers
        run room-members-presenced presenced room-members --rooms "$ROOM_MEMBERS_ROOMS" --members 50 \
            --watchers-per-room "$ROOM_MEMBERS_WATCHERS_PER_ROOM" --churn-rate "$ROOM_MEMBERS_CHURN" \
            --duration "$ROOMS_DURATION"
        ;;
    typing)
        # presenced only: TYPING_ROOMS rooms x 3 members, every member signalling `typing`
        # (ttl 5 s) every 3 s through Leases signal items, every third a clear; one member
        # watcher per room (S3).
        fresh_servers
        run typing-presenced presenced typing --rooms "$TYPING_ROOMS" --members 3 --duration "$ROOMS_DURATION"
        ;;
    damping)
        # presenced only (E6): 10,000 watched users flapping (unregister, register 200 ms
        # later) at 500/s, once against a server as it is and once against one started with
        # --offline-grace-ms DAMPING_GRACE_MS; presenced_suppressed_flaps read from its metrics.
        for grace in 0 "$DAMPING_GRACE_MS"; do
            PRESENCED_EXTRA=(--metrics-listen "127.0.0.1:$METRICS_PORT")
            name=damping-off-presenced
            if [[ $grace != 0 ]]; then PRESENCED_EXTRA+=(--offline-grace-ms "$grace"); name=damping-on-presenced; fi
            fresh_servers
            run "$name" presenced damping --population 10000 --viewers 10 --flap-rate 500 --gap-ms 200 \
                --duration "$ROOMS_DURATION" --grace-ms "$grace" --metrics-addr "127.0.0.1:$METRICS_PORT"
        done
        PRESENCED_EXTRA=()
        ;;
    memory)
        first=${MEMORY_SESSIONS%% *}
        for n in $MEMORY_SESSIONS; do
            fresh_servers
            run "memory-$n-presenced" presenced memory --sessions "$n" --sessions-per-user "$SESSIONS_PER_USER" \
                --pid "$PRESENCED_PID" --mode leases --batch 500 --concurrency "$BATCH_CONCURRENCY" --connections 2
            # The same with the change feed off: what the defaults' feed costs.
            PRESENCED_EXTRA=(--feed-retention-bytes 0)
            fresh_servers
            run "memory-$n-presenced-feedoff" presenced memory --sessions "$n" --sessions-per-user "$SESSIONS_PER_USER" \
                --pid "$PRESENCED_PID" --mode leases --batch 500 --concurrency "$BATCH_CONCURRENCY" --connections 2
            PRESENCED_EXTRA=()
            if [[ $n == "$first" ]]; then
                run "memory-$n-redis" redis memory --sessions "$n" --sessions-per-user "$SESSIONS_PER_USER" \
                    --pid "$REDIS_PID" --mode leases --batch 500 --concurrency "$BATCH_CONCURRENCY"
            fi
        done
        ;;
    feed-flips)
        # Every register of a user's one session flips it ONLINE, and every flip is
        # a change feed entry: registers in Leases batches with the feed on (in
        # memory, the default) and off, alternating (which goes first changing each
        # round), then Redis's run of the same; each run's heartbeat phase gives the
        # renewal p99 beside it.
        common=(--users "$FEED_FLIPS_USERS" --sessions-per-user 1 --ttl-ms "$LOAD_TTL_MS" --duration 5s
            --register-mode leases --connections 4 --mode leases --concurrency "$BATCH_CONCURRENCY")
        for b in $FEED_FLIPS_BATCHES; do
            for round in $(seq "$FEED_FLIPS_ROUNDS"); do
                order=(on off)
                if (( round % 2 == 0 )); then order=(off on); fi
                for feed in "${order[@]}"; do
                    if [[ $feed == off ]]; then PRESENCED_EXTRA=(--feed-retention-bytes 0); else PRESENCED_EXTRA=(); fi
                    fresh_servers
                    run "feed-flips-$b-$feed-$round" presenced load "${common[@]}" --batch "$b"
                done
            done
            PRESENCED_EXTRA=()
            fresh_servers
            run "feed-flips-$b-redis" redis load "${common[@]}" --batch "$b"
        done
        ;;
    expiry)
        fresh_servers
        for t in presenced redis; do
            run "expiry-$t" "$t" expiry --users "$EXPIRY_USERS" --mode leases --batch "$BATCH" \
                --concurrency "$BATCH_CONCURRENCY" --connections 2
        done
        ;;
    expiry-scale)
        # The issue's target: EXPIRY_SCALE_USERS (1M) leases ending within
        # EXPIRY_SCALE_WINDOW_MS (10 s), all watched (Watch streams of 10,000 users, the
        # server's limit per request), while a gateway renews other sessions with unary
        # Renews at a steady EXPIRY_SCALE_GATEWAY_RATE: its p99 in a quiet phase before the
        # window and during it, and their ratio, are in the report's scenario.gateway.
        # Redis is not run at this size: its sweeper drains 500 users per 2 s, so 1M users
        # would take 4,000 s (the expiry scenario compares the two at EXPIRY_USERS). Set
        # EXPIRY_SCALE_REDIS_USERS (e.g. 50000, about N/250 s) to run Redis at that size
        # with the same window and gateway; the table then shows both sizes.
        # presenced's own presenced_expiry_lag_seconds (deadline to publication) is scraped
        # after the run: it tells a late server from a late viewer (the generator shares the
        # machine, and decodes 100,000 OFFLINE events a second).
        PRESENCED_EXTRA=(--metrics-listen "127.0.0.1:$METRICS_PORT")
        fresh_servers
        scale=(--window-ms "$EXPIRY_SCALE_WINDOW_MS" --gateway-sessions "$EXPIRY_SCALE_GATEWAY_SESSIONS"
            --gateway-rate "$EXPIRY_SCALE_GATEWAY_RATE" --quiet-ms 5000
            --mode leases --batch "$BATCH" --concurrency "$BATCH_CONCURRENCY" --connections 2)
        # Missing events are waited for a minute past the last deadline, not the default ten.
        run "expiry-scale-presenced" presenced expiry --users "$EXPIRY_SCALE_USERS" "${scale[@]}" --timeout 60s
        scrape "$RESULTS/expiry-scale-metrics.txt"
        PRESENCED_EXTRA=()
        if [[ $EXPIRY_SCALE_REDIS_USERS -gt 0 ]]; then
            run "expiry-scale-redis" redis expiry --users "$EXPIRY_SCALE_REDIS_USERS" "${scale[@]}" \
                --timeout "$((EXPIRY_SCALE_REDIS_USERS / 250 + 60))s"
        fi
        ;;
    fanout)
        # The gateway renews one session per call, so that its p99 rests on thousands of samples.
        for t in presenced redis; do
            fresh_servers
            run "fanout-$t" "$t" fanout --viewers "$FANOUT_VIEWERS" --watch "$FANOUT_WATCH" \
                --population "$FANOUT_POPULATION" --churn-rate "$FANOUT_CHURN" --duration "$FANOUT_DURATION" \
                --stalled-viewer --mode unary --concurrency 16 --connections 2
        done
        ;;
    tls)
        # presenced only: TLS beside plaintext, each workload run against a plaintext server
        # and a TLS one (rustls; the same certificate for all), alternating TLS_ROUNDS times
        # so that drift on a shared machine falls on both. Unary Renew as in `load` (one
        # connection thread, the generator one event loop), Leases batches of 100 (8 in
        # flight as in `load`, and 32), and the fan-out of `fanout-million` without a window. Then a storm of TLS_STORM_CLIENTS clients connecting with full
        # handshakes and again resuming their sessions, and the server's memory per idle
        # connection, plaintext and TLS.
        make_tls_certs
        common=(--users "$LOAD_USERS" --sessions-per-user "$SESSIONS_PER_USER" --ttl-ms "$LOAD_TTL_MS"
            --duration "$LOAD_DURATION" --register-mode leases --connections "$CONNECTIONS")
        for round in $(seq "$TLS_ROUNDS"); do
            for kind in plain tls; do
                serve=() dial=()
                if [[ $kind == tls ]]; then serve=("${TLS_SERVE[@]}") dial=("${TLS_DIAL[@]}"); fi
                stop_servers
                PRESENCED_EXTRA=(--connection-threads 1 "${serve[@]}")
                start_presenced
                run "tls-unary-$kind-$round" presenced load "${common[@]}" "${dial[@]}" --mode unary \
                    --concurrency "$CONCURRENCY" --batch "$BATCH" --threads 1
                stop_servers
                PRESENCED_EXTRA=("${serve[@]}")
                start_presenced
                run "tls-batch100-$kind-$round" presenced load "${common[@]}" "${dial[@]}" --mode leases \
                    --concurrency "$BATCH_CONCURRENCY" --batch 100
                # The same with enough batches in flight that the server, not a round trip, sets the pace.
                stop_servers
                start_presenced
                run "tls-batch100sat-$kind-$round" presenced load "${common[@]}" "${dial[@]}" --mode leases \
                    --concurrency "$TLS_SATURATED_BATCHES" --batch 100
                stop_servers
                start_presenced
                # Fan-out at the rate the server can deliver: fanout-million's shape without a
                # batch window (one event per change), 1,000 viewers x 500 of 5,000 users.
                stop_servers
                start_presenced
                run "tls-fanout-$kind-$round" presenced fanout "${dial[@]}" --viewers 1000 --watch 500 \
                    --population 5000 --churn-rate "$FANOUT_MILLION_CHURN" --churn-concurrency 256 \
                    --churn-mode coalesced --batch-window-ms 0 --duration "$FANOUT_DURATION" \
                    --mode leases --batch 100 --concurrency 16 --connections 2
            done
        done
        # The same storm in plaintext first: what a connection and its first call cost without TLS.
        stop_servers
        PRESENCED_EXTRA=()
        start_presenced
        run tls-handshakes-plain presenced tls-handshakes --clients "$TLS_STORM_CLIENTS" \
            --concurrency 256 --server-pid "$PRESENCED_PID"
        stop_servers
        PRESENCED_EXTRA=("${TLS_SERVE[@]}")
        start_presenced
        run tls-handshakes presenced tls-handshakes "${TLS_DIAL[@]}" --clients "$TLS_STORM_CLIENTS" \
            --concurrency 256 --server-pid "$PRESENCED_PID"
        for kind in plain tls; do
            serve=() dial=()
            if [[ $kind == tls ]]; then serve=("${TLS_SERVE[@]}") dial=("${TLS_DIAL[@]}"); fi
            stop_servers
            PRESENCED_EXTRA=("${serve[@]}")
            start_presenced
            run "tls-idle-$kind" presenced idle-connections "${dial[@]}" --connections "$TLS_IDLE_CONNECTIONS" \
                --server-pid "$PRESENCED_PID"
        done
        stop_servers
        PRESENCED_EXTRA=()
        ;;
    soak)
        # presenced only, and long (SOAK_DURATION, then a reconnect storm of
        # SOAK_STORM_SESSIONS): SOAK_SESSIONS renewing every 15 s +- 3 s, 1,000 expiring
        # users a minute, 10,000 users watched; errors, false OFFLINE, resident memory,
        # expiry lag and CPU per minute (docs/reliability.md, "Soak").
        PRESENCED_EXTRA=(--metrics-listen "127.0.0.1:$METRICS_PORT")
        fresh_servers
        run soak-presenced presenced soak --sessions "$SOAK_SESSIONS" --duration "$SOAK_DURATION" \
            --storm-sessions "$SOAK_STORM_SESSIONS" --server-pid "$PRESENCED_PID" \
            --metrics-addr "127.0.0.1:$METRICS_PORT"
        PRESENCED_EXTRA=()
        ;;
    overload)
        # presenced only: renewals at twice the capacity a short ramp finds (sent by
        # h2load), beside registers, unregisters and revokes, unary and in Leases batches;
        # none of those may be lost (docs/reliability.md, "Overload at twice capacity").
        PRESENCED_EXTRA=(--metrics-listen "127.0.0.1:$METRICS_PORT")
        fresh_servers
        run overload-presenced presenced overload --phase "$OVERLOAD_PHASE" --server-pid "$PRESENCED_PID" \
            --metrics-addr "127.0.0.1:$METRICS_PORT"
        PRESENCED_EXTRA=()
        ;;
    *) echo "unknown scenario $scenario (feed, feed-cost, feed-flips, load, unary-defaults, h2load, pinned, batches, memory, expiry, expiry-scale, fanout, fanout-million, resume, room-count, room-counts, notify-targets, room-members, typing, damping, room-memory; not by default: soak, overload, tls)" >&2; exit 2 ;;
    esac
done
stop_servers

log "side by side (ratio = presenced / redis: xN = presenced N times larger, 1/N = N times smaller; larger is better for rates, smaller for latencies and sizes)"
python3 - "$RESULTS" <<'PY'
import json, os, re, sys
d = sys.argv[1]
def rep(name):
    p = os.path.join(d, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
def ms(ns): return None if ns is None else ns / 1e6
rows = []
def row(label, unit, p, r, fmt="{:,.0f}"):
    if p is None and r is None: return
    f = lambda v: "-" if v is None else fmt.format(v)
    if not p or not r:
        ratio = "-"
    elif p >= r:
        ratio = "x{:.2f}".format(p / r)
    else:
        ratio = "1/{:.2f}".format(r / p)
    rows.append((label, unit, f(p), f(r), ratio))
def g(rp, *path):
    v = rp
    for k in path:
        if v is None: return None
        v = v.get(k) if isinstance(v, dict) else None
    return v
def pct(rp, p):
    for e in (rp or {}).get("latencyDistribution") or []:
        if e["percentage"] == p: return e["latency"]
    return None
def load_rows(name, label, errors=False):
    p, r = rep(f"load-{name}-presenced"), rep(f"load-{name}-redis")
    if not (p or r): return
    row(label, "renewals/s", g(p, "rps"), g(r, "rps"))
    row(label, "p50 ms", ms(pct(p, 50)), ms(pct(r, 50)), "{:.3f}")
    row(label, "p99 ms", ms(pct(p, 99)), ms(pct(r, 99)), "{:.3f}")
    row(label, "server CPU us/renewal", g(p, "scenario", "server_cpu_us_per_heartbeat"), g(r, "scenario", "server_cpu_us_per_heartbeat"), "{:.2f}")
    if errors:
        failed = lambda rp: sum(v for k, v in (g(rp, "statusCodeDistribution") or {}).items() if k != "OK")
        row(label, "errors", failed(p), failed(r))
load_rows("unary", "heartbeat, one call per op, one server thread", errors=True)
load_rows("batch", "heartbeat, batches/pipeline", errors=True)
load_rows("unarydefaults", "heartbeat, one call per op, all defaults")
h, o = rep("h2load-presenced"), rep("load-onesession-presenced")
if h or o:
    # One session renewed over and over (h2load sends one request body): compare these
    # two with each other, and with the row above only as the hot-user case.
    label = "h2load (outside client): one session, all defaults"
    row(label, "renewals/s", g(h, "scenario", "h2load_req_per_s"), None)
    row(label, "p50 ms", ms(pct(h, 50)), None, "{:.3f}")
    row(label, "p99 ms", ms(pct(h, 99)), None, "{:.3f}")
    row(label, "gRPC errors (server metrics)", g(h, "scenario", "grpc", "errors"), None)
    cpu = rep("h2load-server-cpu")
    if h and cpu and g(h, "scenario", "grpc", "ok"):
        ns = (cpu["ticks_after"] - cpu["ticks_before"]) * 1e9 / cpu["clk_tck"]
        row(label, "server CPU us/renewal", ns / 1e3 / g(h, "scenario", "grpc", "ok"), None, "{:.2f}")
    label = "presence-loadgen: the same one session"
    row(label, "renewals/s", g(o, "rps"), None)
    row(label, "p50 ms", ms(pct(o, 50)), None, "{:.3f}")
    row(label, "p99 ms", ms(pct(o, 99)), None, "{:.3f}")
    row(label, "errors", sum(v for k, v in (g(o, "statusCodeDistribution") or {}).items() if k != "OK") if o else None, None)
    row(label, "server CPU us/renewal", g(o, "scenario", "server_cpu_us_per_heartbeat"), None, "{:.2f}")
load_rows("pinned", "heartbeat, one call per op, one core each (pinned)")
p, r = rep("load-batch-presenced"), rep("load-batch-redis")
row("register (batches/pipeline)", "registers/s", g(p, "scenario", "registers_per_s"), g(r, "scenario", "registers_per_s"))
swept = sorted(int(f[len("load-batch"):-len("-presenced.json")]) for f in os.listdir(d)
               if f.startswith("load-batch") and f.endswith("-presenced.json") and f[len("load-batch")].isdigit())
for b in swept:
    p, r = rep(f"load-batch{b}-presenced"), rep(f"load-batch{b}-redis")
    row(f"heartbeat, batches/pipeline of {b:,}", "renewals/s", g(p, "rps"), g(r, "rps"))
    row(f"heartbeat, batches/pipeline of {b:,}", "p99 ms", ms(pct(p, 99)), ms(pct(r, 99)), "{:.3f}")
    row(f"register, batches/pipeline of {b:,}", "registers/s", g(p, "scenario", "registers_per_s"), g(r, "scenario", "registers_per_s"))
if swept:
    best = lambda t: max((g(rep(f"load-batch{b}-{t}"), "rps") or 0) for b in swept)
    row("heartbeat, batches/pipeline, best of each", "renewals/s", best("presenced"), best("redis"))
sizes = sorted(int(f[len("memory-"):-len("-presenced.json")]) for f in os.listdir(d)
               if f.startswith("memory-") and f.endswith("-presenced.json"))
for n in sizes:
    p, r = rep(f"memory-{n}-presenced"), rep(f"memory-{n}-redis")
    row(f"memory, {int(n):,} sessions", "RSS B/session", g(p, "scenario", "bytes_per_session"), g(r, "scenario", "bytes_per_session"))
    off = rep(f"memory-{n}-presenced-feedoff")
    row(f"memory, {int(n):,} sessions, feed off", "RSS B/session", g(off, "scenario", "bytes_per_session"), g(r, "scenario", "bytes_per_session"))
    if r:
        row(f"memory, {int(n):,} sessions", "redis used_memory B/session", None, g(r, "scenario", "used_memory_per_session"))
        row(f"memory, {int(n):,} sessions", "  without presence:due", None, g(r, "scenario", "used_memory_per_session_without_due_set"))
p, r = rep("expiry-presenced"), rep("expiry-redis")
for q in ("p50", "p90", "p99", "max"):
    row("expiry: deadline -> OFFLINE", f"lag {q} ms", ms(g(p, "scenario", "lag_ns", q)), ms(g(r, "scenario", "lag_ns", q)), "{:.1f}")
row("expiry: all drained after last deadline", "ms", ms(g(p, "scenario", "drain_after_last_deadline_ns")), ms(g(r, "scenario", "drain_after_last_deadline_ns")), "{:.1f}")
row("expiry: missing events", "count", g(p, "scenario", "missing"), g(r, "scenario", "missing"))
p, r = rep("expiry-scale-presenced"), rep("expiry-scale-redis")
if p or r:
    label = "expiry-scale"
    row(label, "users (leases ending in the window)", g(p, "scenario", "users"), g(r, "scenario", "users"))
    row(label, "window ms", g(p, "scenario", "window_ms"), g(r, "scenario", "window_ms"))
    for q in ("p50", "p99", "max"):
        row(label + ": deadline -> OFFLINE", f"lag {q} ms", ms(g(p, "scenario", "lag_ns", q)), ms(g(r, "scenario", "lag_ns", q)), "{:.1f}")
    row(label + ": all drained after last deadline", "ms", ms(g(p, "scenario", "drain_after_last_deadline_ns")), ms(g(r, "scenario", "drain_after_last_deadline_ns")), "{:.1f}")
    row(label + ": missing events", "count", g(p, "scenario", "missing"), g(r, "scenario", "missing"))
    # The server's side of the lag: presenced_expiry_lag_seconds, deadline to publication.
    mp = os.path.join(d, "expiry-scale-metrics.txt")
    if os.path.exists(mp):
        m = {}
        for ln in open(mp):
            if not ln.startswith("#") and " " in ln:
                k, v = ln.rsplit(" ", 1)
                m[k] = float(v)
        total = m.get("presenced_expiry_lag_seconds_count")
        for le in ("0.001", "0.01"):
            within = m.get(f'presenced_expiry_lag_seconds_bucket{{le="{le}"}}')
            if total and within is not None:
                row(label + f": server published within {float(le) * 1000:g} ms", "% of OFFLINEs (presenced metric)", 100 * within / total, None, "{:.2f}")
    row(label + ": gateway renew p99, quiet", "ms", ms(g(p, "scenario", "gateway", "quiet", "p99_ns")), ms(g(r, "scenario", "gateway", "quiet", "p99_ns")), "{:.3f}")
    row(label + ": gateway renew p99, during expiry", "ms", ms(g(p, "scenario", "gateway", "during_expiry", "p99_ns")), ms(g(r, "scenario", "gateway", "during_expiry", "p99_ns")), "{:.3f}")
    row(label + ": gateway renew p99, during / quiet", "ratio (target <= 2)", g(p, "scenario", "gateway", "p99_during_over_quiet"), g(r, "scenario", "gateway", "p99_during_over_quiet"), "{:.2f}")
p, r = rep("fanout-presenced"), rep("fanout-redis")
row("fanout: changes delivered", "events/s", g(p, "scenario", "phase_plain", "events_per_s"), g(r, "scenario", "phase_plain", "events_per_s"))
row("fanout: flip -> viewer p99", "ms", ms(g(p, "scenario", "phase_plain", "delivery_p99_ns")), ms(g(r, "scenario", "phase_plain", "delivery_p99_ns")), "{:.2f}")
row("fanout: gateway renew p99", "ms", ms(g(p, "scenario", "phase_plain", "gateway_renew", "p99_ns")), ms(g(r, "scenario", "phase_plain", "gateway_renew", "p99_ns")), "{:.3f}")
row("fanout + stalled viewer: gateway p99", "ms", ms(g(p, "scenario", "phase_stalled", "gateway_renew", "p99_ns")), ms(g(r, "scenario", "phase_stalled", "gateway_renew", "p99_ns")), "{:.3f}")
row("fanout + stalled viewer: events/s", "events/s", g(p, "scenario", "phase_stalled", "events_per_s"), g(r, "scenario", "phase_stalled", "events_per_s"))
for name, label in (("fanout-million-presenced", "fanout 1000 x 500 of 5,000, batch window"),
                    ("fanout-million-nowindow-presenced", "fanout 1000 x 500 of 5,000, no window")):
    p = rep(name)
    if not p: continue
    row(label, "events/s", g(p, "scenario", "phase_plain", "events_per_s"), None)
    row(label, "flips/s", g(p, "scenario", "phase_plain", "flips_per_s"), None)
    row(label, "flip -> viewer p99 ms", ms(g(p, "scenario", "phase_plain", "delivery_p99_ns")), None, "{:.1f}")
    row(label, "gateway renew p99 ms", ms(g(p, "scenario", "phase_plain", "gateway_renew", "p99_ns")), None, "{:.3f}")
    row(label + " + stalled viewer", "gateway renew p99 ms", ms(g(p, "scenario", "phase_stalled", "gateway_renew", "p99_ns")), None, "{:.3f}")
    row(label + " + stalled viewer", "events/s", g(p, "scenario", "phase_stalled", "events_per_s"), None)
text = os.path.join(d, "room-memory-presenced.txt")
if os.path.exists(text):
    m = re.search(r"([0-9.]+) bytes per membership", open(text).read())
    r = rep("room-memory-redis")
    row("room memberships, 1M in 20,000 rooms of 50", "bytes/membership (target <= 64)", float(m.group(1)) if m else None, g(r, "bytes_per_membership"), "{:.1f}")
p = rep("resume-presenced")
if p:
    for storm, label in (("storm_whole", "reconnect storm 1000 x 500, whole snapshots"),
                         ("storm_resumed", "reconnect storm 1000 x 500, known_versions")):
        row(label, "snapshot bytes", g(p, "scenario", storm, "response_bytes"), None)
        row(label, "request bytes", g(p, "scenario", storm, "request_bytes"), None)
        row(label, "all reopened, ms", g(p, "scenario", storm, "elapsed_ms"), None, "{:.1f}")
    row("reconnect storm: snapshot bytes, whole / resumed", "ratio (target >= 20)", g(p, "scenario", "response_bytes_ratio"), None, "{:.1f}")
p = rep("room-count-presenced")
if p:
    label = "room-count: 1 room of {:,}, {:,} count watchers".format(g(p, "scenario", "members") or 0, g(p, "scenario", "watchers_open") or 0)
    row(label, "joins + leaves/s achieved", g(p, "scenario", "churn", "per_s"), None)
    row(label, "frames/watcher/interval, mean", g(p, "scenario", "frames", "per_watcher_per_interval_mean"), None, "{:.3f}")
    row(label, "frames/watcher/interval, max (rule <= 1)", g(p, "scenario", "frames", "per_watcher_per_interval_max"), None, "{:.3f}")
    row(label, "most frames within one interval", g(p, "scenario", "frames", "most_within_one_interval"), None)
    row(label, "shortest gap between frames ms", g(p, "scenario", "frames", "min_gap_ms"), None, "{:.1f}")
    row(label, "gateway renew p99 ms, quiet", ms(g(p, "scenario", "gateway", "quiet", "p99_ns")), None, "{:.3f}")
    row(label, "gateway renew p99 ms, during churn", ms(g(p, "scenario", "gateway", "during_churn", "p99_ns")), None, "{:.3f}")
    row(label, "gateway p99 during / quiet (target <= 2)", g(p, "scenario", "gateway", "p99_during_over_quiet"), None, "{:.2f}")
p = rep("room-members-presenced")
if p:
    label = "room-members: {:,} rooms x {}, {:,} member watchers".format(g(p, "scenario", "rooms") or 0, g(p, "scenario", "members_per_room") or 0, g(p, "scenario", "watchers_open") or 0)
    row(label, "metadata updates/s achieved", g(p, "scenario", "updates", "per_s"), None)
    row(label, "room changes delivered/s", g(p, "scenario", "events_per_s"), None)
    row(label, "change -> watcher p50 ms", ms(g(p, "scenario", "delivery_p50_ns")), None, "{:.2f}")
    row(label, "change -> watcher p99 ms", ms(g(p, "scenario", "delivery_p99_ns")), None, "{:.2f}")
    row(label, "resyncs", g(p, "scenario", "resyncs"), None)
p = rep("typing-presenced")
if p:
    label = "typing: {:,} rooms x {}, 1 watcher each".format(g(p, "scenario", "rooms") or 0, g(p, "scenario", "members_per_room") or 0)
    row(label, "signals accepted/s", g(p, "scenario", "signals", "accepted_per_s"), None)
    row(label, "signals refused", g(p, "scenario", "signals", "refused"), None)
    row(label, "SignalSet deliveries/s", g(p, "scenario", "signal_sets_per_s"), None)
for name, label in (("damping-off-presenced", "damping: flaps (200 ms gaps), no grace"),
                    ("damping-on-presenced", "damping: flaps (200 ms gaps), --offline-grace-ms {}")):
    p = rep(name)
    if not p: continue
    label = label.format(g(p, "scenario", "grace_ms"))
    row(label, "flaps", g(p, "scenario", "flaps"), None)
    row(label, "OFFLINE events to viewers", g(p, "scenario", "offline_events"), None)
    row(label, "OFFLINE events per flap", g(p, "scenario", "offline_events_per_flap"), None, "{:.2f}")
    row(label, "presenced_suppressed_flaps (moved)", g(p, "scenario", "suppressed_flaps"), None)
w = [max(len(x[i]) for x in rows + [("scenario", "unit", "presenced", "redis", "ratio")]) for i in range(5)]
line = lambda x: "  ".join(s.ljust(w[i]) if i < 2 else s.rjust(w[i]) for i, s in enumerate(x))
out = [line(("scenario", "unit", "presenced", "redis", "ratio")), line(tuple("-" * n for n in w))] + [line(x) for x in rows]
text = "\n".join(out)
print(text)
open(os.path.join(d, "table.txt"), "w").write(text + "\n")

# What recording flips in the change feed costs (SCENARIOS=feed-flips): the median of
# each size's runs, feed on against off, beside Redis, with each's renewal p99.
import statistics
runs = {}
for f in os.listdir(d):
    m = re.fullmatch(r"feed-flips-(\d+)-(on|off)-(\d+)\.json", f)
    if m:
        runs.setdefault(int(m[1]), {}).setdefault(m[2], []).append(json.load(open(os.path.join(d, f))))
for b in sorted(runs):
    med = lambda feed, *path: statistics.median([g(x, *path) or 0 for x in runs[b].get(feed, [])] or [0])
    on, off = med("on", "scenario", "registers_per_s"), med("off", "scenario", "registers_per_s")
    p99 = lambda feed: statistics.median([pct(x, 99) or 0 for x in runs[b].get(feed, [])] or [0]) / 1e6
    r = rep(f"feed-flips-{b}-redis")
    print(f"feed-flips, batches of {b:,}: registers/s feed on {on:,.0f}, off {off:,.0f} "
          f"(the feed costs {100 * (1 - on / off) if off else 0:.1f} %; runs on {[round(g(x, 'scenario', 'registers_per_s') or 0) for x in runs[b].get('on', [])]}, "
          f"off {[round(g(x, 'scenario', 'registers_per_s') or 0) for x in runs[b].get('off', [])]}); "
          f"redis {g(r, 'scenario', 'registers_per_s') or 0:,.0f} (on x{on / (g(r, 'scenario', 'registers_per_s') or 1):.1f}, off x{off / (g(r, 'scenario', 'registers_per_s') or 1):.1f}); "
          f"renewal p99 ms on {p99('on'):.3f}, off {p99('off'):.3f}")
PY
echo
echo "The generator and both servers shared $(nproc) cores: absolute figures understate both; compare ratios."
echo "Reports (ghz JSON fields + a 'scenario' object) and console output: $RESULTS"

# TLS beside plaintext (SCENARIOS=tls): each round's ratio, and the handshake and memory figures.
python3 - "$RESULTS" <<'PY'
import json, os, sys
d = sys.argv[1]
def rep(name):
    p = os.path.join(d, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
def g(rp, *path):
    v = rp
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v
rows, ratios = [], {}
for workload, label, path in (("unary", "unary Renew", ("scenario", "heartbeats_per_s")),
                              ("batch100", "Leases batches of 100, 8 in flight", ("scenario", "heartbeats_per_s")),
                              ("batch100sat", "Leases batches of 100, 32 in flight", ("scenario", "heartbeats_per_s")),
                              ("fanout", "fan-out events/s", ("scenario", "phase_plain", "events_per_s"))):
    r = 1
    while rep(f"tls-{workload}-plain-{r}") or rep(f"tls-{workload}-tls-{r}"):
        plain, tls = g(rep(f"tls-{workload}-plain-{r}"), *path), g(rep(f"tls-{workload}-tls-{r}"), *path)
        ratio = "{:.1%}".format(tls / plain) if plain and tls else "-"
        cpu = lambda kind: g(rep(f"tls-{workload}-{kind}-{r}"), "scenario", "server_cpu_us_per_heartbeat")
        cpu_ratio = "{:.1%}".format(cpu("plain") / cpu("tls")) if cpu("plain") and cpu("tls") else "-"
        rows.append((f"{label}, round {r}", "{:,.0f}".format(plain or 0), "{:,.0f}".format(tls or 0), ratio, cpu_ratio))
        if plain and tls:
            ratios.setdefault(label, []).append(tls / plain)
        r += 1
if not rows:
    sys.exit(0)
print("\nTLS beside plaintext (presenced only; per second)")
head = ("workload", "plaintext", "TLS", "TLS / plaintext", "server CPU per op, plaintext / TLS")
w = [max(len(x[i]) for x in rows + [head]) for i in range(5)]
line = lambda x: "  ".join(s.ljust(w[i]) if i == 0 else s.rjust(w[i]) for i, s in enumerate(x))
out = [line(head)] + [line(x) for x in rows]
for label, each in ratios.items():
    each = sorted(each)
    median = each[len(each) // 2] if len(each) % 2 else (each[len(each) // 2 - 1] + each[len(each) // 2]) / 2
    out.append("{}: TLS / plaintext, median of {} rounds {:.1%} (lowest {:.1%}, highest {:.1%})".format(
        label, len(each), median, each[0], each[-1]))
h, plain = rep("tls-handshakes"), g(rep("tls-handshakes-plain"), "scenario", "plaintext")
base = (plain or {}).get("server_cpu_us_per_connection")
for storm, s in (("plaintext", plain), ("full", g(h, "scenario", "full")), ("resumed", g(h, "scenario", "resumed"))):
    if not s:
        continue
    us = s.get("server_cpu_us_per_connection") or 0
    tls_part = "" if storm == "plaintext" or not base else \
        "; TLS's part {:.0f} us = {:,.0f} handshakes per core per s".format(us - base, 1e6 / (us - base) if us > base else 0)
    out.append("storm, {}: {:,} clients ({:,} resumed), all served in {:,.0f} ms ({:,.0f}/s); server CPU {:.0f} us "
               "per connection + call{}; a served connection's p99 {:.2f} ms quiet, {:.2f} ms during".format(
               storm, s["clients"], s["resumed"], s["all_served_ms"], s["handshakes_per_s"], us, tls_part,
               s["served_connection_p99_ms_quiet"], s["served_connection_p99_ms_during"]))
for kind in ("plain", "tls"):
    i = rep(f"tls-idle-{kind}")
    if i:
        out.append("idle connection, {}: {:,.0f} B of server memory each ({:,} held)".format(
            kind, g(i, "scenario", "bytes_per_connection") or 0, g(i, "scenario", "connections") or 0))
text = "\n".join(out)
print(text)
open(os.path.join(d, "tls-table.txt"), "w").write(text + "\n")
PY
