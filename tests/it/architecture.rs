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
