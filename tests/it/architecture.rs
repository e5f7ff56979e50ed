//! Architecture invariants that the compiler does not check (README, "Architecture
//! invariants"). These read the source tree, so they live here and not in the core.

use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("a readable source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
    files
}

/// The core stays pure: no I/O crate, no clock, no fresh ids (style.md, habit 1). Its own
/// tests are included: they drive the core with fixed times and ids too.
#[test]
fn boundary_the_core_imports_no_io_crate() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/state_machine");
    let forbidden = [
        "tokio",
        "ractor",
        "axum",
        "sea_orm",
        "async_openai",
        "reqwest",
        "std::time::SystemTime",
        "std::time::Instant",
        "Instant::now",
        "SystemTime::now",
        "Utc::now",
        "Uuid::now_v7",
        "Uuid::new_v4",
        "std::fs",
        "std::net",
        "std::process",
        "std::env",
        "rand::",
    ];
    let files = rust_files(&dir);
    assert!(
        files.len() >= 9,
        "expected the core's files, found {files:?}"
    );
    for path in files {
        let text = std::fs::read_to_string(&path).expect("a source file");
        for (line_no, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            for needle in forbidden {
                assert!(
                    !code.contains(needle),
                    "{}:{}: the pure core must not use `{needle}`",
                    path.display(),
                    line_no + 1
                );
            }
        }
    }
}

/// The bidirectional-streaming architecture document (issue 23): named as the seed says,
/// `(u64::MAX - nanotime)_bidirectional-streaming.md` (a time of 2026 or later), and every
/// Rust example in it is code of the source or test file named just before it, so the
/// examples compile and run with the suite.
#[test]
fn architecture_doc_examples_are_tested() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("docs/architecture");
    let doc = std::fs::read_dir(&dir)
        .expect("docs/architecture")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with("_bidirectional-streaming.md"))
        })
        .expect("the bidirectional-streaming document");
    let name = doc.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let number: u64 = name
        .split('_')
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a decimal number before the name");
    let nanotime = u64::MAX - number;
    // 2026-01-01 to 2100-01-01, in nanoseconds since the epoch.
    assert!(
        (1_767_225_600_000_000_000..4_102_444_800_000_000_000).contains(&nanotime),
        "{name}: not u64::MAX minus a time in nanoseconds"
    );
    let text = std::fs::read_to_string(&doc).expect("the document");
    let mut examples = 0;
    let mut rest = text.as_str();
    while let Some(start) = rest.find("```rust\n") {
        let before = &rest[..start];
        let body_start = start + "```rust\n".len();
        let end = rest[body_start..].find("```").expect("a closed block") + body_start;
        let code = &rest[body_start..end];
        // The file named last before the block.
        let file = before
            .split(|c: char| c.is_whitespace() || c == '(' || c == ')' || c == ',')
            .rfind(|w| w.ends_with(".rs") && (w.starts_with("tests/") || w.starts_with("src/")))
            .expect("a source or test file named before the example");
        let source = std::fs::read_to_string(root.join(file)).expect("the named file");
        assert!(
            source.contains(code.trim_end()),
            "an example of {name} is not in {file}:\n{code}"
        );
        examples += 1;
        rest = &rest[end + 3..];
    }
    assert!(examples >= 3, "the document shows its examples");
}
