//! One tenant can neither escape nor reach the others (the multi-tenant security issue;
//! REQ-BED-010, docs/security.md "Working directories"). Each test is what a hostile tenant
//! would try first, through the real server and its sandbox, on SQLite and Postgres.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::sandbox::{bash_as, tool_as};
use crate::support::{TestApp, TestDb};

/// Every file and directory under `dirs` (links not followed) with its owner.
fn owners(dirs: &[PathBuf]) -> BTreeMap<PathBuf, (u32, u32)> {
    fn walk(path: &Path, out: &mut BTreeMap<PathBuf, (u32, u32)>) {
        let Ok(meta) = std::fs::symlink_metadata(path) else {
            return;
        };
        out.insert(path.to_owned(), (meta.uid(), meta.gid()));
        if meta.is_dir()
            && let Ok(entries) = std::fs::read_dir(path)
        {
            for entry in entries.flatten() {
                walk(&entry.path(), out);
            }
        }
    }
    let mut out = BTreeMap::new();
    for dir in dirs {
        walk(dir, &mut out);
    }
    out
}

/// Files named `name` anywhere under `dirs` (links not followed).
fn found(dirs: &[PathBuf], name: &str) -> Vec<PathBuf> {
    owners(dirs)
        .into_keys()
        .filter(|p| p.file_name().is_some_and(|n| n == name))
        .collect()
}

async fn create(app: &TestApp, key: &str, body: Value) -> crate::support::app::Reply {
    app.request(
        reqwest::Method::POST,
        "/v1/conversations",
        Some(key),
        Some(body),
    )
    .await
}

/// (id, cwd) of a new conversation of tenant `key` in `cwd`.
async fn conversation_in(app: &TestApp, key: &str, cwd: &str) -> (String, PathBuf) {
    let body = create(app, key, json!({ "cwd": cwd })).await.expect(201);
    (
        body["id"].as_str().expect("an id").to_owned(),
        PathBuf::from(body["cwd"].as_str().expect("a cwd")),
    )
}

fn replaced(output: &str) -> bool {
    output.contains("replaced by a symbolic link")
}

