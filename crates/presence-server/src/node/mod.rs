//! One node's presence service: serving and relations (here), what it keeps on disk (`storage/`), its feed (`feed/`).
//! It may name nothing in `cluster/` or `api/`; a cluster changes what one node does through [`placement::Placement`].
//!
//! Serving: the lease store's clock and context, what is published to
//! whom, leases, rooms, watches, expiry and the client API's wire
//! conversions (`wire.rs`). Relations: privacy, groups, settings, activity,
//! a user's data and its erasure. A single node answers
//! [`placement::Placement`] as "everything is here".

pub(crate) mod activity;
pub(crate) mod background;
pub(crate) mod clock;
pub(crate) mod context;
pub(crate) mod count_board;
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
pub(crate) mod room_counts;
pub(crate) mod room_hub;
pub(crate) mod rooms;
pub(crate) mod settings;
pub(crate) mod storage;
pub(crate) mod sync;
#[cfg(test)]
pub(crate) mod testing;
pub(crate) mod user_data;
pub(crate) mod watch;
pub(crate) mod watches;
pub(crate) mod wire;

#[cfg(test)]
pub(crate) mod tests {
    use std::path::{Path, PathBuf};

    /// This crate's `src/` folder `name`.
    pub(crate) fn source_folder(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(name)
    }

    /// Every `.rs` file under `folder` and its sub-folders, in path order.
    pub(crate) fn rust_files_under(folder: &Path) -> Vec<PathBuf> {
        let mut files = Vec::new();
        let mut folders = vec![folder.to_path_buf()];
        while let Some(dir) = folders.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    folders.push(path);
                } else if path.extension().is_some_and(|ext| ext == "rs") {
                    files.push(path);
                }
            }
        }
        files.sort();
        files
    }

    /// The lines of `files` (under `folder`) that contain one of the crate
    /// paths `named`, or climb out of `folder` by `super`s and go on with
    /// one of `climbed_into` (`""`: anything), each as `file:line: text`. A
    /// file climbs out with one `super` more than it is deep below `folder`
    /// (two at the least: a `mod.rs`'s tests climb one more).
    pub(crate) fn lines_naming(folder: &Path, files: &[PathBuf], named: &[&str], climbed_into: &[&str]) -> Vec<String> {
        let mut found = Vec::new();
        for file in files {
            let below = file.strip_prefix(folder).unwrap();
            let depth = below.components().count() - usize::from(below.ends_with("mod.rs"));
            let climb = vec!["super"; (depth + 1).max(2)].join("::");
            let text = std::fs::read_to_string(file).unwrap();
            for (number, line) in text.lines().enumerate() {
                let climbs_out = climbed_into.iter().any(|rest| line.contains(&format!("{climb}{rest}")));
                if climbs_out || named.iter().any(|path| line.contains(path)) {
                    found.push(format!("{}:{}: {}", file.display(), number + 1, line.trim()));
                }
            }
        }
        found
    }

    /// The one direction `api → cluster → node`: a file under `node/` or any
    /// of its sub-folders with a crate path into the cluster or api folders
    /// (or one climbing out of `node` by `super`s) fails here, naming the
    /// file and line. Rust's visibility cannot stop such a path inside one
    /// crate. (The paths are spelled in pieces so that this file does not
    /// name them.)
    #[test]
    fn node_names_nothing_of_the_cluster_or_the_api() {
        let dir = source_folder("node");
        let files = rust_files_under(&dir);
        assert!(files.len() > 10, "the node's files are read from {}", dir.display());
        let in_sub_folders = files.iter().filter(|file| file.parent() != Some(dir.as_path())).count();
        assert!(in_sub_folders >= 6, "the node's sub-folders are read too: {in_sub_folders} files");
        let named = lines_naming(&dir, &files, &[concat!("crate::", "cluster"), concat!("crate::", "api")], &[""]);
        assert!(named.is_empty(), "node/ names what builds on it:\n{}", named.join("\n"));
    }
}
