//! Conversation workspaces on disk: where each conversation's directory is, how the server
//! opens it, and the copy a fork makes of it.
//!
//! Everything under a tenant's root is the tenant's tools' to change, at any moment and
//! between any two steps of the server; the server works there as root. So no path a tool
//! can write is ever resolved again with the server's rights: a conversation's directory is
//! opened from the workspace root's descriptor (opened once at start) with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`, a [`Pinned`] directory, and everything
//! the server does there (the sandbox's bind mount, Landlock, the file tools, a fork's copy,
//! giving files to the tool user) goes through that descriptor. A directory that a tool
//! replaced by a link is refused with a clear error, never followed; nothing outside the
//! tenant's root is ever opened or given to the tool user.
//!
//! The copy runs with the server's rights too: so it never follows a symbolic link. It
//! walks by file descriptor: every directory and file is opened relative to its parent with
//! `O_NOFOLLOW`, and a file is copied from the descriptor it was checked on (a regular
//! file), so an entry swapped for a link between the listing and the copy cannot lead it
//! outside the source. Links are copied as links. The byte and entry limits are counted
//! while copying.

use std::ffi::{CStr, OsStr};
use std::io;
use std::os::fd::{AsFd, AsRawFd as _, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{AtFlags, Dir, FileType, Gid, Mode, OFlags, ResolveFlags, Uid};

/// How a conversation's directory is looked up under the workspace root: never above it,
/// through no symbolic link at all (a tool may have made any component one), through no
/// /proc magic link.
const PINNED: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

/// A directory opened once: what the server does there goes through this descriptor, never
/// through its path again. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Pinned {
    fd: Arc<OwnedFd>,
    path: PathBuf,
    /// The trusted directory it was opened beneath, and its plain relative path there: a
    /// process in another mount namespace (a sandboxed run's setup) opens it again the same
    /// way and checks it is the same directory.
    beneath: (PathBuf, PathBuf),
}

impl Pinned {
    /// Opens a directory the server itself made and tools cannot write (the sandbox's
    /// self-test directory): it must not be a link.
    pub fn trusted(path: &Path) -> io::Result<Pinned> {
        let path = path.canonicalize()?;
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(io::Error::other("a directory under / is needed"));
        };
        let fd = rustix::fs::open(
            &path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Pinned {
            fd: Arc::new(fd),
            beneath: (parent.to_owned(), PathBuf::from(name)),
            path,
        })
    }

    /// The trusted directory it was opened beneath, and its relative path there.
    pub fn beneath(&self) -> (&Path, &Path) {
        (&self.beneath.0, &self.beneath.1)
    }

    /// (device, inode): which directory it is.
    pub fn identity(&self) -> io::Result<(u64, u64)> {
        let stat = rustix::fs::fstat(self.fd())?;
        Ok((stat.st_dev, stat.st_ino))
    }

    /// The path it had when it was opened: what tools are told, and where the sandbox
    /// mounts it in a run's own root. Never opened again by the server.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open directory (an `O_PATH` descriptor).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// `/proc/self/fd/N`: a name of the very directory that was opened, for a bind mount or
    /// a child's `chdir` made while this value lives (the kernel follows the descriptor,
    /// not a path).
    pub fn proc_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
    }

    /// The directory opened for reading its entries.
    pub fn open_dir(&self) -> io::Result<OwnedFd> {
        Ok(rustix::fs::openat(
            self.fd(),
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?)
    }

    /// Its owner (uid, gid).
    pub fn owner(&self) -> io::Result<(u32, u32)> {
        let stat = rustix::fs::fstat(self.fd())?;
        Ok((stat.st_uid, stat.st_gid))
    }

    /// Gives the directory itself (not what is in it) to `owner`.
    pub fn give(&self, (uid, gid): (u32, u32)) -> io::Result<()> {
        Ok(rustix::fs::chownat(
            self.fd(),
            "",
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
            AtFlags::EMPTY_PATH,
        )?)
    }
}

/// Why a conversation's directory cannot be opened or made.
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("the working directory {0} does not lie under the tenant's workspace")]
    Outside(String),
    #[error(
        "the working directory {0} (or a directory above it) has been replaced by a symbolic link or a file; it is not followed"
    )]
    Replaced(String),
    #[error("the working directory {0} no longer exists")]
    Missing(String),
    #[error("the working directory {path}: {source}")]
    Io { path: String, source: io::Error },
}

