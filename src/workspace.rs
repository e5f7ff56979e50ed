//! Conversation workspaces on disk: the copy a fork makes of its source's directory.

use std::io;
use std::path::{Path, PathBuf};

/// Why a workspace was not copied.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("the workspace holds {size} bytes of files; a fork copies at most {limit}")]
    TooLarge { size: u64, limit: u64 },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
}

fn at(path: &Path) -> impl FnOnce(io::Error) -> CopyError + '_ {
    move |source| CopyError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Copies the directory tree `from` to `to` (which must not exist yet): directories,
/// regular files (as reflinks where the filesystem has them, else plain copies) and
/// symbolic links as links, never followed. Sockets, pipes and devices are left out. The
/// files are measured first: more than `limit` bytes in all and nothing is copied.
/// Returns the bytes copied. Blocking: run it off the async threads.
pub fn copy_tree(from: &Path, to: &Path, limit: u64) -> Result<u64, CopyError> {
    let walk = || {
        ignore::WalkBuilder::new(from)
            .standard_filters(false)
            .follow_links(false)
            .build()
    };
    let mut size = 0u64;
    for entry in walk() {
        let entry = entry.map_err(|e| CopyError::Io {
            path: from.to_owned(),
            source: io::Error::other(e),
        })?;
        if entry.file_type().is_some_and(|kind| kind.is_file()) {
            let meta = entry.metadata().map_err(|e| CopyError::Io {
                path: entry.path().to_owned(),
                source: io::Error::other(e),
            })?;
            size = size.saturating_add(meta.len());
            if size > limit {
                return Err(CopyError::TooLarge { size, limit });
            }
        }
    }
    std::fs::create_dir(to).map_err(at(to))?;
    for entry in walk() {
        let entry = entry.map_err(|e| CopyError::Io {
            path: from.to_owned(),
            source: io::Error::other(e),
        })?;
        let source = entry.path();
        let Ok(relative) = source.strip_prefix(from) else {
            continue;
        };
        if relative.as_os_str().is_empty() {
            continue; // the root itself
        }
        let target = to.join(relative);
        let Some(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            std::fs::create_dir(&target).map_err(at(&target))?;
        } else if kind.is_file() {
            reflink_copy::reflink_or_copy(source, &target).map_err(at(&target))?;
        } else if kind.is_symlink() {
            let link = std::fs::read_link(source).map_err(at(source))?;
            std::os::unix::fs::symlink(link, &target).map_err(at(&target))?;
        }
    }
    Ok(size)
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
            Err(CopyError::TooLarge { size, limit }) => assert_eq!((size, limit), (2048, 1024)),
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert!(!to.exists());
        std::fs::remove_dir_all(root).ok();
    }
}
