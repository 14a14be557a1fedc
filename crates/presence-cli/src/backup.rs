//! `presenced backup FILE`: an online snapshot of one node (D3), written
//! atomically; and `presenced cluster backup DIR`: one file per slot owner
//! and a manifest.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use presence_client::pb::{self, presence_client::PresenceClient};
use serde_json::json;
use tonic::Request;
use tonic::transport::Channel;

use crate::connect::Connection;
use crate::exit::{Exit, Failure};
use crate::output::{print, print_json};
use crate::{BackupArgs, ClusterBackupArgs};

/// How often a backup in progress says how far it got, on stderr.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// What one backup wrote.
#[derive(Debug, Clone, Copy)]
struct Written {
    users: u64,
    sessions: u64,
    durable_rows: u64,
    bytes: u64,
    took: Duration,
}

impl Written {
    fn line(&self, what: &str) -> String {
        format!(
            "backed up {what}: {} users, {} sessions, {} durable rows, {} bytes in {} ms\n",
            self.users,
            self.sessions,
            self.durable_rows,
            self.bytes,
            self.took.as_millis()
        )
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "users": self.users,
            "sessions": self.sessions,
            "durable_rows": self.durable_rows,
            "bytes": self.bytes,
            "elapsed_ms": self.took.as_millis() as u64,
        })
    }
}

pub(crate) async fn backup(args: BackupArgs) -> Result<(), Failure> {
    let connection = Connection::open(&args.target).await?;
    let request = connection.stream_request(pb::BackupRequest {});
    let written = write_backup(connection.client, request, &args.file).await?;
    if args.target.json {
        let mut value = written.json();
        value["file"] = json!(args.file.display().to_string());
        print_json(&value)?;
    } else {
        print(&written.line(&args.file.display().to_string()))?;
    }
    Ok(())
}

/// Streams a backup into `path`: into a temporary file beside it, synced,
/// then renamed over it, so that `path` is either the old file or a whole
/// new backup, never part of one.
async fn write_backup(
    mut client: PresenceClient<Channel>,
    request: Request<pb::BackupRequest>,
    path: &Path,
) -> Result<Written, Failure> {
    let started = Instant::now();
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    let cannot = |err: std::io::Error| Failure::new(Exit::Failed, format!("cannot write {}: {err}", path.display()));
    let mut file = BufWriter::with_capacity(1 << 20, File::create(&temporary).map_err(cannot)?);
    let written = async {
        let mut stream = client.backup(request).await?.into_inner();
        let mut bytes = 0u64;
        let mut reported = Instant::now();
        while let Some(chunk) = stream.message().await? {
            file.write_all(&chunk.data).map_err(cannot)?;
            bytes += chunk.data.len() as u64;
            if chunk.last {
                return Ok(Written {
                    users: chunk.users,
                    sessions: chunk.sessions,
                    durable_rows: chunk.durable_rows,
                    bytes,
                    took: Duration::ZERO,
                });
            }
            if reported.elapsed() >= PROGRESS_EVERY {
                eprintln!("presenced: backup of {}: {} MiB so far", path.display(), bytes >> 20);
                reported = Instant::now();
            }
        }
        Err(Failure::new(Exit::Failed, "the server ended the backup before its end"))
    }
    .await;
    let finished = written.and_then(|written| {
        let file = file.into_inner().map_err(|err| cannot(err.into_error()))?;
        file.sync_all().map_err(cannot)?;
        fs::rename(&temporary, path).map_err(cannot)?;
        Ok(written)
    });
    match finished {
        Ok(written) => Ok(Written { took: started.elapsed(), ..written }),
        Err(failure) => {
            let _ = fs::remove_file(&temporary);
            Err(failure)
        }
    }
}

pub(crate) async fn cluster_backup(args: ClusterBackupArgs) -> Result<(), Failure> {
    let started = Instant::now();
    let cluster = crate::cluster::Cluster::read(&args.etcd).await?;
    let mut owners: std::collections::BTreeMap<String, Vec<u32>> = std::collections::BTreeMap::new();
    for slot in 0..cluster.map.slots() {
        match cluster.map.owner(slot) {
            Some(owner) => owners.entry(owner.node.clone()).or_default().push(slot),
            None => {
                return Err(Failure::new(
                    Exit::Failed,
                    format!("slot {slot} has no owner: a backup now would miss its users; try again once it has one"),
                ));
            }
        }
    }
    fs::create_dir_all(&args.dir)
        .map_err(|err| Failure::new(Exit::Failed, format!("cannot create {}: {err}", args.dir.display())))?;
    let authorization = args.token.authorization()?;
    let scheme = if args.tls.given() { "https" } else { "http" };
    let mut nodes = Vec::new();
    let mut total = Written { users: 0, sessions: 0, durable_rows: 0, bytes: 0, took: Duration::ZERO };
    for (node, slots) in &owners {
        let Some(address) = cluster.nodes.address(node) else {
            return Err(Failure::new(
                Exit::Unreachable,
                format!("node {node} owns {} slots but is not registered (dead or gone)", slots.len()),
            ));
        };
        let channel = args.tls.connect(&format!("{scheme}://{address}")).await?;
        let mut request = Request::new(pb::BackupRequest {});
        if let Some(value) = &authorization {
            request.metadata_mut().insert("authorization", value.clone());
        }
        let file = format!("{node}.backup");
        let written = write_backup(PresenceClient::new(channel), request, &args.dir.join(&file)).await?;
        if !args.json {
            print(&written.line(&format!("{node} ({address}, {} slots)", slots.len())))?;
        }
        total.users += written.users;
        total.sessions += written.sessions;
        total.durable_rows += written.durable_rows;
        total.bytes += written.bytes;
        let mut entry = written.json();
        entry["node"] = json!(node);
        entry["address"] = json!(address);
        entry["file"] = json!(file);
        entry["slots"] = json!(slots);
        nodes.push(entry);
    }
    let written_at_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis() as u64);
    let manifest = json!({
        "slots": cluster.map.slots(),
        "etcd_prefix": cluster.prefix,
        "slot_map_revision": cluster.map.revision(),
        "written_at_ms": written_at_ms,
        "nodes": nodes,
    });
    let manifest_path = args.dir.join("manifest.json");
    let text = serde_json::to_string_pretty(&manifest).unwrap_or_default();
    fs::write(&manifest_path, text + "\n")
        .map_err(|err| Failure::new(Exit::Failed, format!("cannot write {}: {err}", manifest_path.display())))?;
    total.took = started.elapsed();
    if args.json {
        print_json(&manifest)?;
    } else {
        print(&total.line(&format!("{} nodes to {}", owners.len(), args.dir.display())))?;
    }
    Ok(())
}
