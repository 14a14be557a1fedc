# Shared by the cluster benchmarks (sourced, not run): loopback ports, an
# etcd of their own, and sums of the nodes' Prometheus metrics. The caller
# sets ETCD (the binary), work (a scratch directory) and pids (an array of
# processes to kill at the end).

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Starts one etcd member on free loopback ports with data under $work/etcd-$1;
# sets $endpoint and returns once it answers.
start_etcd() {
    local name=$1 client peer
    client=$(free_port); peer=$(free_port)
    endpoint="http://127.0.0.1:$client"
    "$ETCD" --name bench --data-dir "$work/etcd-$name" \
        --listen-client-urls "$endpoint" --advertise-client-urls "$endpoint" \
        --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
        --initial-cluster "bench=http://127.0.0.1:$peer" >"$work/etcd-$name.log" 2>&1 &
    pids+=($!)
    until curl -sf "$endpoint/health" >/dev/null; do sleep 0.05; done
}

# The sum over the nodes at `addresses` (host:port of --metrics-listen) of
# the metric samples whose line starts with `name`.
metric_sum() {
    local name=$1 address
    shift
    for address in "$@"; do curl -s "http://$address/metrics"; done |
        awk -v name="$name" 'index($0, name) == 1 {sum += $NF} END {printf "%d", sum}'
}
