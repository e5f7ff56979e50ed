//! Architecture invariants that the compiler does not check (README, "Architecture
//! invariants"). These read the source tree, so they live here and not in the core.

use std::collections::{BTreeMap, BTreeSet};
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

/// A source file's code without its comments (`//` to the end of a line), joined so that an
/// import split over lines reads as one.
fn code_of(path: &Path) -> String {
    std::fs::read_to_string(path)
        .expect("a source file")
        .lines()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The names a path that starts with `prefix` (`crate::`, `super::`, `crate::api::`) reaches
/// first in `code`: `prefix x::...` gives `x`, `prefix {x, y::z}` gives `x` and `y`.
fn reached(code: &str, prefix: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.trim()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut names = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        // Not the tail of a longer path (`foo::crate::` does not occur; `self::super::` does not
        // matter): the prefix begins a path.
        let before = rest[..at].chars().next_back();
        rest = &rest[at + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            names.extend(group[..end].split(',').map(ident));
        } else {
            names.insert(ident(rest));
        }
    }
    names.retain(|n| !n.is_empty());
    names
}

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The import graph between the modules directly under `src/<dir>` (`dir` empty: the
/// crate's top-level modules). A module is a file or a directory; it reaches a sibling
/// through `crate::<dir>::x` anywhere in it, or `super::x` in a file directly under `dir`.
fn module_graph(dir: &str) -> Graph {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(dir);
    let mut files: BTreeMap<String, Vec<(PathBuf, bool)>> = BTreeMap::new();
    for entry in std::fs::read_dir(&root).expect("a source directory") {
        let path = entry.expect("a directory entry").path();
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_owned();
        if path.is_dir() {
            let nested = rust_files(&path).into_iter().map(|p| (p, false)).collect();
            files.insert(name, nested);
        } else if path.extension().is_some_and(|e| e == "rs")
            && !matches!(name.as_str(), "mod" | "lib" | "main")
        {
            files.entry(name).or_default().push((path, true));
        }
    }
    let own = if dir.is_empty() {
        "crate::".to_owned()
    } else {
        format!("crate::{}::", dir.replace('/', "::"))
    };
    let mut graph = Graph::new();
    for (module, paths) in &files {
        let mut reaches = BTreeSet::new();
        for (path, direct) in paths {
            let code = code_of(path);
            reaches.extend(reached(&code, &own));
            if *direct && !dir.is_empty() {
                reaches.extend(reached(&code, "super::"));
            }
        }
        reaches.retain(|other| other != module && files.contains_key(other));
        graph.insert(module.clone(), reaches);
    }
    graph
}

/// The import cycles of `graph`: its strongly connected components of more than one module.
fn cycles(graph: &Graph) -> Vec<BTreeSet<String>> {
    // Two modules are in one cycle when each reaches the other.
    let reach = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_owned()];
        while let Some(module) = todo.pop() {
            for next in graph.get(&module).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> =
        graph.keys().map(|m| (m, reach(m))).collect();
    let mut found: Vec<BTreeSet<String>> = Vec::new();
    for (module, from) in &reaches {
        let component: BTreeSet<String> = from
            .iter()
            .filter(|other| reaches[other].contains(*module))
            .cloned()
            .collect();
        if component.len() > 1 && !found.contains(&component) {
            found.push(component);
        }
    }
    found
}

/// Layering (README, "Architecture invariants"): no import cycle between the crate's
/// top-level modules, so each can be read, and changed, from the layers below it.
#[test]
fn layering_no_import_cycle_between_top_level_modules() {
    let graph = module_graph("");
    assert!(
        graph.len() >= 20 && graph.contains_key("runtime") && graph["api"].contains("runtime"),
        "the graph was not read: {graph:?}"
    );
    assert_eq!(cycles(&graph), Vec::<BTreeSet<String>>::new());
}

/// Layering: no import cycle between the files of the HTTP layer, the runtime, the store,
/// the gateway, the tools, the sandbox, the cluster or the core. REST and the WebSocket share delivery
/// through `api/delivery.rs`, not through each other; the runtime's files name the actors'
/// mailboxes (`runtime/messages.rs`), not the actors, and the registry starts every
/// conversation (sub-agents included) through the spawn the runtime gives it.
#[test]
fn layering_no_import_cycle_inside_a_layer() {
    for dir in [
        "api",
        "runtime",
        "store",
        "llm",
        "tools",
        "sandbox",
        "cluster",
        "state_machine",
    ] {
        let graph = module_graph(dir);
        assert!(
            !graph.is_empty(),
            "{dir}: the graph was not read: {graph:?}"
        );
        assert_eq!(
            cycles(&graph),
            Vec::<BTreeSet<String>>::new(),
            "import cycles in src/{dir}"
        );
    }
}

/// Layering: the HTTP layer (REST, the WebSocket, SSE, MCP) acts on conversations through
/// the runtime's one door (`runtime::Live`), in the runtime's own errors: it sees neither the
/// actors (ractor, their messages) nor the database's mapper.
#[test]
fn layering_the_http_layer_sees_no_actor_and_no_orm() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/api");
    let files = rust_files(&dir);
    assert!(
        files.len() >= 10,
        "expected the API's files, found {files:?}"
    );
    for path in files {
        let code = code_of(&path);
        for needle in ["ractor", "ActorRef", "ConvMsg", "CallResult", "sea_orm"] {
            assert!(
                !code.contains(needle),
                "{}: the HTTP layer must not use `{needle}`",
                path.display()
            );
        }
    }
}

