//! keyword_search: lines containing every word of a query, under cwd, honouring .gitignore.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde_json::{Map, Value};

use super::beneath::Beneath;
use super::{failed, preview, resolve_in};
use crate::state_machine::ToolOutcome;

/// Longest line shown, in bytes.
const LINE_PREVIEW: usize = 300;
/// Files larger than this are skipped.
const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;

pub fn search(
    cwd: &Path,
    input: &Map<String, Value>,
    max_results: usize,
    output_cap: usize,
) -> ToolOutcome {
    let Some(query) = input.get("query").and_then(Value::as_str) else {
        return failed("invalid arguments: `query` must be a string");
    };
    let words: Vec<String> = query.split_whitespace().map(str::to_lowercase).collect();
    if words.is_empty() {
        return failed("invalid arguments: `query` has no words");
    }
    let limit = match input.get("max_results") {
        None | Some(Value::Null) => max_results,
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => (n as usize).min(max_results),
            _ => return failed("invalid arguments: `max_results` must be a positive integer"),
        },
    };
    let root = match input.get("path").and_then(Value::as_str) {
        Some(path) => match resolve_in(cwd, path) {
            Ok(p) => p,
            Err(e) => return failed(e.to_string()),
        },
        None => match cwd.canonicalize() {
            Ok(p) => p,
            Err(e) => return failed(format!("cannot read the working directory: {e}")),
        },
    };
    let base = cwd.canonicalize().unwrap_or_else(|_| cwd.to_path_buf());
    // Files are opened beneath cwd by the kernel: one swapped for a symlink out after the
    // walk saw it is not read.
    let beneath = match Beneath::new(&base) {
        Ok(beneath) => beneath,
        Err(e) => return failed(format!("cannot read the working directory: {e}")),
    };
    let mut out = String::new();
    let mut found = 0usize;
    let walker = ignore::WalkBuilder::new(&root)
        .hidden(true)
        .git_ignore(true)
        .require_git(false)
        .follow_links(false)
        .build();
    'files: for entry in walker.flatten() {
        if !entry.file_type().is_some_and(|t| t.is_file()) {
            continue;
        }
        if entry
            .metadata()
            .map(|m| m.len() > MAX_FILE_BYTES)
            .unwrap_or(true)
        {
            continue;
        }
        let Ok(relative) = entry.path().strip_prefix(&base) else {
            continue;
        };
        let Ok(file) = beneath.file(relative) else {
            continue;
        };
        let mut reader = BufReader::new(file);
        // Skip binary files: a NUL in the first 8 KiB.
        let Ok(head) = reader.fill_buf() else {
            continue;
        };
        if head.iter().take(8192).any(|b| *b == 0) {
            continue;
        }
        let shown = entry
            .path()
            .strip_prefix(&base)
            .unwrap_or(entry.path())
            .display()
            .to_string();
        let mut bytes = Vec::new();
        if reader.read_to_end(&mut bytes).is_err() {
            continue;
        }
        let text = String::from_utf8_lossy(&bytes);
        for (number, line) in text.lines().enumerate() {
            let lower = line.to_lowercase();
            if words.iter().all(|w| lower.contains(w.as_str())) {
                let row = format!(
                    "{shown}:{}: {}\n",
                    number + 1,
                    preview(line.trim_end(), LINE_PREVIEW)
                );
                if out.len() + row.len() > output_cap {
                    out.push_str("[output cut at the size limit]\n");
                    break 'files;
                }
                out.push_str(&row);
                found += 1;
                if found >= limit {
                    out.push_str(&format!("[stopped at {limit} results]\n"));
                    break 'files;
                }
            }
        }
    }
    if found == 0 {
        out = format!("no lines match {query:?}");
    }
    ToolOutcome {
        ok: true,
        output: out,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn finds_lines_and_honours_gitignore() {
        let cwd = std::env::temp_dir().join(format!("bedrock-search-{}", std::process::id()));
        std::fs::create_dir_all(cwd.join("src")).expect("a temp dir");
        std::fs::write(cwd.join(".gitignore"), "ignored.txt\n").expect("gitignore");
        std::fs::write(cwd.join("src/a.rs"), "fn main() {}\nlet Alpha = beta;\n").expect("a file");
        std::fs::write(cwd.join("ignored.txt"), "alpha beta\n").expect("a file");
        let input = json!({"query": "alpha BETA"});
        let outcome = search(&cwd, input.as_object().expect("an object"), 10, 10_000);
        assert!(outcome.ok);
        assert_eq!(outcome.output, "src/a.rs:2: let Alpha = beta;\n");
        let none = search(
            &cwd,
            json!({"query": "zzz"}).as_object().expect("an object"),
            10,
            10_000,
        );
        assert_eq!(none.output, "no lines match \"zzz\"");
        let escape = search(
            &cwd,
            json!({"query": "a", "path": "../.."})
                .as_object()
                .expect("an object"),
            10,
            10_000,
        );
        assert!(!escape.ok);
        let _ = std::fs::remove_dir_all(&cwd);
    }
}
