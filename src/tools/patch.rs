//! The patch tool: exact-text edits of one file under cwd.

use std::path::Path;

use serde_json::{Map, Value};

use super::{failed, resolve_in};
use crate::state_machine::ToolOutcome;

/// Applies `{"path", "edits": [{"old_text", "new_text"}]}`.
/// `owner`: who the file and directories it writes belong to (the sandbox's tool user when
/// the server runs as root).
pub fn apply(cwd: &Path, input: &Map<String, Value>, owner: Option<(u32, u32)>) -> ToolOutcome {
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
    let file = match resolve_in(cwd, path) {
        Ok(file) => file,
        Err(e) => return failed(e.to_string()),
    };
    let mut text = match std::fs::read_to_string(&file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // A new file: one edit with an empty old_text.
            if let [("", new)] = pairs.as_slice() {
                return write(cwd, &file, new, path, "created", owner);
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
    write(cwd, &file, &text, path, "edited", owner)
}

fn write(
    cwd: &Path,
    file: &Path,
    text: &str,
    shown: &str,
    what: &str,
    owner: Option<(u32, u32)>,
) -> ToolOutcome {
    if let Some(dir) = file.parent()
        && !dir.exists()
    {
        if let Err(e) = std::fs::create_dir_all(dir) {
            return failed(format!("cannot create the directory of {shown}: {e}"));
        }
        // The new directories belong to the tool user too.
        if let Some((uid, gid)) = owner {
            let mut at = Some(dir);
            while let Some(d) = at.filter(|d| d.starts_with(cwd) && *d != cwd) {
                let _ = std::os::unix::fs::lchown(d, Some(uid), Some(gid));
                at = d.parent();
            }
        }
    }
    // Write beside and rename, so a crash never leaves half a file.
    let temp = file.with_extension(format!(
        "{}.bedrock-tmp",
        file.extension()
            .and_then(|e| e.to_str())
            .unwrap_or_default()
    ));
    let written = std::fs::write(&temp, text).and_then(|()| match owner {
        Some((uid, gid)) => std::os::unix::fs::lchown(&temp, Some(uid), Some(gid)),
        None => Ok(()),
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&temp, file)) {
        let _ = std::fs::remove_file(&temp);
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
        let created = apply(
            &cwd,
            &input(
                json!({"path": "a/f.txt", "edits": [{"old_text": "", "new_text": "one two one"}]}),
            ),
            None,
        );
        assert!(created.ok, "{created:?}");
        let twice = apply(
            &cwd,
            &input(json!({"path": "a/f.txt", "edits": [{"old_text": "one", "new_text": "1"}]})),
            None,
        );
        assert!(
            !twice.ok && twice.output.contains("occurs 2 times"),
            "{twice:?}"
        );
        let edited = apply(
            &cwd,
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
            &cwd,
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
