//! Agents (issue 38; docs/api.md, "Agents"): versioned definitions a tenant makes once and
//! creates conversations from. A conversation keeps the version it was created from while
//! newer ones appear, and so do its sub-agents and forks; the agent's `tools` bound what the
//! LLM is offered and what the core runs; another tenant sees none of it. On SQLite and
//! Postgres, through the real server.

use reqwest::Method;
use serde_json::{Value, json};

use crate::support::{TestApp, TestDb, request_messages, tool_names};
use bedrock::testkit::Reply as Llm;

fn system_prompt(request: &Value) -> String {
    request_messages(request)
        .first()
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_owned()
}

async fn put(app: &TestApp, path: &str, key: &str, body: Value) -> crate::support::app::Reply {
    app.request(Method::PUT, path, Some(key), Some(body)).await
}

/// An agent's versions, a conversation pinned to one while a newer one appears, `name@N`,
/// the fields an agent owns, its tools bounding what runs, and a delete that keeps running
/// conversations going.
#[tokio::test]
async fn agents_are_versioned_and_conversations_keep_their_version() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let created = app
            .post(
                "/v1/agents",
                json!({
                    "name": "coder",
                    "description": "writes code",
                    "model": "fake-model",
                    "system_prompt": "You are coder v1.",
                    "tools": ["think", "bash"],
                    "metadata": {"team": "ide"},
                }),
            )
            .await
            .expect(201);
        assert_eq!(created["version"], 1);
        assert_eq!(created["tools"], json!(["bash", "think"]));
        assert_eq!(created["metadata"], json!({"team": "ide"}));
        app.post("/v1/agents", json!({"name": "coder", "model": "m"}))
            .await
            .expect_error(409, "agent_exists");

        // v1's conversation, then v2 appears.
        let first = app
            .post("/v1/conversations", json!({"agent": "coder"}))
            .await
            .expect(201);
        assert_eq!(first["agent"], json!({"name": "coder", "version": 1}));
        assert_eq!(first["system_prompt"], "You are coder v1.");
        assert_eq!(first["tools"], json!(["bash", "think"]));
        let first_id = first["id"].as_str().expect("an id").to_owned();
        let changed = put(
            &app,
            "/v1/agents/coder",
            &app.key_a,
            json!({"model": "fake-model", "system_prompt": "You are coder v2."}),
        )
        .await
        .expect(200);
        assert_eq!(changed["version"], 2);
        assert!(
            changed.get("tools").is_none(),
            "v2 has every tool: {changed}"
        );

        // The v1 conversation still runs v1: its prompt, and only its tools; a call of a
        // tool it lacks is refused by the core and does not run.
        app.llm.push([
            Llm::tool(
                "call_patch",
                "patch",
                json!({"path": "made.txt", "edits": [{"old_text": "", "new_text": "x"}]}),
            ),
            Llm::text("done"),
        ]);
        app.send(&first_id, "make a file").await;
        app.wait_kind(&first_id, "idle").await;
        let requests = app.llm.requests();
        assert!(system_prompt(&requests[0]).contains("You are coder v1."));
        let mut offered = tool_names(&requests[0]);
        offered.sort();
        assert_eq!(offered, ["bash", "think"]);
        let messages = app.messages(&first_id).await;
        let refused = messages
            .iter()
            .find(|m| m["content"]["tool_use_id"] == "call_patch")
            .expect("the patch call's result");
        assert_eq!(refused["content"]["ok"], false);
        assert!(
            refused["content"]["output"]
                .as_str()
                .is_some_and(|o| o.contains("has no tool named \"patch\"")),
            "{refused}"
        );
        assert!(!app.cwd(&first_id).await.join("made.txt").exists());

        // New conversations: the latest, or a version by number.
        let second = app
            .post("/v1/conversations", json!({"agent": "coder", "slug": "v2"}))
            .await
            .expect(201);
        assert_eq!(second["agent"], json!({"name": "coder", "version": 2}));
        assert_eq!(second["slug"], "v2");
        assert!(second.get("tools").is_none());
        let pinned = app
            .post("/v1/conversations", json!({"agent": "coder@1"}))
            .await
            .expect(201);
        assert_eq!(pinned["agent"]["version"], 1);
        app.post("/v1/conversations", json!({"agent": "coder@9"}))
            .await
            .expect_error(404, "not_found");
        for bad in ["coder@0", "coder@x", "Coder", "", "a@b@c"] {
            app.post("/v1/conversations", json!({"agent": bad}))
                .await
                .expect_error(400, "invalid_request");
        }
        // The agent owns its settings: giving one with it is refused, not ignored.
        app.post(
            "/v1/conversations",
            json!({"agent": "coder", "model": "other"}),
        )
        .await
        .expect_error(400, "invalid_request");

        // Listings.
        let listed = app.get("/v1/agents").await.expect(200);
        assert_eq!(listed["agents"].as_array().map(Vec::len), Some(1));
        assert_eq!(listed["agents"][0]["version"], 2);
        let versions = app.get("/v1/agents/coder/versions").await.expect(200);
        let numbers: Vec<u64> = versions["agents"]
            .as_array()
            .expect("versions")
            .iter()
            .filter_map(|v| v["version"].as_u64())
            .collect();
        assert_eq!(numbers, [1, 2]);
        let one = app.get("/v1/agents/coder/versions/1").await.expect(200);
        assert_eq!(one["system_prompt"], "You are coder v1.");
        app.get("/v1/agents/coder/versions/3")
            .await
            .expect_error(404, "not_found");

        // A fork keeps its source's version.
        let fork = app
            .post(&format!("/v1/conversations/{first_id}/fork"), json!({}))
            .await
            .expect(201);
        assert_eq!(fork["agent"], json!({"name": "coder", "version": 1}));
        assert_eq!(fork["tools"], json!(["bash", "think"]));

        // Deleted: no new conversation; running ones go on; created again, it numbers on.
        app.request(Method::DELETE, "/v1/agents/coder", Some(&app.key_a), None)
            .await
            .expect(204);
        app.request(Method::DELETE, "/v1/agents/coder", Some(&app.key_a), None)
            .await
            .expect_error(404, "not_found");
        app.post("/v1/conversations", json!({"agent": "coder@1"}))
            .await
            .expect_error(404, "not_found");
        app.get("/v1/agents/coder")
            .await
            .expect_error(404, "not_found");
        app.llm.push([Llm::text("still here")]);
        app.send(&first_id, "are you there?").await;
        app.wait_kind(&first_id, "idle").await;
        let again = app
            .post(
                "/v1/agents",
                json!({"name": "coder", "model": "fake-model"}),
            )
            .await
            .expect(201);
        assert_eq!(again["version"], 3, "versions are never reused");
        let held = app.get("/v1/agents/coder/versions").await.expect(200);
        assert_eq!(
            held["agents"].as_array().map(Vec::len),
            Some(1),
            "the deleted agent's versions went with it: {held}"
        );
        app.post("/v1/conversations", json!({"agent": "coder@1"}))
            .await
            .expect_error(404, "not_found");

        // An agent with no tool at all: the request offers none (no empty `tools` list,
        // which backends refuse).
        app.post(
            "/v1/agents",
            json!({"name": "talker", "model": "fake-model", "tools": []}),
        )
        .await
        .expect(201);
        let talker = app
            .post("/v1/conversations", json!({"agent": "talker"}))
            .await
            .expect(201)["id"]
            .as_str()
            .expect("an id")
            .to_owned();
        let before = app.llm.requests().len();
        app.llm.push([Llm::text("just words")]);
        app.send(&talker, "hello").await;
        app.wait_kind(&talker, "idle").await;
        let request = app.llm.requests()[before].clone();
        assert!(request.get("tools").is_none(), "{request}");
        app.cleanup(db).await;
    }
}

