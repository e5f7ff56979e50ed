//! keyword_search: lines containing every word of a query, under cwd, honouring .gitignore.

use std::ffi::OsStr;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use ignore::gitignore::{Gitignore, GitignoreBuilder};
use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, ResolveFlags};
use serde_json::{Map, Value};

use super::beneath::Beneath;
use super::{failed, preview, relative_in};
use crate::state_machine::ToolOutcome;
use crate::workspace::Pinned;

/// Longest line shown, in bytes.
const LINE_PREVIEW: usize = 300;
/// Files larger than this are skipped.
const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// The most files one search reads, and the deepest directory it enters (each level holds
/// a descriptor).
const MAX_FILES: usize = 100_000;
const MAX_DEPTH: usize = 64;
/// Ignore files larger than this are not read.
const MAX_IGNORE_BYTES: u64 = 1024 * 1024;

/// Searches the files under the directory `cwd` was opened as, by descriptor: every
/// directory and file is opened relative to its parent without following a link, so a
/// directory swapped for a link while the search runs (by a background task of the same
/// conversation, or another conversation sharing the tree) cannot lead it out. Links are
/// not followed, hidden files are skipped, `.gitignore` and `.ignore` are honoured.
pub fn search(
    cwd: &Pinned,
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
    let start = match input.get("path").and_then(Value::as_str) {
        Some(path) => match relative_in(cwd.path(), path) {
            Ok(p) => p,
            Err(e) => return failed(e.to_string()),
        },
        None => PathBuf::new(),
    };
    let beneath = match Beneath::new(cwd) {
        Ok(beneath) => beneath,
        Err(e) => return failed(format!("cannot read the working directory: {e}")),
    };
    let mut search = Search {
        words,
        limit,
        output_cap,
        out: String::new(),
        found: 0,
        files: 0,
        ignores: Vec::new(),
        base: cwd.path().to_owned(),
    };
    // The ignore files of the directories from cwd down to the start apply too.
    let mut prefix = PathBuf::new();
    for part in std::iter::once(None).chain(
        start
            .parent()
            .into_iter()
            .flat_map(|p| p.components().map(Some)),
    ) {
        if let Some(part) = part {
            prefix.push(part);
        }
        if let Ok(dir) = open_beneath(&beneath, &prefix, OFlags::RDONLY | OFlags::DIRECTORY) {
            search.load_ignores(&dir, &prefix);
        }
    }
    let opened = open_beneath(&beneath, &start, OFlags::RDONLY | OFlags::NONBLOCK);
    let fd = match opened {
        Ok(fd) => fd,
        Err(e) => return failed(format!("cannot read {}: {e}", shown(&start))),
    };
    let kind = match rustix::fs::fstat(&fd) {
        Ok(stat) => FileType::from_raw_mode(stat.st_mode),
        Err(e) => return failed(format!("cannot read {}: {e}", shown(&start))),
    };
    let _ = match kind {
        FileType::Directory => search.dir(&fd, &start, 0),
        FileType::RegularFile => search.file(fd, &start),
        FileType::Symlink
        | FileType::Fifo
        | FileType::Socket
        | FileType::CharacterDevice
        | FileType::BlockDevice
        | FileType::Unknown => {
            return failed(format!("{} is not a file or a directory", shown(&start)));
        }
    };
    if search.found == 0 {
        search.out = format!("no lines match {query:?}");
    }
    ToolOutcome {
        ok: true,
        output: search.out,
    }
}

fn shown(path: &Path) -> String {
    if path.as_os_str().is_empty() {
        ".".to_owned()
    } else {
        path.display().to_string()
    }
}

/// Opens `path` beneath the working directory (links that stay inside are followed).
fn open_beneath(beneath: &Beneath, path: &Path, flags: OFlags) -> std::io::Result<OwnedFd> {
    let path = if path.as_os_str().is_empty() {
        Path::new(".")
    } else {
        path
    };
    rustix::fs::openat2(
        beneath.dir(),
        path,
        flags | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| {
        if e == rustix::io::Errno::XDEV {
            std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "the path leaves the working directory",
            )
        } else {
            e.into()
        }
    })
}

