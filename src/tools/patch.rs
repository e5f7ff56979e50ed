//! The patch tool: exact-text edits of one file under cwd.

use std::path::Path;

use serde_json::{Map, Value};

use super::beneath::Beneath;
use super::{failed, relative_in};
use crate::state_machine::ToolOutcome;
use crate::workspace::Pinned;

/// The largest file patch edits: it holds the file in memory, in the server.
const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// Applies `{"path", "edits": [{"old_text", "new_text"}]}`.
/// `owner`: who the file and directories it writes belong to (the sandbox's tool user when
/// the server runs as root).
pub fn apply(cwd: &Pinned, input: &Map<String, Value>, owner: Option<(u32, u32)>) -> ToolOutcome {
    let Some(path) = input.get("path").and_then(Value::as_str) else {
        return failed("invalid arguments: `path` must be a string");
    };
    let Some(edits) = input.get("edits").and_then(Value::as_array) else {
        return failed("invalid arguments: `edits` must be an array of {old_text, new_text}");
    };
    if edits.is_empty() {
        return failed("invalid arguments: `edits` is empty");
    }
    let mut pairs = Vec::with_capacity(edits.len());
    for (i, edit) in edits.iter().enumerate() {
        match (
            edit.get("old_text").and_then(Value::as_str),
            edit.get("new_text").and_then(Value::as_str),
        ) {
            (Some(old), Some(new)) => pairs.push((old, new)),
            _ => {
                return failed(format!(
                    "invalid arguments: edits[{i}] needs string `old_text` and `new_text`"
                ));
            }
        }
    }
    // relative_in explains a path that leaves cwd by its spelling; the reads and writes
    // themselves are made beneath cwd by the kernel, so a link (or a tree changed meanwhile)
    // cannot lead out either.
    let file = match relative_in(cwd.path(), path) {
        Ok(file) => file,
        Err(e) => return failed(e.to_string()),
    };
    let beneath = match Beneath::new(cwd) {
        Ok(beneath) => beneath,
        Err(e) => return failed(format!("cannot open the working directory: {e}")),
    };
    let read = beneath
        .read(&file, MAX_FILE_BYTES)
        .and_then(|bytes| String::from_utf8(bytes).map_err(std::io::Error::other));
    let mut text = match read {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // A new file: one edit with an empty old_text.
            if let [("", new)] = pairs.as_slice() {
                return write(&beneath, &file, new, path, "created", owner);
            }
            return failed(format!(
                "{path} does not exist (to create it, use one edit with an empty old_text)"
            ));
        }
        Err(e) => return failed(format!("cannot read {path}: {e}")),
    };
    for (i, (old, new)) in pairs.iter().enumerate() {
        if old.is_empty() {
            return failed(format!("edits[{i}]: old_text is empty but {path} exists"));
        }
        match text.matches(old).count() {
            1 => text = text.replacen(old, new, 1),
            0 => {
                return failed(format!(
                    "edits[{i}]: old_text not found in {path}; nothing was changed"
                ));
            }
            n => {
                return failed(format!(
                    "edits[{i}]: old_text occurs {n} times in {path}; give more context so it is unique. Nothing was changed"
                ));
            }
        }
    }
    write(&beneath, &file, &text, path, "edited", owner)
}

fn write(
    beneath: &Beneath,
    file: &Path,
    text: &str,
    shown: &str,
    what: &str,
    owner: Option<(u32, u32)>,
) -> ToolOutcome {
    // Written beside and renamed, so a crash never leaves half a file.
    if let Err(e) = beneath.write(file, text.as_bytes(), owner) {
        return failed(format!("cannot write {shown}: {e}"));
    }
    ToolOutcome {
        ok: true,
        output: format!("{what} {shown}"),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn input(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn edits_create_and_refuse() {
        let cwd = std::env::temp_dir().join(format!("bedrock-patch-{}", std::process::id()));
        std::fs::create_dir_all(&cwd).expect("a temp dir");
        let pinned = Pinned::trusted(&cwd).expect("opens");
        let created = apply(
            &pinned,
            &input(
                json!({"path": "a/f.txt", "edits": [{"old_text": "", "new_text": "one two one"}]}),
            ),
            None,
        );
        assert!(created.ok, "{created:?}");
        let twice = apply(
            &pinned,
            &input(json!({"path": "a/f.txt", "edits": [{"old_text": "one", "new_text": "1"}]})),
            None,
        );
        assert!(
            !twice.ok && twice.output.contains("occurs 2 times"),
            "{twice:?}"
        );
        let edited = apply(
            &pinned,
            &input(
                json!({"path": "a/f.txt", "edits": [{"old_text": "two", "new_text": "2"}, {"old_text": "2 one", "new_text": "2 1"}]}),
            ),
            None,
        );
        assert!(edited.ok, "{edited:?}");
        assert_eq!(
            std::fs::read_to_string(cwd.join("a/f.txt")).expect("the file"),
            "one 2 1"
        );
        let escape = apply(
            &pinned,
            &input(json!({"path": "../x", "edits": [{"old_text": "", "new_text": "x"}]})),
            None,
        );
        assert!(
            !escape.ok && escape.output.contains("leaves the working directory"),
            "{escape:?}"
        );
        let _ = std::fs::remove_dir_all(&cwd);
    }
}