#[test]
fn the_import_reader_reads_groups_and_paths() {
    let code = "use crate::{api, config::Settings}; let x = crate::store::Store::new(); \
                use super::delivery::{Target}; foo::crate::not";
    assert_eq!(
        reached(code, "crate::"),
        ["api", "config", "store"].map(String::from).into()
    );
    assert_eq!(
        reached(code, "super::"),
        ["delivery"].map(String::from).into()
    );
    let mut graph = Graph::new();
    graph.insert("a".into(), ["b".to_owned()].into());
    graph.insert("b".into(), ["a".to_owned(), "c".to_owned()].into());
    graph.insert("c".into(), BTreeSet::new());
    assert_eq!(cycles(&graph), vec![["a", "b"].map(String::from).into()]);
}

/// Only the persistence actor writes (README, "Architecture invariants"): the store's
/// writes that the server makes on a request's behalf (MCP servers registered and removed,
/// budgets given back, usage, conversations) are called from `src/persistence.rs` alone.
#[test]
fn layering_only_the_persistence_actor_writes() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let writes = [
        ".add_mcp_server(",
        ".delete_mcp_server(",
        ".release_budget(",
        ".insert_conversation(",
        ".delete_conversation(",
        ".insert_attachments(",
        ".write_batch(",
        ".put_agent(",
        ".put_agent_versions(",
        ".delete_agent(",
        ".insert_client_tool_call(",
        ".resolve_client_tool_call(",
        ".insert_webhook(",
        ".update_webhook(",
        ".rotate_webhook_secret(",
        ".delete_webhook(",
        ".webhook_cycle(",
        ".retry_webhook_delivery(",
    ];
    let mut seen = 0;
    for path in rust_files(&src) {
        let relative = path.strip_prefix(&src).expect("under src");
        let code = code_of(&path);
        if relative.starts_with("store") || relative == Path::new("persistence.rs") {
            seen += writes.iter().filter(|w| code.contains(*w)).count();
            continue;
        }
        for write in writes {
            // The README's named exception: `bedrock agent import`, an operator's process
            // with no runtime, writes its versions directly.
            if relative == Path::new("app.rs") && write == ".put_agent_versions(" {
                continue;
            }
            assert!(
                !code.contains(write),
                "{}: `{write}` is a write; send it to the persistence actor (WriteJob)",
                path.display()
            );
        }
    }
    assert!(
        seen >= writes.len(),
        "the writes were not found in persistence.rs"
    );
}

/// No service locator (issue 37): the handles a conversation actor is given stay inside the
/// runtime; every other component is given the handles it uses by the composition root
/// (src/app.rs), and the API reaches a conversation through `Conversations` only.
#[test]
fn layering_no_component_outside_the_runtime_holds_its_handles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let runtime = src.join("runtime");
    let mut checked = 0;
    for path in rust_files(&src) {
        if path.starts_with(&runtime) {
            continue;
        }
        let code = code_of(&path);
        for needle in ["runtime::Handles", "runtime::Registry", "Services"] {
            assert!(
                !code.contains(needle),
                "{}: `{needle}` belongs to the runtime; take the handles you use",
                path.display()
            );
        }
        checked += 1;
    }
    assert!(
        checked >= 40,
        "expected the crate's files, checked {checked}"
    );
}

