//! SmallDisk and SlowDisk: a full disk fails writes with ENOSPC until freed,
//! and a slow disk makes each write, fsync and rename wait. Need root (and
//! /dev/fuse for SlowDisk); without them each test fails saying so.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use presence_faults::{SlowDisk, SmallDisk};

fn mounted(path: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let path = path.to_str().unwrap();
    mounts.lines().any(|line| line.split(' ').nth(1) == Some(path))
}

fn write_file(path: &Path, bytes: usize) -> std::io::Result<()> {
    let mut file = File::create(path)?;
    file.write_all(&vec![1u8; bytes])?;
    file.sync_all()
}

#[test]
fn small_disk_fails_writes_with_enospc_after_fill_and_not_after_free() {
    let disk = SmallDisk::new(1 << 20).unwrap_or_else(|e| panic!("cannot set up the small disk: {e}"));
    let path = disk.path().to_path_buf();
    assert!(mounted(&path));
    write_file(&path.join("before"), 4096).expect("a write before fill");

    let added = disk.fill().unwrap();
    assert!(added > 0 && added <= 1 << 20, "ballast of {added} bytes");
    let err = write_file(&path.join("full"), 4096).expect_err("a write on a full disk succeeded");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    let err = OpenOptions::new().append(true).open(path.join("before")).and_then(|mut f| f.write_all(&[0u8; 4096]));
    assert_eq!(err.expect_err("an append on a full disk").raw_os_error(), Some(libc::ENOSPC));

    disk.free().unwrap();
    write_file(&path.join("after"), 64 * 1024).expect("a write after free");
    drop(disk);
    assert!(!mounted(&path), "the tmpfs is still mounted after drop");
}

fn slow_disk(delay: Duration) -> SlowDisk {
    SlowDisk::new(delay).unwrap_or_else(|e| panic!("cannot set up the slow disk: {e}"))
}

/// The data directory's checkpoint sequence: write a temporary file, fsync
/// it, rename it over the latest, fsync the directory.
#[test]
fn slow_disk_delays_write_fsync_rename_and_directory_fsync() {
    let delay = Duration::from_millis(150);
    let disk = slow_disk(delay);
    let dir = disk.path().to_path_buf();
    assert!(mounted(&dir));

    let timed = |what: &str, f: &mut dyn FnMut() -> std::io::Result<()>| {
        let started = Instant::now();
        f().unwrap_or_else(|e| panic!("{what}: {e}"));
        let took = started.elapsed();
        assert!(took >= delay, "{what} took {took:?}, under the delay {delay:?}");
    };
    let mut file = None;
    timed("create", &mut || {
        file = Some(File::create(dir.join("checkpoint.writing"))?);
        Ok(())
    });
    let mut file = file.unwrap();
    timed("write", &mut || file.write_all(b"checkpoint bytes"));
    timed("fsync", &mut || file.sync_all());
    drop(file);
    timed("rename", &mut || std::fs::rename(dir.join("checkpoint.writing"), dir.join("checkpoint")));
    timed("directory fsync", &mut || File::open(&dir)?.sync_all());

    assert_eq!(std::fs::read(dir.join("checkpoint")).unwrap(), b"checkpoint bytes");
    assert_eq!(std::fs::read(disk.backing_path().join("checkpoint")).unwrap(), b"checkpoint bytes");
    assert!(!dir.join("checkpoint.writing").exists());
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["checkpoint"]);
    assert!(disk.delayed_ops() >= 5);

    // Lowered at run time: the same operations are quick again.
    disk.set_delay(Duration::ZERO);
    let started = Instant::now();
    let mut file = File::create(dir.join("quick")).unwrap();
    file.write_all(b"quick").unwrap();
    file.sync_all().unwrap();
    assert!(started.elapsed() < delay, "still slow after set_delay(0): {:?}", started.elapsed());

    drop(file);
    drop(disk);
    assert!(!mounted(&dir), "the FUSE file system is still mounted after drop");
}