/// Stopped: the result limit, the output cap or the file limit was reached.
struct Stop;

struct Search {
    words: Vec<String>,
    limit: usize,
    output_cap: usize,
    out: String,
    found: usize,
    files: usize,
    /// The ignore rules of the directories being walked, outermost first.
    ignores: Vec<Gitignore>,
    /// The working directory's path: the ignore rules' paths are under it.
    base: PathBuf,
}

impl Search {
    /// Reads `.gitignore` and `.ignore` of the open directory `dir` (at `rel`), never
    /// through a link.
    fn load_ignores(&mut self, dir: &OwnedFd, rel: &Path) -> bool {
        let root = self.base.join(rel);
        let mut builder = GitignoreBuilder::new(&root);
        let mut any = false;
        for name in [".gitignore", ".ignore"] {
            let Ok(fd) = rustix::fs::openat(
                dir,
                name,
                OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                Mode::empty(),
            ) else {
                continue;
            };
            let Ok(stat) = rustix::fs::fstat(&fd) else {
                continue;
            };
            if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
                continue;
            }
            let mut text = String::new();
            if std::fs::File::from(fd)
                .take(MAX_IGNORE_BYTES)
                .read_to_string(&mut text)
                .is_err()
            {
                continue;
            }
            for line in text.lines() {
                any |= builder.add_line(None, line).is_ok();
            }
        }
        if any && let Ok(rules) = builder.build() {
            self.ignores.push(rules);
            return true;
        }
        false
    }

    /// Whether `rel` is ignored: the innermost rule that says something decides.
    fn ignored(&self, rel: &Path, is_dir: bool) -> bool {
        let full = self.base.join(rel);
        for rules in self.ignores.iter().rev() {
            let matched = rules.matched(&full, is_dir);
            if matched.is_ignore() {
                return true;
            }
            if matched.is_whitelist() {
                return false;
            }
        }
        false
    }

    fn dir(&mut self, dir: &OwnedFd, rel: &Path, depth: usize) -> Result<(), Stop> {
        if depth > MAX_DEPTH {
            return Ok(());
        }
        let pushed = self.load_ignores(dir, rel);
        let result = self.entries(dir, rel, depth);
        if pushed {
            self.ignores.pop();
        }
        result
    }

    fn entries(&mut self, dir: &OwnedFd, rel: &Path, depth: usize) -> Result<(), Stop> {
        let Ok(mut listing) = Dir::read_from(dir) else {
            return Ok(());
        };
        let mut names = Vec::new();
        while let Some(Ok(entry)) = listing.read() {
            let name = entry.file_name().to_bytes();
            if name.first() != Some(&b'.') {
                names.push(name.to_vec());
            }
        }
        names.sort();
        for name in names {
            let name = OsStr::from_bytes(&name);
            let here = rel.join(name);
            let Ok(stat) = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) else {
                continue;
            };
            match FileType::from_raw_mode(stat.st_mode) {
                FileType::Directory => {
                    if self.ignored(&here, true) {
                        continue;
                    }
                    // Directories count too: a tree of empty ones is work as well.
                    self.files += 1;
                    if self.files > MAX_FILES {
                        self.out.push_str(&format!(
                            "[stopped after {MAX_FILES} files and directories]\n"
                        ));
                        return Err(Stop);
                    }
                    let flags =
                        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                    if let Ok(sub) = rustix::fs::openat(dir, name, flags, Mode::empty()) {
                        self.dir(&sub, &here, depth + 1)?;
                    }
                }
                FileType::RegularFile => {
                    if self.ignored(&here, false) {
                        continue;
                    }
                    // O_NONBLOCK: should it have become a pipe, opening it does not wait.
                    let flags =
                        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
                    if let Ok(file) = rustix::fs::openat(dir, name, flags, Mode::empty()) {
                        self.file(file, &here)?;
                    }
                }
                // Links are not followed; pipes, sockets and devices are not read.
                FileType::Symlink
                | FileType::Fifo
                | FileType::Socket
                | FileType::CharacterDevice
                | FileType::BlockDevice
                | FileType::Unknown => {}
            }
        }
        Ok(())
    }

    /// Searches one open file (checked again on its descriptor: a regular file, not too big).
    fn file(&mut self, fd: OwnedFd, rel: &Path) -> Result<(), Stop> {
        self.files += 1;
        if self.files > MAX_FILES {
            self.out
                .push_str(&format!("[stopped after reading {MAX_FILES} files]\n"));
            return Err(Stop);
        }
        let Ok(stat) = rustix::fs::fstat(&fd) else {
            return Ok(());
        };
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile
            || u64::try_from(stat.st_size).unwrap_or(u64::MAX) > MAX_FILE_BYTES
        {
            return Ok(());
        }
        let mut bytes = Vec::new();
        if std::fs::File::from(fd)
            .take(MAX_FILE_BYTES)
            .read_to_end(&mut bytes)
            .is_err()
        {
            return Ok(());
        }
        // Skip binary files: a NUL in the first 8 KiB.
        if bytes.iter().take(8192).any(|b| *b == 0) {
            return Ok(());
        }
        let shown = shown(rel);
        let text = String::from_utf8_lossy(&bytes);
        for (number, line) in text.lines().enumerate() {
            let lower = line.to_lowercase();
            if self.words.iter().all(|w| lower.contains(w.as_str())) {
                let row = format!(
                    "{shown}:{}: {}\n",
                    number + 1,
                    preview(line.trim_end(), LINE_PREVIEW)
                );
                if self.out.len() + row.len() > self.output_cap {
                    self.out.push_str("[output cut at the size limit]\n");
                    return Err(Stop);
                }
                self.out.push_str(&row);
                self.found += 1;
                if self.found >= self.limit {
                    self.out
                        .push_str(&format!("[stopped at {} results]\n", self.limit));
                    return Err(Stop);
                }
            }
        }
        Ok(())
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
        let pinned = Pinned::trusted(&cwd).expect("opens");
        let cwd = pinned;
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
        let _ = std::fs::remove_dir_all(cwd.path());
    }

    /// A link is never followed, not even one inside; a path into one is refused when it
    /// leads out; ignore rules of the directories above the start apply.
    #[test]
    fn links_are_not_followed() {
        let base = std::env::temp_dir().join(format!(
            "bedrock-search-links-{}-{}",
            std::process::id(),
            uuid::Uuid::now_v7()
        ));
        let cwd = base.join("cwd");
        std::fs::create_dir_all(cwd.join("src/skip")).expect("dirs");
        std::fs::create_dir_all(base.join("outside")).expect("dirs");
        std::fs::write(base.join("outside/secret"), "needle outside\n").expect("a file");
        std::fs::write(cwd.join("src/a.txt"), "needle inside\n").expect("a file");
        std::fs::write(cwd.join("src/skip/b.txt"), "needle skipped\n").expect("a file");
        std::fs::write(cwd.join(".gitignore"), "skip/\n").expect("ignore rules");
        std::os::unix::fs::symlink(base.join("outside"), cwd.join("out")).expect("a link");
        std::os::unix::fs::symlink("src", cwd.join("again")).expect("a link");
        let pinned = Pinned::trusted(&cwd).expect("opens");
        let run = |input: Value| search(&pinned, input.as_object().expect("an object"), 10, 10_000);
        let all = run(json!({"query": "needle"}));
        assert_eq!(all.output, "src/a.txt:1: needle inside\n", "{all:?}");
        let within = run(json!({"query": "needle", "path": "src"}));
        assert_eq!(within.output, "src/a.txt:1: needle inside\n", "{within:?}");
        let through = run(json!({"query": "needle", "path": "out"}));
        assert!(
            !through.ok && through.output.contains("leaves the working directory"),
            "{through:?}"
        );
        let _ = std::fs::remove_dir_all(&base);
    }
}
