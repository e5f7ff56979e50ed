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

/// Asserts a 429 `quota_exceeded` naming `quota` and its `limit`.
#[track_caller]
fn over_quota(reply: crate::support::app::Reply, quota: &str, limit: u64) {
    assert_eq!(reply.status, 429, "{}", reply.body);
    assert_eq!(
        reply.body["error"]["code"], "quota_exceeded",
        "{}",
        reply.body
    );
    assert_eq!(
        reply.body["error"]["quota"]["name"], quota,
        "{}",
        reply.body
    );
    assert_eq!(
        reply.body["error"]["quota"]["limit"], limit,
        "{}",
        reply.body
    );
}

async fn usage(app: &TestApp, key: &str) -> Value {
    app.request(reqwest::Method::GET, "/v1/usage", Some(key), None)
        .await
        .expect(200)
}

/// What one tenant may hold of the node (REQ-BED-010's sharing; docs/security.md,
/// "Quotas"): conversations, running turns and open streams over their quotas are 429
/// `quota_exceeded` naming the quota; tool processes wait behind the tenant's own and give
/// up at the run's time limit, while another tenant's tools run at once; GET /v1/usage
/// shows the limits and the use; `bedrock tenant quota` raises a tenant's own.
#[tokio::test]
async fn quotas_bound_what_one_tenant_holds() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(
            &db,
            &[
                ("BEDROCK_QUOTAS__CONVERSATIONS", "2"),
                ("BEDROCK_QUOTAS__CONCURRENT_TURNS", "2"),
                ("BEDROCK_QUOTAS__TOOL_PROCESSES", "1"),
                ("BEDROCK_QUOTAS__STREAMS", "1"),
                ("BEDROCK_QUOTAS__CACHE_MS", "0"),
                ("BEDROCK_TOOLS__BASH_TIMEOUT_MS", "1500"),
                ("BEDROCK_QUOTAS__MCP_SERVERS", "1"),
                ("BEDROCK_EGRESS__ALLOW", "[\"127.0.0.1\"]"),
            ],
        )
        .await;
        let key = app.key_a.clone();
        let first = app.conversation().await;
        let second = app.conversation().await;
        over_quota(create(&app, &key, json!({})).await, "conversations", 2);
        // Another tenant is not held back by it.
        let other = create(&app, &app.key_b, json!({})).await.expect(201);
        let other = other["id"].as_str().expect("an id").to_owned();

        // One tool process at a time: the second waits behind the first, at most its
        // default time limit, then fails saying why; the other tenant's runs at once.
        app.llm.route(
            "sleep-first",
            [
                bedrock::testkit::Reply::tool(
                    "sleeper",
                    "bash",
                    json!({"command": "touch started && sleep 6", "timeout_ms": 30000}),
                ),
                bedrock::testkit::Reply::text("slept"),
            ],
        );
        app.send(&first, "sleep-first").await;
        app.written(&first, "started").await;
        let (ok, output) = bash_as(&app, &key, &second, json!({"command": "echo hi"})).await;
        assert!(
            !ok && output.contains("quota tool_processes"),
            "waited for a slot: {output}"
        );
        let started = std::time::Instant::now();
        let (ok, output) = bash_as(
            &app,
            &app.key_b,
            &other,
            json!({"command": "echo neighbour"}),
        )
        .await;
        assert!(ok && output.contains("neighbour"), "{output}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "the other tenant did not wait for tenant a's slot"
        );

        // Running turns: two at once, not three (the first still sleeps).
        let limits = usage(&app, &key).await;
        assert_eq!(limits["quotas"]["conversations"]["limit"], 2, "{limits}");
        assert_eq!(limits["quotas"]["conversations"]["used"], 2, "{limits}");
        assert_eq!(limits["quotas"]["tool_processes"]["used"], 1, "{limits}");
        assert_eq!(limits["quotas"]["concurrent_turns"]["used"], 1, "{limits}");
        for quota in [
            "background_tasks",
            "streams",
            "mcp_servers",
            "llm_concurrency",
            "workspace_bytes",
        ] {
            assert!(
                limits["quotas"][quota]["limit"].as_u64().is_some(),
                "{quota}: {limits}"
            );
        }

        // Open streams: one; a second WebSocket or SSE stream is refused before upgrading.
        let ws = crate::support::ws::Ws::connect(&app.ws_url(&second, "")).await;
        let refused = app
            .request(
                reqwest::Method::GET,
                &format!("/v1/conversations/{second}/stream"),
                Some(&key),
                None,
            )
            .await;
        over_quota(refused, "streams", 1);
        drop(ws);

        // The command line raises the tenant's own quota; it applies at once here
        // (quotas.cache_ms = 0).
        let raised = bedrock::app::set_tenant_quotas(
            &app.settings(),
            "a",
            &["conversations=3".to_owned(), "streams=default".to_owned()],
        )
        .await
        .expect("set");
        assert_eq!(raised["quotas"]["conversations"]["limit"], 3, "{raised}");
        assert_eq!(raised["quotas"]["conversations"]["own"], true, "{raised}");
        assert!(
            bedrock::app::set_tenant_quotas(&app.settings(), "a", &["bogus=1".to_owned()])
                .await
                .is_err()
        );
        create(&app, &key, json!({})).await.expect(201);

        // MCP servers: one.
        let register = |name: &str| {
            app.request(
                reqwest::Method::POST,
                "/v1/mcp_servers",
                Some(&key),
                Some(json!({"name": name, "url": "http://127.0.0.1:9/mcp"})),
            )
        };
        register("one").await.expect(201);
        over_quota(register("two").await, "mcp_servers", 1);
        app.wait_kind(&first, "idle").await;
        app.cleanup(db).await;
    }
}