/// The attack that took a node over: a conversation at the tenant's root replaces another
/// conversation's directory (or one above it) by a link to its parent, to another tenant,
/// to the server's data dir, to /. The victim's next tool run (bash, patch, keyword_search)
/// must not follow it: it fails saying so, nothing outside the tenant's tree is read,
/// written or given to the tool user, a fork refuses to copy it, no new conversation can be
/// made through a link, and the server goes on committing.
#[tokio::test]
async fn a_swapped_working_directory_is_never_followed() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let key = app.key_a.clone();
        let (root, tenant_root) = conversation_in(&app, &key, ".").await;
        let (victim, victim_cwd) = conversation_in(&app, &key, "victim").await;
        let (deep, _) = conversation_in(&app, &key, "deep/inner").await;
        assert_eq!(victim_cwd, tenant_root.join("victim"));
        let other = create(&app, &app.key_b, json!({})).await.expect(201);
        let other_cwd = PathBuf::from(other["cwd"].as_str().expect("a cwd"));
        std::fs::write(other_cwd.join("secret.txt"), "tenant-b-secret").expect("written");
        let data_dir = PathBuf::from(format!("{}-data", app.workspace.display()));
        let mut guarded = vec![data_dir.clone(), other_cwd.clone()];
        guarded.extend(db.dir.clone());
        let before = owners(&guarded);
        assert!(before.len() > 2, "the data dir is there: {before:?}");

        let (ok, output) = bash_as(
            &app,
            &key,
            &victim,
            json!({"command": "echo mine > mine.txt"}),
        )
        .await;
        assert!(ok, "{output}");

        for target in [
            "..".to_owned(),
            "../..".to_owned(),
            other_cwd.display().to_string(),
            data_dir.display().to_string(),
            "/".to_owned(),
        ] {
            let (ok, output) = bash_as(
                &app,
                &key,
                &root,
                json!({"command": format!("rm -rf victim && ln -s '{target}' victim && ls -ld victim")}),
            )
            .await;
            assert!(ok, "the swap itself ({target}): {output}");
            let (ok, output) = bash_as(
                &app,
                &key,
                &victim,
                json!({"command": "pwd -P; ls -la; cat secret.txt; echo pwned > pwned.txt; chmod 777 ."}),
            )
            .await;
            assert!(!ok && replaced(&output), "bash through {target}: {output}");
            assert!(!output.contains("tenant-b-secret"), "{output}");
            let (ok, output) = tool_as(
                &app,
                &key,
                &victim,
                "patch",
                json!({"path": "pwned.txt", "edits": [{"old_text": "", "new_text": "x"}]}),
            )
            .await;
            assert!(!ok && replaced(&output), "patch through {target}: {output}");
            let (ok, output) = tool_as(
                &app,
                &key,
                &victim,
                "keyword_search",
                json!({"query": "secret"}),
            )
            .await;
            assert!(
                !ok && replaced(&output),
                "search through {target}: {output}"
            );
            assert!(!output.contains("tenant-b-secret"), "{output}");
            // A fork does not copy what the link leads to.
            let refused = app
                .request(
                    reqwest::Method::POST,
                    &format!("/v1/conversations/{victim}/fork"),
                    Some(&key),
                    Some(json!({"cwd": "copy"})),
                )
                .await;
            refused.expect_error(409, "workspace_replaced");
        }

        // A link above the directory is refused the same way.
        let (ok, output) = bash_as(
            &app,
            &key,
            &root,
            json!({"command": "mv deep deep.real && ln -s deep.real deep"}),
        )
        .await;
        assert!(ok, "{output}");
        let (ok, output) = bash_as(&app, &key, &deep, json!({"command": "pwd -P"})).await;
        assert!(!ok && replaced(&output), "a link above: {output}");

        // No new conversation through a link, nor above the tenant's root.
        let (ok, output) = bash_as(&app, &key, &root, json!({"command": "ln -s / rootlink"})).await;
        assert!(ok, "{output}");
        for cwd in [
            "rootlink",
            "rootlink/etc",
            "victim/sub",
            "..",
            "../b",
            "/etc",
        ] {
            let message = create(&app, &key, json!({ "cwd": cwd }))
                .await
                .expect_error(400, "invalid_request");
            assert!(message.contains("cwd"), "{cwd}: {message}");
        }

        // Nothing outside the tenant's tree was written or changed owner.
        assert!(found(&guarded, "pwned.txt").is_empty());
        assert!(!Path::new("/pwned.txt").exists());
        assert_eq!(
            std::fs::read_to_string(other_cwd.join("secret.txt")).expect("read"),
            "tenant-b-secret"
        );
        let after = owners(&guarded);
        for (path, owner) in &before {
            if let Some(now) = after.get(path) {
                assert_eq!(now, owner, "{} changed owner", path.display());
            }
        }

        // The tenant puts a directory back: the victim works there again, and the server
        // still commits.
        let (ok, output) = bash_as(
            &app,
            &key,
            &root,
            json!({"command": "rm -f victim && mkdir victim"}),
        )
        .await;
        assert!(ok, "{output}");
        let (ok, output) = bash_as(
            &app,
            &key,
            &victim,
            json!({"command": "echo again > again.txt && pwd -P"}),
        )
        .await;
        assert!(
            ok && output.contains(&victim_cwd.display().to_string()),
            "{output}"
        );
        assert!(victim_cwd.join("again.txt").exists());
        let fresh = app.conversation().await;
        app.llm.push([bedrock::testkit::Reply::text("committed")]);
        app.send(&fresh, "still committing").await;
        app.wait_kind(&fresh, "idle").await;
        app.get("/healthz").await.expect(200);
        app.cleanup(db).await;
    }
}
