//! B3 with the real binary on a faulty data directory: a full disk fails
//! checkpoints without stopping the service, and a slow disk does not slow
//! renewals. Needs root (a tmpfs and a FUSE mount, from presence-faults).

use std::time::{Duration, Instant};

use crate::common::daemon::{Daemon, free_port, scratch_dir, until_checkpointed};
use crate::common::scrape::scrape_until;
use crate::common::*;
use presence_faults::{SlowDisk, SmallDisk};
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use tonic::transport::Channel;

async fn connect(daemon: &Daemon) -> PresenceClient<Channel> {
    PresenceClient::connect(daemon.url()).await.expect("connect to presenced")
}

async fn online(client: &mut PresenceClient<Channel>, user: &str) -> bool {
    snapshot(client, &[user]).await.iter().all(|p| state_of(p) == pb::State::Online)
}

#[tokio::test]
async fn b3_a_full_disk_fails_checkpoints_keeps_serving_and_checkpoints_again_when_freed() {
    let disk = SmallDisk::new(8 << 20).unwrap_or_else(|e| panic!("cannot set up the small disk: {e}"));
    let data = disk.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let stderr = scratch_dir("disk-full").join("stderr");
    let metrics = format!("127.0.0.1:{}", free_port());
    let daemon = Daemon::start_on(
        "127.0.0.1:0",
        &["--data-dir", data.to_str().unwrap(), "--checkpoint-interval-ms", "50", "--metrics-listen", &metrics],
        &[],
        Some(&stderr),
    );
    let mut client = connect(&daemon).await;
    let before = client.register(register("before", "s1", "gw", 60_000)).await.unwrap().into_inner();
    until_checkpointed(&data, "before").await;

    disk.fill().unwrap();
    client.register(register("during", "s1", "gw", 60_000)).await.expect("a register while the disk is full");
    let deadline = Instant::now() + PATIENCE;
    while !daemon.stderr_text().contains("cannot write a checkpoint; the previous one stays") {
        assert!(Instant::now() < deadline, "no failed checkpoint was reported:\n{}", daemon.stderr_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Still serving, and the last good checkpoint is still there and whole.
    client.renew(renew("before", "s1", before.generation, 60_000)).await.expect("a renewal while the disk is full");
    assert!(online(&mut client, "before").await && online(&mut client, "during").await);
    let kept = presence_core::checkpoint::decode(&std::fs::read(data.join("leases.checkpoint")).unwrap())
        .expect("the previous checkpoint is whole");
    let users: Vec<_> = kept.users.iter().map(|user| user.user_id.as_str()).collect();
    assert_eq!(users, ["before"], "the checkpoint kept is not the one from before the disk filled");

    // And counted, for an alert.
    scrape_until(&metrics, r#"presenced_checkpoints_total{result="failed"}"#, |failed| failed >= 1.0).await;

    disk.free().unwrap();
    until_checkpointed(&data, "during").await;
}

#[tokio::test]
async fn b3_a_slow_disk_does_not_slow_renewals() {
    let delay = Duration::from_millis(100);
    let disk = SlowDisk::new(delay).unwrap_or_else(|e| panic!("cannot set up the slow disk: {e}"));
    let data = disk.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let daemon = Daemon::start(&["--data-dir", data.to_str().unwrap(), "--checkpoint-interval-ms", "50"], &[]);
    let mut client = connect(&daemon).await;
    let registered = client.register(register("u1", "s1", "gw", 60_000)).await.unwrap().into_inner();
    until_checkpointed(&data, "u1").await;

    // Renew back to back until checkpoints have made a dozen delayed disk
    // operations (write, fsync, renames, directory fsync: about two).
    let delayed_before = disk.delayed_ops();
    let deadline = Instant::now() + PATIENCE;
    let (mut slowest, mut renewals) = (Duration::ZERO, 0);
    while disk.delayed_ops() - delayed_before < 12 {
        assert!(Instant::now() < deadline, "the server made no checkpoint on the slow disk");
        let started = Instant::now();
        client.renew(renew("u1", "s1", registered.generation, 60_000)).await.expect("renew");
        slowest = slowest.max(started.elapsed());
        renewals += 1;
    }
    let delayed = disk.delayed_ops() - delayed_before;
    eprintln!("slowest of {renewals} renewals {slowest:?} while {delayed} disk operations were each delayed {delay:?}");
    assert!(slowest < delay, "a renewal took {slowest:?}, as long as a disk operation ({delay:?})");
}