impl WorkspaceError {
    fn at(path: &Path, errno: rustix::io::Errno) -> WorkspaceError {
        let path = path.display().to_string();
        match errno {
            rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR | rustix::io::Errno::XDEV => {
                WorkspaceError::Replaced(path)
            }
            rustix::io::Errno::NOENT => WorkspaceError::Missing(path),
            other => WorkspaceError::Io {
                path,
                source: other.into(),
            },
        }
    }
}

/// The workspace root (the operator's directory, trusted), opened once at start: every
/// conversation's directory is opened beneath it by descriptor.
#[derive(Debug)]
pub struct Workspaces {
    root: PathBuf,
    fd: OwnedFd,
    /// Who tool processes are on the host, when the server runs as root: what the server
    /// makes for them is theirs.
    owner: Option<(u32, u32)>,
}

impl Workspaces {
    /// Opens (making it if needed) the workspace root.
    pub fn open(root: &Path, owner: Option<(u32, u32)>) -> io::Result<Workspaces> {
        std::fs::create_dir_all(root)?;
        let root = root.canonicalize()?;
        let fd = rustix::fs::open(
            &root,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Workspaces { root, fd, owner })
    }

    /// The root, as resolved at start.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Who the server gives what it makes in a workspace to.
    pub fn owner(&self) -> Option<(u32, u32)> {
        self.owner
    }

    /// Opens the stored working directory `cwd` of a conversation: under the root, through
    /// no link. A directory a tool replaced by a link (or by anything else) is refused.
    pub fn pin(&self, cwd: &Path) -> Result<Pinned, WorkspaceError> {
        let outside = || WorkspaceError::Outside(cwd.display().to_string());
        let relative = cwd.strip_prefix(&self.root).map_err(|_| outside())?;
        let mut parts = relative.components().peekable();
        if parts.peek().is_none() || !parts.all(|c| matches!(c, Component::Normal(_))) {
            return Err(outside());
        }
        let fd = rustix::fs::openat2(
            &self.fd,
            relative,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            PINNED,
        )
        .map_err(|errno| WorkspaceError::at(cwd, errno))?;
        Ok(Pinned {
            fd: Arc::new(fd),
            path: cwd.to_owned(),
            beneath: (self.root.clone(), relative.to_owned()),
        })
    }

    /// Makes (or opens) the directory `given` of `tenant` (relative to the tenant's root, or
    /// absolute inside it; `None`: `default`), one component at a time by descriptor, each
    /// made directory given to the tool user. `..` that would leave the tenant's root, and a
    /// link anywhere on the way, are refused.
    pub fn make(
        &self,
        tenant: &str,
        given: Option<&str>,
        default: &str,
    ) -> Result<Pinned, WorkspaceError> {
        let tenant_root = self.root.join(tenant);
        let tenant_part = Path::new(tenant);
        if tenant_part.components().count() != 1
            || !matches!(tenant_part.components().next(), Some(Component::Normal(_)))
        {
            return Err(WorkspaceError::Outside(tenant.to_owned()));
        }
        let outside = |what: &str| WorkspaceError::Outside(what.to_owned());
        let relative: PathBuf = match given {
            None => PathBuf::from(default),
            Some(given) => {
                plain_relative(&tenant_root, Path::new(given)).ok_or_else(|| outside(given))?
            }
        };
        let mut at = self.dir(&self.fd, tenant_part, &tenant_root)?;
        let mut path = tenant_root;
        for part in relative.components() {
            path.push(part);
            at = self.dir(&at, Path::new(part.as_os_str()), &path)?;
        }
        let pinned = Pinned {
            fd: Arc::new(at),
            beneath: (self.root.clone(), Path::new(tenant).join(&relative)),
            path,
        };
        // An existing directory the server made before is given too (not what is in it).
        if let Some(owner) = self.owner
            && pinned.owner().map_err(|source| WorkspaceError::Io {
                path: pinned.path.display().to_string(),
                source,
            })? != owner
        {
            pinned.give(owner).map_err(|source| WorkspaceError::Io {
                path: pinned.path.display().to_string(),
                source,
            })?;
        }
        Ok(pinned)
    }

