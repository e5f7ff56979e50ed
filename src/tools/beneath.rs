//! File access that cannot leave a directory, even while the tree changes under it.
//!
//! [`relative_in`](super::relative_in) gives a clear message for a path that leaves the
//! working directory by its spelling, but a check followed by an open races with a concurrent process (a
//! background task) that swaps a directory for a symlink in between. Every open here is
//! `openat2` relative to the working directory with `RESOLVE_BENEATH`: the kernel refuses
//! (EXDEV) any resolution that would leave it, through `..`, an absolute symlink or a
//! relative one, at the moment of the open.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Component, Path};

use rustix::fs::{Mode, OFlags, ResolveFlags};

const BENEATH: ResolveFlags = ResolveFlags::BENEATH.union(ResolveFlags::NO_MAGICLINKS);

/// A directory that paths are resolved under.
#[derive(Debug)]
pub struct Beneath {
    dir: OwnedFd,
}

fn io(e: rustix::io::Errno) -> std::io::Error {
    if e == rustix::io::Errno::XDEV {
        std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "the path leaves the working directory",
        )
    } else {
        std::io::Error::from(e)
    }
}

impl Beneath {
    /// Paths under the directory `dir` was opened as (never its path looked up again).
    pub fn new(dir: &crate::workspace::Pinned) -> std::io::Result<Self> {
        Ok(Beneath {
            dir: dir.fd().try_clone_to_owned()?,
        })
    }

    /// The directory itself.
    pub fn dir(&self) -> &OwnedFd {
        &self.dir
    }

    fn open(
        &self,
        at: &OwnedFd,
        path: &Path,
        flags: OFlags,
        mode: Mode,
    ) -> std::io::Result<OwnedFd> {
        rustix::fs::openat2(at, path, flags | OFlags::CLOEXEC, mode, BENEATH).map_err(io)
    }

    /// Opens a regular file for reading. `O_NONBLOCK`: a pipe a tool put there does not
    /// hold the server's thread waiting for a writer; anything but a regular file is refused.
    pub fn file(&self, path: &Path) -> std::io::Result<std::fs::File> {
        let fd = self.open(
            &self.dir,
            path,
            OFlags::RDONLY | OFlags::NONBLOCK,
            Mode::empty(),
        )?;
        let stat = rustix::fs::fstat(&fd).map_err(io)?;
        if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(std::io::Error::other("it is not a regular file"));
        }
        Ok(fd.into())
    }

    /// Reads a regular file of at most `limit` bytes.
    pub fn read(&self, path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
        let file = self.file(path)?;
        if file.metadata()?.len() > limit {
            return Err(std::io::Error::other(format!(
                "it is larger than {limit} bytes"
            )));
        }
        let mut bytes = Vec::new();
        file.take(limit + 1).read_to_end(&mut bytes)?;
        if bytes.len() as u64 > limit {
            return Err(std::io::Error::other(format!(
                "it is larger than {limit} bytes"
            )));
        }
        Ok(bytes)
    }

    /// Writes a file whole (beside it, then renamed over it), creating its directories;
    /// what it creates belongs to `owner` when given.
    pub fn write(
        &self,
        path: &Path,
        bytes: &[u8],
        owner: Option<(u32, u32)>,
    ) -> std::io::Result<()> {
        let name = path
            .file_name()
            .ok_or_else(|| std::io::Error::other("the path names no file"))?;
        let mut dir = self.open(
            &self.dir,
            Path::new("."),
            OFlags::PATH | OFlags::DIRECTORY,
            Mode::empty(),
        )?;
        // Each directory is opened from the top, so a symlink that stays inside is fine and
        // the check is always against the working directory itself.
        let mut prefix = std::path::PathBuf::new();
        for part in path.parent().into_iter().flat_map(Path::components) {
            let Component::Normal(part) = part else {
                return Err(std::io::Error::other(
                    "the path is not a plain relative path",
                ));
            };
            match rustix::fs::mkdirat(&dir, part, Mode::from_raw_mode(0o755)) {
                Ok(()) => {
                    if let Some((uid, gid)) = owner {
                        chown_at(&dir, Path::new(part), uid, gid)?;
                    }
                }
                Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(io(e)),
            }
            prefix.push(part);
            dir = self.open(
                &self.dir,
                &prefix,
                OFlags::PATH | OFlags::DIRECTORY,
                Mode::empty(),
            )?;
        }
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!(".bedrock-{}", uuid::Uuid::now_v7().simple()));
        let temp = Path::new(&temp_name);
        let written = (|| {
            let fd = self.open(
                &dir,
                temp,
                // A name of its own, made here: whatever a tool put beside the file (a pipe
                // named like it, say) is never opened.
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW,
                Mode::from_raw_mode(0o644),
            )?;
            if let Some((uid, gid)) = owner {
                rustix::fs::fchown(
                    &fd,
                    Some(rustix::fs::Uid::from_raw(uid)),
                    Some(rustix::fs::Gid::from_raw(gid)),
                )
                .map_err(io)?;
            }
            let mut file = std::fs::File::from(fd);
            file.write_all(bytes)?;
            file.sync_data()?;
            rustix::fs::renameat(&dir, temp, &dir, name).map_err(io)
        })();
        if written.is_err() {
            let _ = rustix::fs::unlinkat(&dir, temp, rustix::fs::AtFlags::empty());
        }
        written
    }
}

fn chown_at(dir: &OwnedFd, name: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    rustix::fs::chownat(
        dir,
        name,
        Some(rustix::fs::Uid::from_raw(uid)),
        Some(rustix::fs::Gid::from_raw(gid)),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_leaves_the_directory() {
        let base = std::env::temp_dir().join(format!("bedrock-beneath-{}", std::process::id()));
        let cwd = base.join("cwd");
        std::fs::create_dir_all(cwd.join("sub")).expect("dirs");
        std::fs::write(base.join("outside.txt"), "outside").expect("written");
        std::os::unix::fs::symlink(base.join("outside.txt"), cwd.join("abs")).expect("link");
        std::os::unix::fs::symlink("../outside.txt", cwd.join("rel")).expect("link");
        std::os::unix::fs::symlink("..", cwd.join("sub/up")).expect("link");
        std::os::unix::fs::symlink("../sub", cwd.join("sub/inside")).expect("link");
        let beneath =
            Beneath::new(&crate::workspace::Pinned::trusted(&cwd).expect("opens")).expect("opens");
        for path in ["abs", "rel", "../outside.txt", "sub/up/../outside.txt"] {
            assert!(beneath.read(Path::new(path), 1 << 20).is_err(), "{path}");
        }
        // Writing over a symlink replaces the link in cwd, never its target outside.
        beneath
            .write(Path::new("rel"), b"x", None)
            .expect("replaces the link");
        assert!(
            beneath
                .write(Path::new("sub/up/../x.txt"), b"x", None)
                .is_err()
        );
        assert_eq!(
            std::fs::read_to_string(base.join("outside.txt")).expect("read"),
            "outside"
        );
        // Inside is fine, through a symlink that stays inside too.
        beneath
            .write(Path::new("sub/inside/new/file.txt"), b"hello", None)
            .expect("writes");
        assert_eq!(
            beneath
                .read(Path::new("sub/new/file.txt"), 1 << 20)
                .expect("reads"),
            b"hello"
        );
        let _ = std::fs::remove_dir_all(&base);
    }
}
