//! Conversation workspaces on disk: the copy a fork makes of its source's directory.
//!
//! The source is the tool processes' to change while it is copied, and the copy runs with
//! the server's rights: so it never follows a symbolic link. It walks by file descriptor:
//! every directory and file is opened relative to its parent with `O_NOFOLLOW`, and a file
//! is copied from the descriptor it was checked on (a regular file), so an entry swapped for
//! a link between the listing and the copy cannot lead it outside the source. Links are
//! copied as links. The byte and entry limits are counted while copying.

use std::ffi::{CStr, OsStr};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags};

/// The most entries (files, directories, links) one copy makes.
pub const MAX_ENTRIES: u64 = 200_000;

/// Why a workspace was not copied.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("the workspace holds more than {limit} bytes of files (a fork copies at most that)")]
    TooLarge { limit: u64 },
    #[error("the workspace holds more than {MAX_ENTRIES} files and directories")]
    TooManyEntries,
    #[error("the source workspace {} does not exist", .0.display())]
    SourceMissing(PathBuf),
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

struct Copy {
    limit: u64,
    bytes: u64,
    entries: u64,
    /// The target directory, skipped should it lie inside the source.
    target: (u64, u64),
}

fn io_at(path: &Path) -> impl FnOnce(rustix::io::Errno) -> CopyError + '_ {
    move |errno| CopyError::Io {
        path: path.to_owned(),
        source: errno.into(),
    }
}

/// Copies the directory tree `from` to `to` (which must not exist yet; its parent is
/// created): directories, regular files (as reflinks where the filesystem has them, else
/// plain copies) and symbolic links as links, never followed. Sockets, pipes and devices
/// are left out. Past `limit` bytes of files or [`MAX_ENTRIES`] entries the copy stops and
/// what it made is removed. Returns the bytes copied. Blocking: run it off the async
/// threads.
pub fn copy_tree(from: &Path, to: &Path, limit: u64) -> Result<u64, CopyError> {
    let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let source = match rustix::fs::open(from, dir_flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Err(CopyError::SourceMissing(from.to_owned())),
        Err(errno) => return Err(io_at(from)(errno)),
    };
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent).map_err(|source| CopyError::Io {
            path: parent.to_owned(),
            source,
        })?;
    }
    rustix::fs::mkdir(to, Mode::from_raw_mode(0o755)).map_err(io_at(to))?;
    let copied = (|| {
        let target =
            rustix::fs::open(to, dir_flags | OFlags::NOFOLLOW, Mode::empty()).map_err(io_at(to))?;
        let stat = rustix::fs::fstat(&target).map_err(io_at(to))?;
        let mut copy = Copy {
            limit,
            bytes: 0,
            entries: 0,
            target: (stat.st_dev, stat.st_ino),
        };
        copy.dir(&source, &target, from)?;
        Ok(copy.bytes)
    })();
    if copied.is_err() {
        let _ = std::fs::remove_dir_all(to);
    }
    copied
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
                self.dir(&source, &target, here)
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
        rustix::fs::symlinkat(link.as_c_str(), to, name).map_err(io_at(here))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_missing_source_is_said_so() {
        let root = scratch("missing");
        match copy_tree(&root.join("gone"), &root.join("to"), 1 << 20) {
            Err(CopyError::SourceMissing(_)) => {}
            other => panic!("expected SourceMissing, got {other:?}"),
        }
        std::fs::remove_dir_all(root).ok();
    }
}