    /// The bytes of the files in `tenant`'s workspace (links not followed); `u64::MAX` past
    /// [`MAX_MEASURED`] entries. Blocking.
    pub fn tenant_bytes(&self, tenant: &str) -> io::Result<u64> {
        let dir = rustix::fs::openat2(
            &self.fd,
            tenant,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            PINNED,
        )?;
        Ok(measure(dir))
    }

    /// Removes a conversation's directory `cwd` and everything in it, by descriptor: its
    /// parent is opened through no link and nothing is followed while removing, so a link a
    /// tool planted anywhere cannot turn the removal elsewhere. A tenant's root itself is
    /// never removed. Blocking.
    pub fn remove(&self, cwd: &Path) -> Result<(), WorkspaceError> {
        let (Some(parent), Some(name)) = (cwd.parent(), cwd.file_name()) else {
            return Err(WorkspaceError::Outside(cwd.display().to_string()));
        };
        let relative = parent
            .strip_prefix(&self.root)
            .map_err(|_| WorkspaceError::Outside(cwd.display().to_string()))?;
        if relative.as_os_str().is_empty() {
            // The tenant's root.
            return Ok(());
        }
        let parent = self.pin(parent)?;
        let dir = parent.open_dir().map_err(|source| WorkspaceError::Io {
            path: cwd.display().to_string(),
            source,
        })?;
        remove_entry(&dir, Path::new(name)).map_err(|errno| WorkspaceError::at(cwd, errno))
    }

    /// Makes the directory `name` in `parent` if missing (given to the tool user) and opens
    /// it, through no link.
    fn dir(&self, parent: &OwnedFd, name: &Path, path: &Path) -> Result<OwnedFd, WorkspaceError> {
        let made = match rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o755)) {
            Ok(()) => true,
            Err(rustix::io::Errno::EXIST) => false,
            Err(errno) => return Err(WorkspaceError::at(path, errno)),
        };
        let fd = rustix::fs::openat2(
            parent,
            name,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            PINNED,
        )
        .map_err(|errno| WorkspaceError::at(path, errno))?;
        if made && let Some((uid, gid)) = self.owner {
            rustix::fs::chownat(
                &fd,
                "",
                Some(Uid::from_raw(uid)),
                Some(Gid::from_raw(gid)),
                AtFlags::EMPTY_PATH,
            )
            .map_err(|errno| WorkspaceError::at(path, errno))?;
        }
        Ok(fd)
    }
}

