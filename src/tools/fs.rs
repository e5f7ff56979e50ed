//! Path confinement: a path a tool is given must stay under the conversation's cwd, through
//! `..` and through symlinks.

use std::path::{Component, Path, PathBuf};

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path {0:?} leaves the working directory")]
    Escapes(String),
    #[error("the path {0:?} is empty")]
    Empty(String),
    #[error("the working directory {0} cannot be read: {1}")]
    Cwd(String, String),
}

/// Resolves `path` (relative to `cwd`, or absolute inside it) to a path under `cwd`, refusing
/// any that leaves it lexically (`..`) or through a symlink. The path itself need not exist.
pub fn resolve_in(cwd: &Path, path: &str) -> Result<PathBuf, PathError> {
    if path.trim().is_empty() {
        return Err(PathError::Empty(path.to_owned()));
    }
    let root = cwd
        .canonicalize()
        .map_err(|e| PathError::Cwd(cwd.display().to_string(), e.to_string()))?;
    let given = Path::new(path);
    let joined = if given.is_absolute() {
        given.to_path_buf()
    } else {
        cwd.join(given)
    };
    // Lexical normalisation first, so `a/../../x` is refused before touching the disk.
    let mut normal = PathBuf::new();
    for component in joined.components() {
        match component {
            Component::ParentDir => {
                if !normal.pop() {
                    return Err(PathError::Escapes(path.to_owned()));
                }
            }
            Component::CurDir => {}
            Component::Prefix(_) | Component::RootDir | Component::Normal(_) => {
                normal.push(component)
            }
        }
    }
    // Then resolve symlinks in the longest part that exists.
    let mut existing = normal.as_path();
    let mut rest = Vec::new();
    let resolved = loop {
        match existing.canonicalize() {
            Ok(real) => break real,
            Err(_) => match (existing.parent(), existing.file_name()) {
                (Some(parent), Some(name)) => {
                    rest.push(name.to_owned());
                    existing = parent;
                }
                _ => return Err(PathError::Escapes(path.to_owned())),
            },
        }
    };
    let mut full = resolved;
    for name in rest.into_iter().rev() {
        full.push(name);
    }
    let canonical_cwd = cwd.canonicalize().unwrap_or(root);
    if full.starts_with(&canonical_cwd) {
        Ok(full)
    } else {
        Err(PathError::Escapes(path.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_under_cwd() {
        let dir = std::env::temp_dir().join(format!("bedrock-fs-{}", std::process::id()));
        let cwd = dir.join("cwd");
        std::fs::create_dir_all(cwd.join("sub")).expect("a temp dir");
        std::fs::write(dir.join("secret"), "x").expect("a file outside");
        let _ = std::fs::remove_file(cwd.join("link"));
        std::os::unix::fs::symlink(dir.join("secret"), cwd.join("link")).expect("a symlink");
        let real = cwd.canonicalize().expect("canonical cwd");

        assert_eq!(
            resolve_in(&cwd, "sub/new.txt"),
            Ok(real.join("sub/new.txt"))
        );
        assert_eq!(resolve_in(&cwd, "./sub/../a"), Ok(real.join("a")));
        assert!(matches!(
            resolve_in(&cwd, "../secret"),
            Err(PathError::Escapes(_))
        ));
        assert!(matches!(
            resolve_in(&cwd, "sub/../../secret"),
            Err(PathError::Escapes(_))
        ));
        assert!(matches!(
            resolve_in(&cwd, "link"),
            Err(PathError::Escapes(_))
        ));
        assert!(matches!(
            resolve_in(&cwd, "/etc/passwd"),
            Err(PathError::Escapes(_))
        ));
        assert!(matches!(resolve_in(&cwd, ""), Err(PathError::Empty(_))));
        let inside = real.join("sub").display().to_string();
        assert_eq!(resolve_in(&cwd, &inside), Ok(real.join("sub")));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
