//! A directory whose writes, fsyncs and renames are slow: a FUSE passthrough
//! file system over a backing temporary directory that sleeps for the
//! configured delay before each operation that changes data or names.
//!
//! Delayed: `write`, `fsync`, `fsyncdir`, `rename`, `create`, `mkdir`,
//! `unlink`, `rmdir` and a `setattr` that changes the size. Reads, lookups
//! and attributes are not delayed, so only the durable path is slow, as on a
//! disk whose write queue is saturated. The kernel sends each write to the
//! file system as it happens (no writeback cache is asked for), so a `write`
//! call in the process under test waits for the delay itself.
//!
//! Mounted through `/dev/fuse` with the mount system call (root needs no
//! `fusermount3` and no libfuse), unmounted on drop.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, OpenFlags,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request, TimeOrNow, WriteFlags,
};

use crate::{FaultError, Result, io_err, require_root};

/// How long the kernel may cache names and attributes. Zero: the backing
/// directory is the truth, and a test may look at it directly.
const TTL: Duration = Duration::ZERO;

/// The delay and what it has done, shared by the handle and the file system.
#[derive(Debug, Default)]
struct Shared {
    /// Sleep before each delayed operation, in nanoseconds.
    delay_nanos: AtomicU64,
    /// Operations that were delayed.
    delayed: AtomicU64,
}

impl Shared {
    fn slow(&self) {
        let nanos = self.delay_nanos.load(Ordering::Relaxed);
        if nanos > 0 {
            std::thread::sleep(Duration::from_nanos(nanos));
        }
        self.delayed.fetch_add(1, Ordering::Relaxed);
    }
}

/// A slow directory; unmounted, and its backing directory removed, on drop.
#[derive(Debug)]
pub struct SlowDisk {
    /// The directory the files really live in.
    backing: tempfile::TempDir,
    /// The mount point the server is given.
    mount: tempfile::TempDir,
    /// The delay, changeable while mounted.
    shared: Arc<Shared>,
    /// The FUSE session thread; `None` once unmounted.
    session: Option<fuser::BackgroundSession>,
}

