//! A small tmpfs that can be filled to `ENOSPC` and freed again.

use std::ffi::CString;
use std::io::Write as _;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use crate::{FaultError, Result, io_err, require_root};

/// Name of the file that takes up the free space.
const BALLAST: &str = ".ballast";

/// A tmpfs of a fixed size mounted on a temporary directory; unmounted and
/// removed on drop.
#[derive(Debug)]
pub struct SmallDisk {
    /// The mount point (a temporary directory, removed after the unmount).
    dir: tempfile::TempDir,
}

impl SmallDisk {
    /// Mounts a tmpfs of `size_bytes` (rounded up to pages by the kernel) on
    /// a new temporary directory. Needs root.
    pub fn new(size_bytes: u64) -> Result<SmallDisk> {
        require_root("SmallDisk (mounting a tmpfs)")?;
        let dir = tempfile::Builder::new()
            .prefix("presence-smalldisk-")
            .tempdir()
            .map_err(io_err("creating the mount point"))?;
        let options = CString::new(format!("size={size_bytes},mode=0755")).expect("no NUL");
        mount_syscall(c"tmpfs", dir.path(), c"tmpfs", 0, Some(&options))?;
        Ok(SmallDisk { dir })
    }

    /// The mount point: put the data directory (or a subdirectory) here.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Path of the ballast file that [`SmallDisk::fill`] writes.
    pub fn ballast(&self) -> PathBuf {
        self.path().join(BALLAST)
    }

    /// Grows the ballast file until the file system has no byte left, and
    /// returns how many bytes it added. Afterwards every write that needs a
    /// new block fails with `ENOSPC`.
    pub fn fill(&self) -> Result<u64> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.ballast())
            .map_err(io_err("opening the ballast file"))?;
        let block = vec![0xA5u8; 64 * 1024];
        let mut added = 0u64;
        // Large writes first, then ever smaller ones, so the last partial
        // page is taken too.
        let mut size = block.len();
        while size > 0 {
            match file.write(&block[..size]) {
                Ok(0) => size /= 2,
                Ok(n) => added += n as u64,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => size /= 2,
                Err(e) => return Err(io_err("writing the ballast file")(e)),
            }
        }
        Ok(added)
    }

    /// Removes the ballast, giving back the space [`SmallDisk::fill`] took.
    pub fn free(&self) -> Result<()> {
        match std::fs::remove_file(self.ballast()) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("removing the ballast file")(e)),
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        // Lazy unmount: a server still holding files open does not keep the
        // mount alive, and the directory can then be removed by TempDir.
        let _ = umount_detach(self.dir.path());
    }
}

/// mount(2) with a C string for each argument.
pub(crate) fn mount_syscall(
    source: &std::ffi::CStr,
    target: &Path,
    fstype: &std::ffi::CStr,
    flags: libc::c_ulong,
    data: Option<&CString>,
) -> Result<()> {
    let target_c = CString::new(target.as_os_str().as_bytes()).expect("paths have no NUL");
    let data_ptr = data.map_or(std::ptr::null(), |d| d.as_ptr().cast());
    // SAFETY: every pointer is a valid NUL-terminated string (or null for
    // data) that outlives the call.
    let rc = unsafe { libc::mount(source.as_ptr(), target_c.as_ptr(), fstype.as_ptr(), flags, data_ptr) };
    if rc == 0 {
        Ok(())
    } else {
        Err(FaultError::Io {
            what: format!("mounting {fstype:?} on {}", target.display()),
            source: std::io::Error::last_os_error(),
        })
    }
}

/// umount2(2) with `MNT_DETACH`.
pub(crate) fn umount_detach(target: &Path) -> std::io::Result<()> {
    let target_c = CString::new(target.as_os_str().as_bytes()).expect("paths have no NUL");
    // SAFETY: target_c is a valid NUL-terminated string for the call.
    if unsafe { libc::umount2(target_c.as_ptr(), libc::MNT_DETACH) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
