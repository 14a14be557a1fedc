//! One node: `presenced serve` without `--etcd`, in this process or as a
//! child process, over real gRPC, gRPC-Web and the command line.

mod attention;
mod backup;
mod bad_input;
mod cli;
mod connection_limits;
mod connection_threads;
mod credentials;
mod dev_certs;
mod disk_faults;
mod erase;
mod feed;
mod grpc_web;
mod json_http;
mod leases;
mod ops;
mod ops_cli;
mod privacy;
mod restarts;
mod room_counts;
mod rooms;
mod seed_timelines;
mod slow_viewer;
mod tls;
mod viewer_keys;
mod watch_churn;
mod watch_sets;
mod webhook;