/// The turn quota: with one running turn allowed, a second conversation's message is 429
/// with Retry-After until the first turn ends.
#[tokio::test]
async fn a_tenant_runs_at_most_its_quota_of_turns() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_QUOTAS__CONCURRENT_TURNS", "1")]).await;
    let (first, second) = (app.conversation().await, app.conversation().await);
    app.llm.route(
        "sleep-first",
        [
            bedrock::testkit::Reply::tool(
                "sleeper",
                "bash",
                json!({"command": "touch started && sleep 3"}),
            ),
            bedrock::testkit::Reply::text("slept"),
        ],
    );
    app.send(&first, "sleep-first").await;
    app.written(&first, "started").await;
    let refused = app
        .request(
            reqwest::Method::POST,
            &format!("/v1/conversations/{second}/messages"),
            Some(&app.key_a),
            Some(json!({"text": "me too"})),
        )
        .await;
    over_quota(refused, "concurrent_turns", 1);
    // Another tenant's turn is not counted.
    let other = create(&app, &app.key_b, json!({})).await.expect(201);
    app.llm.push([bedrock::testkit::Reply::text("hello b")]);
    app.request(
        reqwest::Method::POST,
        &format!(
            "/v1/conversations/{}/messages",
            other["id"].as_str().expect("id")
        ),
        Some(&app.key_b),
        Some(json!({"text": "hi"})),
    )
    .await
    .expect(202);
    app.wait_kind(&first, "idle").await;
    app.llm.push([bedrock::testkit::Reply::text("my turn")]);
    // The turn's slot frees as its actor takes in its last commit, a moment after the
    // state is stored: a client follows Retry-After.
    crate::support::eventually("the turn quota frees", crate::support::WAIT, || async {
        let sent = app
            .request(
                reqwest::Method::POST,
                &format!("/v1/conversations/{second}/messages"),
                Some(&app.key_a),
                Some(json!({"text": "now"})),
            )
            .await;
        (sent.status == 202).then_some(())
    })
    .await;
    app.wait_kind(&second, "idle").await;
    app.cleanup(db).await;
}

