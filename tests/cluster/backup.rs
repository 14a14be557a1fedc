//! D3 across a cluster: `presenced cluster backup DIR` walks the slot owners
//! in etcd and writes one file per node and a manifest, and between them
//! the files hold every user, each at its slot's owner; a node's file is
//! foreign to a node of another slot count.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d3_a_cluster_backup_holds_every_owners_users_in_its_file() {
    let etcd = EtcdServer::start().await;
    let (servers, _) = three_nodes_with(&etcd, fast_config, false).await;
    let users: Vec<String> = (0..60).map(|user| format!("u{user}")).collect();
    let (_leases, _) = register_all(&servers[0], &users).await;
    let dir = daemon::scratch_dir("cluster-backup");
    let args: Vec<String> = ["cluster", "backup", "--json", "--etcd", &etcd.endpoint, "--etcd-prefix", PREFIX]
        .into_iter()
        .map(str::to_owned)
        .chain(["--slots".to_owned(), SLOTS.to_string(), dir.display().to_string()])
        .collect();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_presenced")).args(args).output().unwrap()
    })
    .await
    .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let printed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(printed, manifest);
    assert_eq!(manifest["slots"], SLOTS);
    let nodes = manifest["nodes"].as_array().unwrap();
    let mut named: Vec<&str> = nodes.iter().map(|node| node["node"].as_str().unwrap()).collect();
    named.sort_unstable();
    assert_eq!(named, NODES, "every owner: {manifest}");
    let mut covered = Vec::new();
    for node in nodes {
        let slots: Vec<u32> =
            node["slots"].as_array().unwrap().iter().map(|slot| slot.as_u64().unwrap() as u32).collect();
        let theirs = users.iter().filter(|user| slots.contains(&slot_of(user, SLOTS))).count();
        assert_eq!(node["users"], theirs, "{node}");
        let file = dir.join(node["file"].as_str().unwrap());
        assert_eq!(std::fs::metadata(&file).unwrap().len(), node["bytes"].as_u64().unwrap(), "{node}");
        covered.extend(slots);
    }
    covered.sort_unstable();
    assert_eq!(covered, (0..SLOTS).collect::<Vec<_>>(), "every slot, once");

    // A node's file holds its slots' users under SLOTS slots: foreign to a single node.
    let file = dir.join(nodes[0]["file"].as_str().unwrap());
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_presenced"))
        .args(["serve", "--listen", "127.0.0.1:0", "--restore"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains(&format!("a foreign backup: written by a node of {SLOTS} slots, this node has 0")),
        "{stderr}"
    );
    assert!(refused.stdout.is_empty());
    for server in servers {
        server.stop().await;
    }
    std::fs::remove_dir_all(dir).unwrap();
}