/// `cast` for internal traffic; `call` never to an ancestor (style.md). Two doors call an
/// actor: `Live` (runtime/registry.rs), which the layers above use, always with a timeout;
/// and the `Persistence` handle (persistence.rs), a sibling service whose commit is the one
/// thing a conversation awaits (without a timeout on purpose: a commit reported failed must
/// not land later; its writes have one). Work a conversation started (tool runs, background
/// tasks) casts to it and waits on a reply channel of its own, with a timeout.
#[test]
fn layering_actors_are_called_only_at_their_doors() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let doors = [dir.join("runtime/registry.rs"), dir.join("persistence.rs")];
    let mut found = 0;
    for path in rust_files(&dir) {
        let code = code_of(&path);
        let calls = code.matches(".actor.call(").count()
            + code.matches("ractor::call").count()
            + code.matches("call_t!").count();
        if doors.contains(&path) {
            assert!(
                code.contains("Some(timeout)") || code.contains(", timeout)"),
                "{}: a call without a timeout",
                path.display()
            );
            found += calls;
        } else {
            assert_eq!(calls, 0, "{}: an actor is called here", path.display());
        }
    }
    assert_eq!(found, 2, "one call at each door");
}

/// A source file's code as it ships: [`code_of`] without its `#[cfg(test)] mod tests`
/// block (a test may use whichever format it checks against).
fn shipped_code_of(path: &Path) -> String {
    let code = code_of(path);
    let Some(start) = code.find("#[cfg(test)] mod tests {") else {
        return code;
    };
    let body = start + "#[cfg(test)] mod tests ".len();
    let mut depth = 0usize;
    for (i, c) in code[body..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return format!("{}{}", &code[..start], &code[body + i + 1..]);
                }
            }
            _ => {}
        }
    }
    code[..start].to_owned()
}

/// One outside format per layer (README, "Architecture invariants"; issue 37). The wire's
/// JSON is made by src/wire.rs for the HTTP layer alone: the runtime and the gateway emit
/// notices (src/notice.rs) and encode them through the `Encode` port the composition root
/// hands them; the store keeps contents in its own JSON (store/codec.rs); the hub carries
/// frames as text and knows no transport; the gateway reads no history or image from the
/// store (its job brings `Records`), and only its budgets (llm/budget.rs) name the store.
#[test]
fn layering_one_outside_format_per_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let below_the_api = [
        "runtime",
        "llm",
        "store",
        "cluster",
        "state_machine",
        "hub.rs",
        "notice.rs",
        "model.rs",
        "persistence.rs",
    ];
    let mut checked = 0;
    for path in rust_files(&src) {
        let relative = path.strip_prefix(&src).expect("under src");
        if !below_the_api
            .iter()
            .any(|layer| relative.starts_with(layer))
        {
            continue;
        }
        let code = shipped_code_of(&path);
        for needle in ["crate::wire", "wire::", "ServerFrame", "axum", "crate::api"] {
            assert!(
                !code.contains(needle),
                "{}: `{needle}` is the HTTP layer's format; emit a notice::Notice",
                path.display()
            );
        }
        if relative.starts_with("llm") && relative != Path::new("llm/budget.rs") {
            for needle in ["crate::store", "Store", "crate::hub", "EventHub"] {
                assert!(
                    !code.contains(needle),
                    "{}: the gateway gets what it reads in its job (Records) and sends \
                     deltas through it (Deltas), not through `{needle}`",
                    path.display()
                );
            }
        }
        checked += 1;
    }
    assert!(
        checked >= 40,
        "expected the layers' files, checked {checked}"
    );
    let sample =
        "fn a() {} #[cfg(test)] mod tests { fn b() { if x { crate::wire::y } } } fn c() {}";
    let dir = std::env::temp_dir().join(format!("bedrock-arch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let file = dir.join("sample.rs");
    std::fs::write(&file, sample).expect("writes");
    assert_eq!(shipped_code_of(&file), "fn a() {}  fn c() {}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The README's codemap names every file of the crate (issue 37: it had fallen behind), so
/// that a new module is described where a newcomer starts reading.
#[test]
fn the_codemap_names_every_module() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let codemap = readme
        .split("## Codemap")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("a Codemap section");
    let src = root.join("src");
    let missing: Vec<String> = rust_files(&src)
        .into_iter()
        .filter_map(|path| {
            let name = path.file_name()?.to_str()?.to_owned();
            let relative = path.strip_prefix(&src).ok()?.display().to_string();
            (name != "mod.rs" && !codemap.contains(&name)).then_some(relative)
        })
        .collect();
    assert!(
        missing.is_empty(),
        "not in the README's codemap: {missing:?}"
    );
}
