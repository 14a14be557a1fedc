//! One node's presence service: the lease store's clock and context, what
//! is published to whom, leases, rooms, privacy, durable data, expiry and
//! the client API's wire conversions. It names nothing in `cluster/` or
//! `api/`: where a cluster changes what one node does, it asks through
//! [`placement::Placement`], which a single node answers as "everything is
//! here".

pub(crate) mod activity;
pub(crate) mod background;
pub(crate) mod backup;
pub(crate) mod clock;
pub(crate) mod context;
pub(crate) mod data_dir;
pub(crate) mod durable;
pub(crate) mod erase;
pub(crate) mod expiry;
pub(crate) mod feed;
pub(crate) mod groups;
pub(crate) mod hub;
pub(crate) mod leases;
pub(crate) mod ops;
pub(crate) mod placement;
pub mod privacy;
pub(crate) mod publish;
pub(crate) mod relations;
pub(crate) mod room_hub;
pub(crate) mod rooms;
pub(crate) mod settings;
pub(crate) mod sync;
#[cfg(test)]
pub(crate) mod testing;
pub(crate) mod user_data;
pub(crate) mod watch;
pub(crate) mod watches;
pub(crate) mod webhook;
pub(crate) mod wire;

#[cfg(test)]
mod tests {
    /// The one direction `api → cluster → node`: a file under `node/` with a
    /// crate path into the cluster or api folders (or one climbing out of
    /// `node` by two supers) fails here, naming the file and line. Rust's
    /// visibility cannot stop such a path inside one crate. (The paths are
    /// spelled in pieces so that this file does not name them.)
    #[test]
    fn node_names_nothing_of_the_cluster_or_the_api() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/node");
        let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|entry| entry.unwrap().path()).collect();
        files.sort();
        assert!(files.len() > 10, "the node's files are read from {}", dir.display());
        let mut named = Vec::new();
        for file in files.iter().filter(|file| file.extension().is_some_and(|ext| ext == "rs")) {
            let text = std::fs::read_to_string(file).unwrap();
            for (number, line) in text.lines().enumerate() {
                let named_above =
                    [concat!("crate::", "cluster"), concat!("crate::", "api"), concat!("super::", "super")];
                if named_above.iter().any(|path| line.contains(path)) {
                    named.push(format!("{}:{}: {}", file.display(), number + 1, line.trim()));
                }
            }
        }
        assert!(named.is_empty(), "node/ names what builds on it:\n{}", named.join("\n"));
    }
}