/// `given` (relative to `base`, or absolute inside it) as a plain relative path under `base`,
/// by its spelling alone: `None` when it leaves `base` (`..` above it, an absolute path
/// elsewhere). Nothing is looked up: what keeps links from leading out is opening the result
/// beneath `base`'s descriptor. Empty: `base` itself.
pub fn plain_relative(base: &Path, given: &Path) -> Option<PathBuf> {
    let relative = if given.is_absolute() {
        given.strip_prefix(base).ok()?
    } else {
        given
    };
    let mut normal = PathBuf::new();
    for component in relative.components() {
        match component {
            Component::Normal(part) => normal.push(part),
            Component::CurDir => {}
            Component::ParentDir => {
                if !normal.pop() {
                    return None;
                }
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(normal)
}

/// The most entries one measurement of a tenant's workspace looks at.
pub const MAX_MEASURED: u64 = 1_000_000;

/// Removes `name` in the open directory `dir` (a directory with everything in it), by
/// descriptor, never following a link, however deep the tree: the walk keeps its place on
/// the heap and at most two directories open (it climbs back through `..`, checking that it
/// arrives where it came from), so a tree a tool made thousands of levels deep neither
/// overflows the stack nor runs out of descriptors. Blocking.
pub fn remove_entry(dir: &OwnedFd, name: &Path) -> Result<(), rustix::io::Errno> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let unlink =
        |at: &OwnedFd, entry: &OsStr, how: AtFlags| match rustix::fs::unlinkat(at, entry, how) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
            Err(errno) => Err(errno),
        };
    let is_dir = |at: &OwnedFd, entry: &OsStr| match rustix::fs::statat(
        at,
        entry,
        AtFlags::SYMLINK_NOFOLLOW,
    ) {
        Ok(stat) => Ok(Some(
            FileType::from_raw_mode(stat.st_mode) == FileType::Directory,
        )),
        Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(errno) => Err(errno),
    };
    let identity = |fd: &OwnedFd| rustix::fs::fstat(fd).map(|st| (st.st_dev, st.st_ino));
    let listing = |fd: &OwnedFd| -> Result<Vec<std::ffi::OsString>, rustix::io::Errno> {
        let mut names = Vec::new();
        let mut entries = Dir::read_from(fd)?;
        while let Some(entry) = entries.read() {
            let entry = entry?;
            let entry_name = entry.file_name();
            if entry_name != c"." && entry_name != c".." {
                names.push(OsStr::from_bytes(entry_name.to_bytes()).to_owned());
            }
        }
        Ok(names)
    };
    let name = name.as_os_str();
    match is_dir(dir, name)? {
        None => return Ok(()),
        Some(false) => return unlink(dir, name, AtFlags::empty()),
        Some(true) => {}
    }
    let top = match rustix::fs::openat(dir, name, flags, Mode::empty()) {
        Ok(fd) => fd,
        // Swapped for a link or a file meanwhile: removed as what it is now.
        Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => {
            return unlink(dir, name, AtFlags::empty());
        }
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(errno) => return Err(errno),
    };
    // Each level: its name in its parent, its identity, the entries still to remove.
    let mut levels = vec![(name.to_owned(), identity(&top)?, listing(&top)?)];
    let mut current = top;
    while let Some((_, _, remaining)) = levels.last_mut() {
        if let Some(entry) = remaining.pop() {
            match is_dir(&current, &entry)? {
                None => {}
                Some(false) => unlink(&current, &entry, AtFlags::empty())?,
                Some(true) => match rustix::fs::openat(&current, &entry, flags, Mode::empty()) {
                    Ok(sub) => {
                        let entries = listing(&sub)?;
                        levels.push((entry, identity(&sub)?, entries));
                        current = sub;
                    }
                    Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => {
                        unlink(&current, &entry, AtFlags::empty())?;
                    }
                    Err(rustix::io::Errno::NOENT) => {}
                    Err(errno) => return Err(errno),
                },
            }
            continue;
        }
        // This level is empty: climb to its parent and remove it there.
        let Some((finished, _, _)) = levels.pop() else {
            break;
        };
        match levels.last() {
            Some((_, parent_id, _)) => {
                let parent = rustix::fs::openat(&current, "..", flags, Mode::empty())?;
                if identity(&parent)? != *parent_id {
                    // Moved meanwhile: do not remove anything where it now is.
                    return Err(rustix::io::Errno::STALE);
                }
                unlink(&parent, &finished, AtFlags::REMOVEDIR)?;
                current = parent;
            }
            None => unlink(dir, &finished, AtFlags::REMOVEDIR)?,
        }
    }
    Ok(())
}

/// The bytes of the regular files under the open directory `dir`, by descriptor, however
/// deep (the walk keeps its place on the heap and two directories open, climbing back
/// through `..`); `u64::MAX` past [`MAX_MEASURED`] entries, or when the tree moves under
/// the walk, which counts as over any quota.
fn measure(dir: OwnedFd) -> u64 {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let identity = |fd: &OwnedFd| rustix::fs::fstat(fd).map(|st| (st.st_dev, st.st_ino)).ok();
    let listing = |fd: &OwnedFd| -> Vec<std::ffi::OsString> {
        let mut names = Vec::new();
        if let Ok(mut entries) = Dir::read_from(fd) {
            while let Some(Ok(entry)) = entries.read() {
                let name = entry.file_name();
                if name != c"." && name != c".." {
                    names.push(OsStr::from_bytes(name.to_bytes()).to_owned());
                }
            }
        }
        names
    };
    let Some(top) = identity(&dir) else {
        return 0;
    };
    let mut seen = 0u64;
    let mut bytes = 0u64;
    let mut levels = vec![(top, listing(&dir))];
    let mut current = dir;
    while let Some((_, remaining)) = levels.last_mut() {
        let Some(name) = remaining.pop() else {
            levels.pop();
            let Some((parent_id, _)) = levels.last() else {
                break;
            };
            match rustix::fs::openat(&current, "..", flags, Mode::empty()) {
                Ok(parent) if identity(&parent).as_ref() == Some(parent_id) => current = parent,
                Ok(_) | Err(_) => return u64::MAX,
            }
            continue;
        };
        seen += 1;
        if seen > MAX_MEASURED {
            return u64::MAX;
        }
        let Ok(stat) = rustix::fs::statat(&current, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW)
        else {
            continue;
        };
        match FileType::from_raw_mode(stat.st_mode) {
            FileType::RegularFile => {
                bytes = bytes.saturating_add(u64::try_from(stat.st_size).unwrap_or(0));
            }
            FileType::Directory => {
                if let Ok(sub) =
                    rustix::fs::openat(&current, name.as_os_str(), flags, Mode::empty())
                    && let Some(id) = identity(&sub)
                {
                    let entries = listing(&sub);
                    levels.push((id, entries));
                    current = sub;
                }
            }
            FileType::Symlink
            | FileType::Fifo
            | FileType::Socket
            | FileType::CharacterDevice
            | FileType::BlockDevice
            | FileType::Unknown => {}
        }
    }
    bytes
}

/// The deepest directory one copy makes (each level holds descriptors and a stack frame).
pub const MAX_DEPTH: usize = 256;

/// The most entries (files, directories, links) one copy makes.
pub const MAX_ENTRIES: u64 = 200_000;

/// Why a workspace was not copied.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("the workspace holds more than {limit} bytes of files (a fork copies at most that)")]
    TooLarge { limit: u64 },
    #[error("the workspace holds more than {MAX_ENTRIES} files and directories")]
    TooManyEntries,
    #[error("the workspace is more than {MAX_DEPTH} directories deep")]
    TooDeep,
    #[error("the source workspace {} does not exist", .0.display())]
    SourceMissing(PathBuf),
    /// The source cannot be opened safely (a tool replaced it by a link).
    #[error("{0}")]
    Refused(String),
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

struct Copy {
    limit: u64,
    bytes: u64,
    entries: u64,
    /// The target directory, skipped should it lie inside the source.
    target: (u64, u64),
    owner: Option<(Uid, Gid)>,
    /// How deep the copy is now.
    depth: usize,
}

fn io_at(path: &Path) -> impl FnOnce(rustix::io::Errno) -> CopyError + '_ {
    move |errno| CopyError::Io {
        path: path.to_owned(),
        source: errno.into(),
    }
}