/// What a hostile tenant tries first: another tenant's agent by name or by version, changes
/// and deletes of it, definitions that are too big or name what does not exist, fields the
/// API does not know, and more agents than its quota.
#[tokio::test]
async fn another_tenants_agents_are_out_of_reach() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &[("BEDROCK_QUOTAS__AGENTS", "2")]).await;
        app.post(
            "/v1/agents",
            json!({"name": "secret", "model": "fake-model"}),
        )
        .await
        .expect(201);
        let b = app.key_b.clone();
        for (method, path, body) in [
            (Method::GET, "/v1/agents/secret", None),
            (Method::GET, "/v1/agents/secret/versions", None),
            (Method::GET, "/v1/agents/secret/versions/1", None),
            (Method::DELETE, "/v1/agents/secret", None),
            (
                Method::PUT,
                "/v1/agents/secret",
                Some(json!({"model": "fake-model"})),
            ),
            (
                Method::POST,
                "/v1/conversations",
                Some(json!({"agent": "secret"})),
            ),
            (
                Method::POST,
                "/v1/conversations",
                Some(json!({"agent": "secret@1"})),
            ),
        ] {
            app.request(method.clone(), path, Some(&b), body)
                .await
                .expect_error(404, "not_found");
        }
        let theirs = app
            .request(Method::GET, "/v1/agents", Some(&b), None)
            .await
            .expect(200);
        assert_eq!(theirs["agents"], json!([]));
        // Tenant b may use the same name for an agent of its own.
        app.request(
            Method::POST,
            "/v1/agents",
            Some(&b),
            Some(json!({"name": "secret", "model": "fake-model"})),
        )
        .await
        .expect(201);
        let mine = app.get("/v1/agents/secret").await.expect(200);
        assert_eq!(mine["version"], 1);

        // Bad definitions.
        for body in [
            json!({"name": "Bad Name", "model": "m"}),
            json!({"name": "x", "model": ""}),
            json!({"name": "x", "model": "m", "tools": ["rm_rf"]}),
            json!({"name": "x", "model": "m", "tools": ["submit_result"]}),
            json!({"name": "x", "model": "m", "mcp_servers": ["Not Valid"]}),
            json!({"name": "x", "model": "m", "budget_tokens": 0}),
            json!({"name": "x", "model": "m", "metadata": {"big": "y".repeat(20_000)}}),
            json!({"name": "x", "model": "m", "client_tools": [{"name": "bash", "input_schema": {"type": "object"}}]}),
            json!({"model": "m"}),
        ] {
            app.post("/v1/agents", body)
                .await
                .expect_error(400, "invalid_request");
        }
        put(
            &app,
            "/v1/agents/secret",
            &app.key_a,
            json!({"name": "renamed", "model": "m"}),
        )
        .await
        .expect_error(400, "invalid_request");

        // A taken name answers 409 before the quota is looked at.
        let document = app.get("/v1/agents/secret/export").await.expect(200);
        app.post(
            "/v1/agents",
            json!({"name": "second", "model": "fake-model"}),
        )
        .await
        .expect(201);
        app.post("/v1/agents/import", document)
            .await
            .expect_error(409, "agent_exists");
        app.request(Method::DELETE, "/v1/agents/second", Some(&app.key_a), None)
            .await
            .expect(204);

        // The quota: two agents; a deleted one gives its place back.
        app.post(
            "/v1/agents",
            json!({"name": "second", "model": "fake-model"}),
        )
        .await
        .expect(201);
        app.post(
            "/v1/agents",
            json!({"name": "third", "model": "fake-model"}),
        )
        .await
        .expect_error(429, "quota_exceeded");
        app.request(Method::DELETE, "/v1/agents/second", Some(&app.key_a), None)
            .await
            .expect(204);
        app.post(
            "/v1/agents",
            json!({"name": "third", "model": "fake-model"}),
        )
        .await
        .expect(201);
        app.cleanup(db).await;
    }
}