impl SlowDisk {
    /// Mounts a slow directory whose delayed operations each take at least
    /// `delay`. Needs root and `/dev/fuse`.
    pub fn new(delay: Duration) -> Result<SlowDisk> {
        require_root("SlowDisk (mounting a FUSE file system)")?;
        if !Path::new("/dev/fuse").exists() {
            return Err(FaultError::MissingDevice {
                device: "/dev/fuse",
                hint: "the kernel needs FUSE (CONFIG_FUSE_FS) and a container needs --device /dev/fuse",
            });
        }
        let temp = |prefix: &str| {
            tempfile::Builder::new().prefix(prefix).tempdir().map_err(io_err("creating a temporary directory"))
        };
        let backing = temp("presence-slowdisk-backing-")?;
        let mount = temp("presence-slowdisk-")?;
        let shared = Arc::new(Shared::default());
        shared.delay_nanos.store(u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
        let fs = Passthrough {
            shared: Arc::clone(&shared),
            inodes: Mutex::new(Inodes::new(backing.path().to_path_buf())),
            files: Mutex::new(Files::default()),
        };
        let mut config = fuser::Config::default();
        config.mount_options =
            vec![fuser::MountOption::FSName("presence-slowdisk".into()), fuser::MountOption::DefaultPermissions];
        // Several threads, so one sleeping fsync does not hold up reads.
        config.n_threads = Some(4);
        let session = fuser::spawn_mount(fs, mount.path(), &config)
            .map_err(io_err(format!("mounting FUSE on {}", mount.path().display())))?;
        Ok(SlowDisk { backing, mount, shared, session: Some(session) })
    }

    /// The slow directory: give this (or a subdirectory) to the server.
    pub fn path(&self) -> &Path {
        self.mount.path()
    }

    /// The backing directory, where the same files are reached without delay.
    pub fn backing_path(&self) -> &Path {
        self.backing.path()
    }

    /// Changes the delay of every operation that starts from now on.
    pub fn set_delay(&self, delay: Duration) {
        self.shared.delay_nanos.store(u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// The delay now in force.
    pub fn delay(&self) -> Duration {
        Duration::from_nanos(self.shared.delay_nanos.load(Ordering::Relaxed))
    }

    /// How many operations have been delayed so far.
    pub fn delayed_ops(&self) -> u64 {
        self.shared.delayed.load(Ordering::Relaxed)
    }
}

impl Drop for SlowDisk {
    fn drop(&mut self) {
        // Detach first so a process still holding a file open cannot keep
        // the session thread waiting; then end the session.
        self.shared.delay_nanos.store(0, Ordering::Relaxed);
        let _ = crate::disk::umount_detach(self.mount.path());
        if let Some(session) = self.session.take() {
            drop(session);
        }
    }
}

/// Inode numbers handed to the kernel, each naming a path in the backing
/// directory. Numbers are never reused: a test mounts for seconds.
#[derive(Debug)]
struct Inodes {
    /// Inode number to backing path; 1 is the root.
    paths: HashMap<u64, PathBuf>,
    /// Backing path to inode number.
    numbers: HashMap<PathBuf, u64>,
    /// The next number to hand out.
    next: u64,
}

impl Inodes {
    fn new(root: PathBuf) -> Inodes {
        let mut inodes = Inodes { paths: HashMap::new(), numbers: HashMap::new(), next: 2 };
        inodes.paths.insert(1, root.clone());
        inodes.numbers.insert(root, 1);
        inodes
    }

    fn path(&self, ino: INodeNo) -> std::result::Result<PathBuf, Errno> {
        self.paths.get(&ino.0).cloned().ok_or(Errno::ENOENT)
    }

    fn child(&self, parent: INodeNo, name: &OsStr) -> std::result::Result<PathBuf, Errno> {
        Ok(self.path(parent)?.join(name))
    }

    fn number(&mut self, path: &Path) -> u64 {
        if let Some(&ino) = self.numbers.get(path) {
            return ino;
        }
        let ino = self.next;
        self.next += 1;
        self.paths.insert(ino, path.to_path_buf());
        self.numbers.insert(path.to_path_buf(), ino);
        ino
    }

    /// Moves `from` (and, for a directory, everything under it) to `to`.
    fn rename(&mut self, from: &Path, to: &Path) {
        if let Some(old) = self.numbers.remove(to) {
            self.paths.remove(&old);
        }
        let moved: Vec<(PathBuf, u64)> = self
            .numbers
            .iter()
            .filter(|(path, _)| path.starts_with(from))
            .map(|(path, &ino)| (path.clone(), ino))
            .collect();
        for (path, ino) in moved {
            // Not `to.join("")` for the entry itself: that adds a trailing
            // slash, which names a directory.
            let rest = path.strip_prefix(from).expect("filtered on the prefix");
            let new = if rest.as_os_str().is_empty() { to.to_path_buf() } else { to.join(rest) };
            self.numbers.remove(&path);
            self.numbers.insert(new.clone(), ino);
            self.paths.insert(ino, new);
        }
    }

    fn forget_path(&mut self, path: &Path) {
        if let Some(ino) = self.numbers.remove(path) {
            self.paths.remove(&ino);
        }
    }
}

/// Open files by handle.
#[derive(Debug, Default)]
struct Files {
    /// Handle to the backing file.
    open: HashMap<u64, Arc<File>>,
    /// The next handle.
    next: u64,
}

impl Files {
    fn insert(&mut self, file: File) -> u64 {
        self.next += 1;
        self.open.insert(self.next, Arc::new(file));
        self.next
    }

    fn get(&self, fh: FileHandle) -> std::result::Result<Arc<File>, Errno> {
        self.open.get(&fh.0).cloned().ok_or(Errno::EBADF)
    }
}

/// The FUSE file system: every call maps an inode to its backing path and
/// does the same operation there.
#[derive(Debug)]
struct Passthrough {
    /// The delay.
    shared: Arc<Shared>,
    /// Inode numbers and paths (locked briefly, never across I/O).
    inodes: Mutex<Inodes>,
    /// Open file handles.
    files: Mutex<Files>,
}

fn errno(e: std::io::Error) -> Errno {
    Errno::from(e)
}

fn system_time(secs: i64, nanos: i64) -> SystemTime {
    if secs >= 0 { UNIX_EPOCH + Duration::new(secs as u64, nanos as u32) } else { UNIX_EPOCH }
}

fn attr(ino: u64, meta: &std::fs::Metadata) -> FileAttr {
    let kind = if meta.is_dir() {
        FileType::Directory
    } else if meta.file_type().is_symlink() {
        FileType::Symlink
    } else {
        FileType::RegularFile
    };
    FileAttr {
        ino: INodeNo(ino),
        size: meta.len(),
        blocks: meta.blocks(),
        atime: system_time(meta.atime(), meta.atime_nsec()),
        mtime: system_time(meta.mtime(), meta.mtime_nsec()),
        ctime: system_time(meta.ctime(), meta.ctime_nsec()),
        crtime: system_time(meta.ctime(), meta.ctime_nsec()),
        kind,
        perm: (meta.mode() & 0o7777) as u16,
        nlink: meta.nlink() as u32,
        uid: meta.uid(),
        gid: meta.gid(),
        rdev: meta.rdev() as u32,
        blksize: meta.blksize() as u32,
        flags: 0,
    }
}

impl Passthrough {
    fn path(&self, ino: INodeNo) -> std::result::Result<PathBuf, Errno> {
        self.inodes.lock().expect("inode lock").path(ino)
    }

    fn child(&self, parent: INodeNo, name: &OsStr) -> std::result::Result<PathBuf, Errno> {
        self.inodes.lock().expect("inode lock").child(parent, name)
    }

    /// The attributes of `path`, giving it an inode number.
    fn entry(&self, path: &Path) -> std::result::Result<FileAttr, Errno> {
        let meta = std::fs::symlink_metadata(path).map_err(errno)?;
        let ino = self.inodes.lock().expect("inode lock").number(path);
        Ok(attr(ino, &meta))
    }

    fn file(&self, fh: FileHandle) -> std::result::Result<Arc<File>, Errno> {
        self.files.lock().expect("file lock").get(fh)
    }

    /// `unlink` and `rmdir`: removes the backing entry with `remove`.
    fn remove(&self, parent: INodeNo, name: &OsStr, remove: fn(&Path) -> std::io::Result<()>, reply: ReplyEmpty) {
        self.shared.slow();
        let result = self.child(parent, name).and_then(|path| {
            remove(&path).map_err(errno)?;
            self.inodes.lock().expect("inode lock").forget_path(&path);
            Ok(())
        });
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open_backing(path: &Path, flags: i32, create_mode: Option<u32>) -> std::io::Result<File> {
        let mut options = OpenOptions::new();
        match flags & libc::O_ACCMODE {
            libc::O_RDONLY => options.read(true),
            libc::O_WRONLY => options.write(true),
            _ => options.read(true).write(true),
        };
        if let Some(mode) = create_mode {
            options.create(true).mode(mode);
        }
        // The access mode and creation are set above; pass on the rest
        // (O_APPEND, O_TRUNC, O_EXCL, O_SYNC ...).
        options.custom_flags(flags & !(libc::O_ACCMODE | libc::O_CREAT | libc::O_NOCTTY));
        options.open(path)
    }
}

impl Filesystem for Passthrough {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.child(parent, name).and_then(|path| self.entry(&path)) {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let result = self.path(ino).and_then(|path| {
            let meta = std::fs::symlink_metadata(&path).map_err(errno)?;
            Ok(attr(ino.0, &meta))
        });
        match result {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let result = (|| {
            let path = self.path(ino)?;
            if let Some(mode) = mode {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).map_err(errno)?;
            }
            if let Some(size) = size {
                self.shared.slow();
                match fh {
                    Some(fh) => self.file(fh)?.set_len(size).map_err(errno)?,
                    None => OpenOptions::new().write(true).open(&path).and_then(|f| f.set_len(size)).map_err(errno)?,
                }
            }
            let meta = std::fs::symlink_metadata(&path).map_err(errno)?;
            Ok(attr(ino.0, &meta))
        })();
        match result {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        self.shared.slow();
        let result = self.child(parent, name).and_then(|path| {
            std::fs::create_dir(&path).map_err(errno)?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & !umask)).map_err(errno)?;
            self.entry(&path)
        });
        match result {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, |path| std::fs::remove_file(path), reply);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, |path| std::fs::remove_dir(path), reply);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if !flags.is_empty() {
            // RENAME_NOREPLACE / EXCHANGE are not used by the server.
            reply.error(Errno::EINVAL);
            return;
        }
        self.shared.slow();
        let result = (|| {
            let from = self.child(parent, name)?;
            let to = self.child(newparent, newname)?;
            std::fs::rename(&from, &to).map_err(errno)?;
            self.inodes.lock().expect("inode lock").rename(&from, &to);
            Ok(())
        })();
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let result = self.path(ino).and_then(|path| Self::open_backing(&path, flags.0, None).map_err(errno));
        match result {
            Ok(file) => {
                let fh = self.files.lock().expect("file lock").insert(file);
                reply.opened(FileHandle(fh), FopenFlags::empty());
            }
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        self.shared.slow();
        let result = self.child(parent, name).and_then(|path| {
            let file = Self::open_backing(&path, flags, Some(mode & !umask)).map_err(errno)?;
            let attr = self.entry(&path)?;
            Ok((file, attr))
        });
        match result {
            Ok((file, attr)) => {
                let fh = self.files.lock().expect("file lock").insert(file);
                reply.created(&TTL, &attr, Generation(0), FileHandle(fh), FopenFlags::empty());
            }
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let result = self.file(fh).and_then(|file| {
            let mut buf = vec![0u8; size as usize];
            let n = file.read_at(&mut buf, offset).map_err(errno)?;
            buf.truncate(n);
            Ok(buf)
        });
        match result {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        self.shared.slow();
        match self.file(fh).and_then(|file| file.write_at(data, offset).map_err(errno)) {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.files.lock().expect("file lock").open.remove(&fh.0);
        reply.ok();
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        self.shared.slow();
        let result =
            self.file(fh).and_then(|file| if datasync { file.sync_data() } else { file.sync_all() }.map_err(errno));
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let result = self.path(ino).and_then(|path| {
            let mut entries = vec![(ino.0, FileType::Directory, ".".into()), (ino.0, FileType::Directory, "..".into())];
            for entry in std::fs::read_dir(&path).map_err(errno)? {
                let entry = entry.map_err(errno)?;
                let kind = match entry.file_type().map_err(errno)? {
                    t if t.is_dir() => FileType::Directory,
                    t if t.is_symlink() => FileType::Symlink,
                    _ => FileType::RegularFile,
                };
                let child = self.inodes.lock().expect("inode lock").number(&entry.path());
                entries.push((child, kind, entry.file_name()));
            }
            Ok(entries)
        });
        match result {
            Ok(entries) => {
                for (i, (child, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
                    // The offset given is where the next call resumes.
                    if reply.add(INodeNo(child), (i + 1) as u64, kind, name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        self.shared.slow();
        match self.path(ino).and_then(|path| File::open(path).and_then(|dir| dir.sync_all()).map_err(errno)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let root = self.path(INodeNo(1)).ok();
        let stat = root.and_then(|root| {
            let c = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(root.as_os_str())).ok()?;
            let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
            // SAFETY: c is a valid path string and stat a valid out pointer.
            (unsafe { libc::statvfs(c.as_ptr(), stat.as_mut_ptr()) } == 0)
                // SAFETY: statvfs returned 0, so it filled the struct.
                .then(|| unsafe { stat.assume_init() })
        });
        match stat {
            Some(s) => reply.statfs(
                s.f_blocks,
                s.f_bfree,
                s.f_bavail,
                s.f_files,
                s.f_ffree,
                s.f_bsize as u32,
                s.f_namemax as u32,
                s.f_frsize as u32,
            ),
            None => reply.error(Errno::EIO),
        }
    }
}