/// Deleting a conversation removes its directory unless another conversation works in it,
/// above it or below it; a link a tool planted on the way never turns the removal
/// elsewhere.
#[tokio::test]
async fn deleting_a_conversation_removes_its_own_directory_only() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let key = app.key_a.clone();
        let delete = |id: String| {
            let app = &app;
            let key = key.clone();
            async move {
                app.request(
                    reqwest::Method::DELETE,
                    &format!("/v1/conversations/{id}"),
                    Some(&key),
                    None,
                )
                .await
                .expect(204);
            }
        };
        // Its own directory goes.
        let (own, own_cwd) = conversation_in(&app, &key, "own").await;
        let (ok, output) = bash_as(
            &app,
            &key,
            &own,
            json!({"command": "mkdir -p d && echo x > d/f"}),
        )
        .await;
        assert!(ok, "{output}");
        delete(own).await;
        assert!(!own_cwd.exists(), "removed with its conversation");
        // A shared one stays: a `share` fork, and a conversation at the tenant's root.
        let (shared, shared_cwd) = conversation_in(&app, &key, "shared").await;
        let fork = app
            .request(
                reqwest::Method::POST,
                &format!("/v1/conversations/{shared}/fork"),
                Some(&key),
                Some(json!({"cwd": "share"})),
            )
            .await
            .expect(201);
        delete(shared).await;
        assert!(shared_cwd.exists(), "the fork still works there");
        delete(fork["id"].as_str().expect("an id").to_owned()).await;
        assert!(!shared_cwd.exists(), "the last one out removes it");
        // A link planted above a directory: the other tenant's files stay.
        let (root, tenant_root) = conversation_in(&app, &key, ".").await;
        let (victim, _) = conversation_in(&app, &key, "a/victim").await;
        let other = create(&app, &app.key_b, json!({})).await.expect(201);
        let other_cwd = PathBuf::from(other["cwd"].as_str().expect("a cwd"));
        std::fs::create_dir_all(other_cwd.join("victim")).expect("a directory");
        std::fs::write(other_cwd.join("victim/keep"), "b's").expect("written");
        let (ok, output) = bash_as(
            &app,
            &key,
            &root,
            json!({"command": format!("mv a a.real && ln -s '{}' a", other_cwd.display())}),
        )
        .await;
        assert!(ok, "{output}");
        delete(victim).await;
        assert_eq!(
            std::fs::read_to_string(other_cwd.join("victim/keep")).expect("still there"),
            "b's"
        );
        // The tenant's root is never removed.
        delete(root).await;
        assert!(tenant_root.exists());
        app.cleanup(db).await;
    }
}

/// Background tasks count against their own quota: over it, the call is a failed tool
/// result that says so, and the conversation goes on.
#[tokio::test]
async fn background_tasks_are_bounded_per_tenant() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_QUOTAS__BACKGROUND_TASKS", "1")]).await;
    let key = app.key_a.clone();
    let id = app.conversation().await;
    let (ok, output) = bash_as(
        &app,
        &key,
        &id,
        json!({"command": "sleep 5", "background": true}),
    )
    .await;
    assert!(ok && output.contains("started background task"), "{output}");
    let (ok, output) = bash_as(
        &app,
        &key,
        &id,
        json!({"command": "sleep 5", "background": true}),
    )
    .await;
    assert!(
        !ok && output.contains("background_tasks quota of this tenant is 1"),
        "{output}"
    );
    let (ok, output) = bash_as(&app, &key, &id, json!({"command": "echo foreground"})).await;
    assert!(ok && output.contains("foreground"), "{output}");
    app.cleanup(db).await;
}