/// A sub-agent keeps its parent's agent version, model and tools (and always has
/// submit_result).
#[tokio::test]
async fn sub_agents_keep_their_parents_agent_version() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        app.post(
            "/v1/agents",
            json!({"name": "lead", "model": "fake-model", "tools": ["spawn_sub_agents", "think"]}),
        )
        .await
        .expect(201);
        let id = app
            .post("/v1/conversations", json!({"agent": "lead"}))
            .await
            .expect(201)["id"]
            .as_str()
            .expect("an id")
            .to_owned();
        app.llm.route(
            "delegate",
            [
                Llm::tool(
                    "call_spawn",
                    "spawn_sub_agents",
                    json!({"tasks": [{"prompt": "the child's task", "model": "another-model"}]}),
                ),
                Llm::text("all done"),
            ],
        );
        app.llm.route(
            "the child's task",
            [Llm::tool(
                "call_submit",
                "submit_result",
                json!({"result": "found it"}),
            )],
        );
        app.send(&id, "delegate this").await;
        app.wait_kind(&id, "idle").await;
        let children = app
            .get(&format!("/v1/conversations/{id}/children"))
            .await
            .expect(200);
        let child = &children["conversations"][0];
        assert_eq!(child["agent"], json!({"name": "lead", "version": 1}));
        assert_eq!(
            child["model"], "fake-model",
            "a task cannot leave its agent's model"
        );
        assert_eq!(child["tools"], json!(["spawn_sub_agents", "think"]));
        // The child was offered its agent's tools (less spawn_sub_agents, which sub-agents
        // never have) and submit_result, and its result reached the parent.
        let child_request = app
            .llm
            .requests()
            .into_iter()
            .find(|r| {
                request_messages(r).iter().any(|m| {
                    m["role"] == "user"
                        && m["content"]
                            .as_str()
                            .is_some_and(|c| c.contains("the child's task"))
                })
            })
            .expect("the child's request");
        let mut offered = tool_names(&child_request);
        offered.sort();
        assert_eq!(offered, ["submit_result", "think"]);
        let messages = app.messages(&id).await;
        assert!(
            messages
                .iter()
                .any(|m| m["content"]["tool_use_id"] == "call_spawn"
                    && m["content"]["output"]
                        .as_str()
                        .is_some_and(|o| o.contains("found it"))),
            "{messages:?}"
        );
        app.cleanup(db).await;
    }
}