/// Copies the directory tree `from` into the empty directory `to`: directories, regular
/// files (as reflinks where the filesystem has them, else plain copies) and symbolic links
/// as links, never followed; what it makes belongs to `owner` when given. Sockets, pipes and
/// devices are left out. Past `limit` bytes of files or [`MAX_ENTRIES`] entries the copy
/// stops (the caller removes what it made). Returns the bytes copied. Blocking: run it off
/// the async threads.
pub fn copy_tree(
    from: &Pinned,
    to: &Pinned,
    limit: u64,
    owner: Option<(u32, u32)>,
) -> Result<u64, CopyError> {
    let source = match from.open_dir() {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(CopyError::SourceMissing(from.path().to_owned()));
        }
        Err(source) => {
            return Err(CopyError::Io {
                path: from.path().to_owned(),
                source,
            });
        }
    };
    let target = to.open_dir().map_err(|source| CopyError::Io {
        path: to.path().to_owned(),
        source,
    })?;
    let stat = rustix::fs::fstat(&target).map_err(io_at(to.path()))?;
    let mut copy = Copy {
        limit,
        bytes: 0,
        entries: 0,
        target: (stat.st_dev, stat.st_ino),
        owner: owner.map(|(uid, gid)| (Uid::from_raw(uid), Gid::from_raw(gid))),
        depth: 0,
    };
    copy.dir(&source, &target, from.path())?;
    Ok(copy.bytes)
}

