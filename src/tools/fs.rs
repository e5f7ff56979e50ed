//! Path confinement: a path a tool is given must stay under the conversation's cwd. Its
//! spelling is checked here (`..`); links are the kernel's to refuse, at the moment of each
//! open beneath the cwd's descriptor (beneath.rs).

use std::path::{Path, PathBuf};

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path {0:?} leaves the working directory")]
    Escapes(String),
    #[error("the path {0:?} is empty")]
    Empty(String),
}

/// `path` (relative to `cwd`, or absolute inside it) as a plain relative path under `cwd`,
/// by its spelling alone: `..` that would leave `cwd` is refused here, with a clear message.
/// Nothing is looked up: opening the result beneath `cwd`'s descriptor
/// ([`Beneath`](super::beneath::Beneath)) is what keeps links from leading out. An empty
/// result is `cwd` itself.
pub fn relative_in(cwd: &Path, path: &str) -> Result<PathBuf, PathError> {
    if path.trim().is_empty() {
        return Err(PathError::Empty(path.to_owned()));
    }
    crate::workspace::plain_relative(cwd, Path::new(path))
        .ok_or_else(|| PathError::Escapes(path.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_by_their_spelling() {
        let cwd = Path::new("/ws/t/c");
        assert_eq!(relative_in(cwd, "a/./b/../c"), Ok(PathBuf::from("a/c")));
        assert_eq!(relative_in(cwd, "/ws/t/c/x"), Ok(PathBuf::from("x")));
        assert_eq!(relative_in(cwd, "."), Ok(PathBuf::new()));
        for bad in ["..", "a/../../b", "/ws/t/other", "/etc/passwd"] {
            assert!(
                matches!(relative_in(cwd, bad), Err(PathError::Escapes(_))),
                "{bad}"
            );
        }
        assert!(matches!(relative_in(cwd, " "), Err(PathError::Empty(_))));
    }
}