/// An agent travels as one document: exported with every version (or the latest), imported
/// by another tenant in order under its name or `?as=`, refused when the name is taken or
/// the document is not one; the same from the command line.
#[tokio::test]
async fn an_agent_travels_as_one_document() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        app.post(
            "/v1/agents",
            json!({"name": "writer", "model": "fake-model", "system_prompt": "one"}),
        )
        .await
        .expect(201);
        put(
            &app,
            "/v1/agents/writer",
            &app.key_a,
            json!({"model": "fake-model", "system_prompt": "two", "tools": ["think"]}),
        )
        .await
        .expect(200);
        let document = app.get("/v1/agents/writer/export").await.expect(200);
        assert_eq!(document["format"], "bedrock.agent/1");
        assert_eq!(document["versions"].as_array().map(Vec::len), Some(2));
        assert_eq!(
            document["versions"][1]["definition"]["tools"],
            json!(["think"])
        );
        let latest = app
            .get("/v1/agents/writer/export?latest=true")
            .await
            .expect(200);
        assert_eq!(latest["versions"].as_array().map(Vec::len), Some(1));
        assert_eq!(latest["versions"][0]["version"], 2);
        app.get("/v1/agents/nobody/export")
            .await
            .expect_error(404, "not_found");

        // Tenant b imports it whole, in order; again is a clash unless renamed.
        let b = app.key_b.clone();
        let made = app
            .request(
                Method::POST,
                "/v1/agents/import",
                Some(&b),
                Some(document.clone()),
            )
            .await
            .expect(201);
        let prompts: Vec<&str> = made["agents"]
            .as_array()
            .expect("versions")
            .iter()
            .filter_map(|v| v["system_prompt"].as_str())
            .collect();
        assert_eq!(prompts, ["one", "two"]);
        app.request(
            Method::POST,
            "/v1/agents/import",
            Some(&b),
            Some(document.clone()),
        )
        .await
        .expect_error(409, "agent_exists");
        let renamed = app
            .request(
                Method::POST,
                "/v1/agents/import?as=writer-copy",
                Some(&b),
                Some(latest),
            )
            .await
            .expect(201);
        assert_eq!(renamed["agents"][0]["name"], "writer-copy");
        assert_eq!(renamed["agents"][0]["version"], 1);
        let theirs = app
            .request(Method::GET, "/v1/agents/writer/versions", Some(&b), None)
            .await
            .expect(200);
        assert_eq!(theirs["agents"].as_array().map(Vec::len), Some(2));

        // Not a document, or one whose versions POST /v1/agents would refuse: nothing made.
        let mut bad_tool = document.clone();
        bad_tool["versions"][1]["definition"]["tools"] = json!(["rm_rf"]);
        let mut named_inside = document.clone();
        named_inside["versions"][0]["definition"]["name"] = json!("other");
        for (query, body) in [
            ("?as=fresh", bad_tool),
            ("?as=fresh", named_inside),
            (
                "?as=fresh",
                json!({"format": "other/1", "name": "x", "versions": []}),
            ),
            ("?as=Bad%20Name", document.clone()),
            ("?as=import", document.clone()),
            ("", json!({"name": "x"})),
        ] {
            app.request(
                Method::POST,
                &format!("/v1/agents/import{query}"),
                Some(&b),
                Some(body),
            )
            .await
            .expect_error(400, "invalid_request");
        }
        app.request(Method::GET, "/v1/agents/fresh", Some(&b), None)
            .await
            .expect_error(404, "not_found");
        app.cleanup(db).await;
    }
}