/// What a tenant's tools can leave for the server to trip on: a pipe or a huge sparse file
/// named to patch (the server must not wait on the pipe nor read the gigabyte), a tree a
/// thousand directories deep in the run's /tmp (removed after the run) and in the cwd (a
/// fork refuses it; deleting the conversation removes it). The server neither hangs nor crashes, and the conversation goes on.
#[tokio::test]
async fn hostile_trees_neither_hang_nor_crash_the_server() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let key = app.key_a.clone();
    let (id, cwd) = conversation_in(&app, &key, "hostile").await;
    let (ok, output) = bash_as(
        &app,
        &key,
        &id,
        json!({"command": "mkfifo pipe && truncate -s 900M sparse && echo made"}),
    )
    .await;
    assert!(ok && output.contains("made"), "{output}");
    for (file, expected) in [("pipe", "not a regular file"), ("sparse", "larger than")] {
        let started = std::time::Instant::now();
        let (ok, output) = tool_as(
            &app,
            &key,
            &id,
            "patch",
            json!({"path": file, "edits": [{"old_text": "a", "new_text": "b"}]}),
        )
        .await;
        assert!(!ok && output.contains(expected), "{file}: {output}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "{file}: no hang"
        );
    }
    // A deep tree in the run's private /tmp, and one in the cwd.
    let deep = "p=$(printf 'd/%.0s' $(seq 1000)); for i in $(seq 1); do mkdir -p $p && cd $p || exit 1; done; echo deep";
    let (ok, output) = bash_as(
        &app,
        &key,
        &id,
        json!({"command": format!("cd /tmp && {deep}"), "timeout_ms": 120000}),
    )
    .await;
    assert!(ok && output.contains("deep"), "{output}");
    let (ok, output) = bash_as(
        &app,
        &key,
        &id,
        json!({"command": format!("rm -f sparse pipe && {deep}"), "timeout_ms": 120000}),
    )
    .await;
    assert!(ok && output.contains("deep"), "{output}");
    let refused = app
        .request(
            reqwest::Method::POST,
            &format!("/v1/conversations/{id}/fork"),
            Some(&key),
            Some(json!({"cwd": "copy"})),
        )
        .await
        .expect_error(413, "payload_too_large");
    assert!(refused.contains("deep"), "{refused}");
    let (ok, output) = bash_as(&app, &key, &id, json!({"command": "echo still-here"})).await;
    assert!(ok && output.contains("still-here"), "{output}");
    app.request(
        reqwest::Method::DELETE,
        &format!("/v1/conversations/{id}"),
        Some(&key),
        None,
    )
    .await
    .expect(204);
    crate::support::eventually("the deep tree removed", crate::support::WAIT, || async {
        (!cwd.exists()).then_some(())
    })
    .await;
    app.get("/healthz").await.expect(200);
    app.cleanup(db).await;
}

/// A node where each tenant may hold three conversations, read fresh on every create.
async fn with_three_conversations(db: &TestDb) -> TestApp {
    TestApp::spawn_with(
        db,
        &[
            ("BEDROCK_QUOTAS__CONVERSATIONS", "3"),
            ("BEDROCK_QUOTAS__CACHE_MS", "0"),
        ],
    )
    .await
}