impl Copy {
    /// Copies the entries of the open directory `from` into the open directory `to`.
    fn dir(&mut self, from: &OwnedFd, to: &OwnedFd, path: &Path) -> Result<(), CopyError> {
        let mut listing = Dir::read_from(from).map_err(io_at(path))?;
        while let Some(entry) = listing.read() {
            let entry = entry.map_err(io_at(path))?;
            let name = entry.file_name();
            if name == c"." || name == c".." {
                continue;
            }
            self.entries += 1;
            if self.entries > MAX_ENTRIES {
                return Err(CopyError::TooManyEntries);
            }
            let here = path.join(OsStr::from_bytes(name.to_bytes()));
            self.entry(from, to, name, &here)?;
        }
        Ok(())
    }

    fn entry(
        &mut self,
        from: &OwnedFd,
        to: &OwnedFd,
        name: &CStr,
        here: &Path,
    ) -> Result<(), CopyError> {
        let stat = match rustix::fs::statat(from, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => stat,
            Err(rustix::io::Errno::NOENT) => return Ok(()), // removed meanwhile
            Err(errno) => return Err(io_at(here)(errno)),
        };
        match FileType::from_raw_mode(stat.st_mode) {
            FileType::Directory => {
                if (stat.st_dev, stat.st_ino) == self.target {
                    return Ok(()); // the copy itself, inside its source
                }
                let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                let source = match rustix::fs::openat(from, name, flags, Mode::empty()) {
                    Ok(fd) => fd,
                    // Swapped for something else since it was listed: copy what it is now.
                    Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => {
                        return self.link_or_skip(from, to, name, here);
                    }
                    Err(errno) => return Err(io_at(here)(errno)),
                };
                rustix::fs::mkdirat(to, name, Mode::from_raw_mode(0o755)).map_err(io_at(here))?;
                let target =
                    rustix::fs::openat(to, name, flags, Mode::empty()).map_err(io_at(here))?;
                self.give(&target, here)?;
                if self.depth >= MAX_DEPTH {
                    return Err(CopyError::TooDeep);
                }
                self.depth += 1;
                let copied = self.dir(&source, &target, here);
                self.depth -= 1;
                copied
            }
            FileType::RegularFile => self.file(from, to, name, here),
            FileType::Symlink => self.link_or_skip(from, to, name, here),
            // Sockets, pipes, devices.
            FileType::Fifo
            | FileType::Socket
            | FileType::CharacterDevice
            | FileType::BlockDevice
            | FileType::Unknown => Ok(()),
        }
    }