/// `bedrock agent import` and `export`: a document in, the same document out, and a clash
/// refused.
#[tokio::test]
async fn the_command_line_exports_and_imports_agents() {
    use crate::support::process::command;
    let db = TestDb::sqlite();
    let llm = bedrock::testkit::FakeLlm::start().await;
    let workspace = crate::support::db::temp_dir("agent-cli");
    let run = |args: &[&str]| {
        command(&db, &llm, &workspace)
            .args(args)
            .output()
            .expect("the command runs")
    };
    assert!(run(&["tenant", "create", "acme"]).status.success());
    let file = workspace.with_extension("agent.json");
    std::fs::write(
        &file,
        json!({
            "format": "bedrock.agent/1",
            "name": "helper",
            "versions": [
                {"version": 4, "created_at": "2026-11-01T00:00:00+00:00", "definition": {"model": "m1"}},
                {"version": 5, "created_at": "2026-11-02T00:00:00+00:00", "definition": {"model": "m2", "network": true}},
            ],
        })
        .to_string(),
    )
    .expect("writes the document");
    let path = file.display().to_string();
    let imported = run(&["agent", "import", "acme", &path]);
    assert!(
        imported.status.success(),
        "{}",
        String::from_utf8_lossy(&imported.stderr)
    );
    let printed: Value = serde_json::from_slice(&imported.stdout).expect("JSON on stdout");
    assert_eq!(printed, json!({"name": "helper", "versions": [1, 2]}));
    let clash = run(&["agent", "import", "acme", &path]);
    assert!(!clash.status.success());
    assert!(String::from_utf8_lossy(&clash.stderr).contains("--as"));
    assert!(
        run(&["agent", "import", "acme", &path, "--as", "helper2"])
            .status
            .success()
    );

    let exported = run(&["agent", "export", "acme", "helper"]);
    assert!(
        exported.status.success(),
        "{}",
        String::from_utf8_lossy(&exported.stderr)
    );
    let document: Value = serde_json::from_slice(&exported.stdout).expect("JSON on stdout");
    assert_eq!(document["name"], "helper");
    let models: Vec<&str> = document["versions"]
        .as_array()
        .expect("versions")
        .iter()
        .filter_map(|v| v["definition"]["model"].as_str())
        .collect();
    assert_eq!(models, ["m1", "m2"]);
    assert_eq!(document["versions"][1]["definition"]["network"], true);
    let latest = run(&["agent", "export", "acme", "helper", "--latest"]);
    let latest: Value = serde_json::from_slice(&latest.stdout).expect("JSON on stdout");
    assert_eq!(latest["versions"].as_array().map(Vec::len), Some(1));
    assert!(!run(&["agent", "export", "acme", "nobody"]).status.success());
    let _ = std::fs::remove_file(&file);
}