/// The `conversations` quota counts a tenant's conversations exactly, from one row the
/// database keeps (issue 41: it was a count over all of them on every create): creates and
/// forks count, deletes give room back, sub-agents do not count, and another tenant's do
/// not either (security issue 36, "Quotas").
#[tokio::test]
async fn the_conversation_count_follows_creates_forks_deletes_and_not_sub_agents() {
    for db in TestDb::each().await {
        let app = with_three_conversations(&db).await;
        let key = app.key_a.clone();
        let used = |limits: Value| limits["quotas"]["conversations"]["used"].clone();
        let first = app.conversation().await;
        assert_eq!(used(usage(&app, &key).await), 1, "{}", db.backend);
        // A sub-agent is no conversation of the quota's.
        app.llm.route(
            "spawn one",
            [
                bedrock::testkit::Reply::tool(
                    "call_spawn",
                    "spawn_sub_agents",
                    json!({"tasks": [{"prompt": "a counted sub task", "max_steps": 3}]}),
                ),
                bedrock::testkit::Reply::text("spawned"),
            ],
        );
        app.llm.route(
            "a counted sub task",
            [bedrock::testkit::Reply::tool(
                "call_submit",
                "submit_result",
                json!({"result": "done"}),
            )],
        );
        app.send(&first, "spawn one").await;
        app.wait_kind(&first, "idle").await;
        let children = app
            .get(&format!("/v1/conversations/{first}/children"))
            .await
            .expect(200);
        assert_eq!(
            children["conversations"].as_array().map(Vec::len),
            Some(1),
            "{children}"
        );
        assert_eq!(used(usage(&app, &key).await), 1, "{}", db.backend);
        // Another tenant's conversations are not counted.
        create(&app, &app.key_b, json!({})).await.expect(201);
        // A fork counts; the fourth is refused.
        let fork = app
            .request(
                reqwest::Method::POST,
                &format!("/v1/conversations/{first}/fork"),
                Some(&key),
                Some(json!({})),
            )
            .await
            .expect(201);
        let third = create(&app, &key, json!({})).await.expect(201);
        assert_eq!(used(usage(&app, &key).await), 3, "{}", db.backend);
        over_quota(create(&app, &key, json!({})).await, "conversations", 3);
        // A delete gives its room back (its sub-agents go with it, uncounted).
        for id in [&first, fork["id"].as_str().expect("an id")] {
            app.request(
                reqwest::Method::DELETE,
                &format!("/v1/conversations/{id}"),
                Some(&key),
                None,
            )
            .await
            .expect(204);
        }
        assert_eq!(used(usage(&app, &key).await), 1, "{}", db.backend);
        create(&app, &key, json!({})).await.expect(201);
        create(&app, &key, json!({})).await.expect(201);
        over_quota(create(&app, &key, json!({})).await, "conversations", 3);
        assert!(third["id"].is_string());
        app.cleanup(db).await;
    }
}

/// What a hostile tenant tries first against the `conversations` quota: many creates at
/// once, each racing the others' count. Exactly the quota's number are made; the rest get
/// 429 `quota_exceeded` (security issue 36, "Quotas").
#[tokio::test]
async fn a_flood_of_creates_at_once_makes_no_more_than_the_quota() {
    for db in TestDb::each().await {
        let app = with_three_conversations(&db).await;
        let key = app.key_a.clone();
        let replies =
            futures::future::join_all((0..24).map(|_| create(&app, &key, json!({})))).await;
        let made = replies.iter().filter(|r| r.status == 201).count();
        let refused = replies.iter().filter(|r| r.status == 429).count();
        assert_eq!((made, refused), (3, 21), "{}", db.backend);
        let limits = usage(&app, &key).await;
        assert_eq!(
            limits["quotas"]["conversations"]["used"], 3,
            "{} {limits}",
            db.backend
        );
        app.cleanup(db).await;
    }
}

/// The same flood against `concurrent_turns`: messages sent at once to many of the tenant's
/// conversations each race the others' turns; no more turns start than the quota.
#[tokio::test]
async fn a_flood_of_sends_at_once_starts_no_more_turns_than_the_quota() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_QUOTAS__CONCURRENT_TURNS", "2")]).await;
    let mut ids = Vec::new();
    for _ in 0..8 {
        ids.push(app.conversation().await);
    }
    app.llm.route(
        "flood",
        [
            bedrock::testkit::Reply::tool("sleeper", "bash", json!({"command": "sleep 2"})),
            bedrock::testkit::Reply::text("slept"),
        ],
    );
    let paths: Vec<String> = ids
        .iter()
        .map(|id| format!("/v1/conversations/{id}/messages"))
        .collect();
    let sends = paths.iter().map(|path| {
        app.request(
            reqwest::Method::POST,
            path,
            Some(&app.key_a),
            Some(json!({"text": "flood"})),
        )
    });
    let replies = futures::future::join_all(sends).await;
    let started = replies.iter().filter(|r| r.status == 202).count();
    let refused = replies.iter().filter(|r| r.status == 429).count();
    assert_eq!(
        (started, refused),
        (2, 6),
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    for (id, reply) in ids.iter().zip(&replies) {
        if reply.status == 202 {
            app.wait_kind(id, "idle").await;
        }
    }
    app.cleanup(db).await;
}