    fn file(
        &mut self,
        from: &OwnedFd,
        to: &OwnedFd,
        name: &CStr,
        here: &Path,
    ) -> Result<(), CopyError> {
        // O_NONBLOCK: should it have become a pipe, opening it does not wait for a writer.
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let source = match rustix::fs::openat(from, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::LOOP) => return self.link_or_skip(from, to, name, here),
            Err(rustix::io::Errno::NOENT) => return Ok(()),
            Err(errno) => return Err(io_at(here)(errno)),
        };
        let stat = rustix::fs::fstat(&source).map_err(io_at(here))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Ok(());
        }
        self.bytes = self
            .bytes
            .saturating_add(u64::try_from(stat.st_size).unwrap_or(0));
        if self.bytes > self.limit {
            return Err(CopyError::TooLarge { limit: self.limit });
        }
        let target = rustix::fs::openat(
            to,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(stat.st_mode & 0o777),
        )
        .map_err(io_at(here))?;
        self.give(&target, here)?;
        if rustix::fs::ioctl_ficlone(&target, &source).is_ok() {
            return Ok(());
        }
        // No reflinks here: copy the bytes (copy_file_range where the kernel can), at most
        // the size that was counted, should the file grow meanwhile.
        let mut reader = io::Read::take(std::fs::File::from(source), stat.st_size as u64);
        let mut writer = std::fs::File::from(target);
        io::copy(&mut reader, &mut writer).map_err(|source| CopyError::Io {
            path: here.to_owned(),
            source,
        })?;
        Ok(())
    }

    /// Copies a symbolic link as a link; anything else it turned into is left out.
    fn link_or_skip(
        &mut self,
        from: &OwnedFd,
        to: &OwnedFd,
        name: &CStr,
        here: &Path,
    ) -> Result<(), CopyError> {
        let link = match rustix::fs::readlinkat(from, name, Vec::new()) {
            Ok(link) => link,
            // Not a link (any more): nothing that can be copied safely.
            Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => return Ok(()),
            Err(errno) => return Err(io_at(here)(errno)),
        };
        rustix::fs::symlinkat(link.as_c_str(), to, name).map_err(io_at(here))?;
        if let Some((uid, gid)) = self.owner {
            rustix::fs::chownat(to, name, Some(uid), Some(gid), AtFlags::SYMLINK_NOFOLLOW)
                .map_err(io_at(here))?;
        }
        Ok(())
    }

    /// Gives what the copy made (open as `fd`) to the tool user.
    fn give(&self, fd: &OwnedFd, here: &Path) -> Result<(), CopyError> {
        if let Some((uid, gid)) = self.owner {
            rustix::fs::fchown(fd, Some(uid), Some(gid)).map_err(io_at(here))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies `from` into the new directory `to` as a fork does: what was made is removed
    /// when the copy fails.
    fn copy_tree(from: &Path, to: &Path, limit: u64) -> Result<u64, CopyError> {
        std::fs::create_dir(to).expect("the target");
        let pin = |path: &Path| Pinned::trusted(path).expect("a directory");
        let copied = super::copy_tree(&pin(from), &pin(to), limit, None);
        if copied.is_err() {
            std::fs::remove_dir_all(to).expect("removed");
        }
        copied
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "bedrock-ws-{name}-{}-{}",
            std::process::id(),
            uuid::Uuid::now_v7()
        ));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        dir
    }

    #[test]
    fn copies_files_directories_hidden_files_and_links() {
        let root = scratch("copy");
        let from = root.join("from");
        std::fs::create_dir_all(from.join("src/deep")).expect("dirs");
        std::fs::write(from.join("a.txt"), "alpha").expect("a file");
        std::fs::write(from.join("src/deep/b.rs"), "fn b() {}").expect("a file");
        std::fs::write(from.join(".env"), "SECRET=1").expect("a hidden file");
        std::fs::write(from.join(".gitignore"), "a.txt\n").expect("ignore rules");
        std::os::unix::fs::symlink("a.txt", from.join("link")).expect("a link");
        let to = root.join("to");
        let copied = copy_tree(&from, &to, 1 << 20).expect("copied");
        assert_eq!(copied, 5 + 9 + 8 + 6);
        assert_eq!(
            std::fs::read_to_string(to.join("a.txt")).expect("the file system answers"),
            "alpha"
        );
        assert_eq!(
            std::fs::read_to_string(to.join("src/deep/b.rs")).expect("the file system answers"),
            "fn b() {}"
        );
        assert_eq!(
            std::fs::read_to_string(to.join(".env")).expect("the file system answers"),
            "SECRET=1"
        );
        assert_eq!(
            std::fs::read_link(to.join("link")).expect("the file system answers"),
            PathBuf::from("a.txt")
        );
        // A copy, not the same file.
        std::fs::write(to.join("a.txt"), "changed").expect("the file system answers");
        assert_eq!(
            std::fs::read_to_string(from.join("a.txt")).expect("the file system answers"),
            "alpha"
        );
        std::fs::remove_dir_all(root).ok();
    }

    #[test]
    fn refuses_more_than_the_limit_and_copies_nothing() {
        let root = scratch("limit");
        let from = root.join("from");
        std::fs::create_dir_all(&from).expect("the file system answers");
        std::fs::write(from.join("big"), vec![0u8; 2048]).expect("the file system answers");
        let to = root.join("to");
        match copy_tree(&from, &to, 1024) {
            Err(CopyError::TooLarge { limit }) => assert_eq!(limit, 1024),
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert!(!to.exists(), "what was made is removed");
        std::fs::remove_dir_all(root).ok();
    }

    /// Links are copied as links, never followed: a link to a secret outside the source
    /// (a file or a directory) gives the copy a link, not the secret.
    #[test]
    fn never_follows_links_out_of_the_source() {
        let root = scratch("links");
        let (from, outside) = (root.join("from"), root.join("outside"));
        std::fs::create_dir_all(&from).expect("dirs");
        std::fs::create_dir_all(outside.join("dir")).expect("dirs");
        std::fs::write(outside.join("secret"), "the server's key").expect("a file");
        std::fs::write(outside.join("dir/more"), "more secrets").expect("a file");
        std::os::unix::fs::symlink(outside.join("secret"), from.join("file-link")).expect("a link");
        std::os::unix::fs::symlink(outside.join("dir"), from.join("dir-link")).expect("a link");
        let to = root.join("to");
        let copied = copy_tree(&from, &to, 1 << 20).expect("copied");
        assert_eq!(copied, 0, "no file's bytes were copied");
        for name in ["file-link", "dir-link"] {
            let meta = std::fs::symlink_metadata(to.join(name)).expect("the link");
            assert!(meta.file_type().is_symlink(), "{name} stays a link");
        }
        std::fs::remove_dir_all(root).ok();
    }

    /// A source that contains the target (a conversation working in the tenant's root)
    /// does not copy the copy into itself.
    #[test]
    fn skips_the_target_inside_its_source() {
        let root = scratch("nested");
        std::fs::write(root.join("a.txt"), "alpha").expect("a file");
        let to = root.join("fork");
        let copied = copy_tree(&root, &to, 1 << 20).expect("copied");
        assert_eq!(copied, 5);
        assert!(!to.join("fork").exists(), "not copied into itself");
        std::fs::remove_dir_all(root).ok();
    }

    /// The stored path of a conversation is opened through no link: a directory replaced by
    /// a link (to its parent, or anywhere) is refused, and so is one above it.
    #[test]
    fn a_replaced_directory_is_refused_never_followed() {
        let root = scratch("pin");
        let workspaces = Workspaces::open(&root, None).expect("the root");
        let victim = workspaces.make("t", Some("a/victim"), "x").expect("made");
        assert_eq!(victim.path(), workspaces.root().join("t/a/victim"));
        std::fs::write(victim.path().join("mine"), "victim's").expect("a file");
        assert!(workspaces.pin(victim.path()).is_ok());
        // What a conversation at the tenant's root can do to another's directory.
        std::fs::remove_dir_all(victim.path()).expect("removed");
        std::os::unix::fs::symlink("..", victim.path()).expect("a link");
        match workspaces.pin(victim.path()) {
            Err(WorkspaceError::Replaced(_)) => {}
            other => panic!("expected Replaced, got {other:?}"),
        }
        // A link above it.
        std::fs::remove_file(victim.path()).expect("removed");
        std::fs::rename(root.join("t/a"), root.join("t/b")).expect("moved");
        std::os::unix::fs::symlink("/", root.join("t/a")).expect("a link");
        assert!(matches!(
            workspaces.pin(&root.join("t/a/victim")),
            Err(WorkspaceError::Replaced(_))
        ));
        assert!(matches!(
            workspaces.make("t", Some("a/victim"), "x"),
            Err(WorkspaceError::Replaced(_))
        ));
        // Gone, outside, or not plain.
        assert!(matches!(
            workspaces.pin(&root.join("t/gone")),
            Err(WorkspaceError::Missing(_))
        ));
        for bad in ["/etc", "/tmp"] {
            assert!(matches!(
                workspaces.pin(Path::new(bad)),
                Err(WorkspaceError::Outside(_))
            ));
        }
        assert!(matches!(
            workspaces.pin(&root.join("t/../t")),
            Err(WorkspaceError::Outside(_))
        ));
        for bad in ["..", "a/../../x", "/etc"] {
            assert!(
                matches!(
                    workspaces.make("t", Some(bad), "x"),
                    Err(WorkspaceError::Outside(_))
                ),
                "{bad}"
            );
        }
        // Inside the tenant's root, absolute or relative, `.` included.
        let at_root = workspaces.make("t", Some("."), "x").expect("the root");
        assert_eq!(at_root.path(), root.join("t"));
        let absolute = root.join("t/c/d").display().to_string();
        assert_eq!(
            workspaces
                .make("t", Some(&absolute), "x")
                .expect("made")
                .path(),
            root.join("t/c/d")
        );
        std::fs::remove_dir_all(root).ok();
    }
}