/// An agent's permission rules through the real server: `allow` runs a call without the
/// approval `require_approval` would ask for, `deny` refuses one without running it (the LLM
/// gets the rule's message), `ask` asks the client first; the chain stays whole.
#[tokio::test]
async fn permission_rules_allow_deny_and_ask() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let created = app
            .post(
                "/v1/agents",
                json!({
                    "name": "careful",
                    "model": "fake-model",
                    "require_approval": ["bash"],
                    "permissions": [
                        {"tool": "bash", "input": {"command": "echo allowed*"}, "action": "allow"},
                        {"tool": "bash", "input": {"command": "rm *"}, "action": "deny", "message": "no deleting here"},
                        {"tool": "th?nk", "action": "ask"},
                    ],
                }),
            )
            .await
            .expect(201);
        assert_eq!(created["permissions"][1]["action"], "deny");
        let conv = app
            .post("/v1/conversations", json!({"agent": "careful"}))
            .await
            .expect(201);
        assert_eq!(conv["permissions"].as_array().map(Vec::len), Some(3));
        let id = conv["id"].as_str().expect("an id").to_owned();
        app.cwd(&id).await;
        std::fs::write(app.cwd(&id).await.join("data"), "keep me").expect("a file");
        app.llm.push([
            Llm::bash("call_allowed", "echo allowed one"),
            Llm::bash("call_denied", "rm -rf data"),
            Llm::tool("call_ask", "think", json!({"thoughts": "may I?"})),
            Llm::text("done"),
        ]);
        let mut ws = crate::support::ws::Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.send(&id, "go").await;
        // The only question is the one `ask` makes: the allowed bash ran without one.
        let request = ws.frame_of("client_request").await;
        assert_eq!(request["tool_use_id"], "call_ask");
        let request_id = request["request_id"].as_str().expect("an id").to_owned();
        app.post(
            &format!("/v1/conversations/{id}/requests/{request_id}"),
            json!({"payload": {"confirmed": true}}),
        )
        .await
        .expect(200);
        app.wait_kind(&id, "idle").await;
        let messages = app.messages(&id).await;
        let result = |call: &str| {
            messages
                .iter()
                .find(|m| m["content"]["tool_use_id"] == call)
                .unwrap_or_else(|| panic!("{call}'s result"))["content"]
                .clone()
        };
        assert_eq!(result("call_allowed")["ok"], true);
        assert!(
            result("call_allowed")["output"]
                .as_str()
                .is_some_and(|o| o.contains("allowed one"))
        );
        assert_eq!(result("call_denied")["ok"], false);
        assert_eq!(result("call_denied")["output"], "no deleting here");
        assert_eq!(result("call_ask")["ok"], true);
        assert_eq!(
            std::fs::read_to_string(app.cwd(&id).await.join("data")).expect("still there"),
            "keep me"
        );
        // Bad rules are refused at definition.
        for permissions in [
            json!([{"tool": "", "action": "allow"}]),
            json!([{"tool": "bash", "action": "maybe"}]),
            json!([{"tool": "bash", "action": "deny", "extra": 1}]),
            json!(
                (0..65)
                    .map(|_| json!({"tool": "*", "action": "ask"}))
                    .collect::<Vec<_>>()
            ),
        ] {
            app.post(
                "/v1/agents",
                json!({"name": "bad", "model": "m", "permissions": permissions}),
            )
            .await
            .expect_error(400, "invalid_request");
        }
        app.cleanup(db).await;
    }
}

/// A flood of creates at once cannot pass the `agents` quota: what is stored and what is
/// admitted and not yet written are counted together.
#[tokio::test]
async fn a_flood_of_agent_creates_makes_no_more_than_the_quota() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &[("BEDROCK_QUOTAS__AGENTS", "3")]).await;
        let creates = (0..12).map(|i| {
            app.post(
                "/v1/agents",
                json!({"name": format!("flood-{i}"), "model": "fake-model"}),
            )
        });
        let replies = futures::future::join_all(creates).await;
        let made = replies.iter().filter(|r| r.status == 201).count();
        let refused = replies.iter().filter(|r| r.status == 429).count();
        assert_eq!((made, refused), (3, 9), "{}", db.backend);
        let listed = app.get("/v1/agents").await.expect(200);
        assert_eq!(listed["agents"].as_array().map(Vec::len), Some(3));
        app.cleanup(db).await;
    }
}
