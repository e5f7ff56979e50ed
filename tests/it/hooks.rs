//! An agent's pre-tool-use hook and bounds (issue 38; docs/api.md, "Agents"). The hook is a
//! real HTTP server on loopback (allowed by the operator's egress list, as a tenant's MCP
//! server would be): it gets each call the rules did not deny, signed as Standard Webhooks
//! sign, and allows, denies, asks or replaces the input; one that times out, fails or is
//! out of the egress policy's reach decides by its `on_failure`. A hook's secret is never
//! shown nor exported. On SQLite and Postgres, through the real server.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use hmac::{Hmac, Mac};
use serde_json::{Value, json};

use crate::support::ws::Ws;
use crate::support::{TestApp, TestDb};
use bedrock::testkit::Reply as Llm;

const ALLOW_LOOPBACK: (&str, &str) = ("BEDROCK_EGRESS__ALLOW", r#"["127.0.0.1"]"#);
const SECRET: &str = "a-hook-secret-of-32-bytes-or-so!";

/// What the hook server was sent, and how it answers: by the call's command.
#[derive(Default)]
struct Hook {
    seen: Mutex<Vec<(HeaderMap, Value)>>,
    /// Answer after this long.
    delay: Mutex<Duration>,
    /// Answer with this status instead.
    status: Mutex<Option<u16>>,
}

async fn hook(
    State(hook): State<Arc<Hook>>,
    headers: HeaderMap,
    body: String,
) -> axum::response::Response {
    let call: Value = serde_json::from_str(&body).unwrap_or_default();
    hook.seen
        .lock()
        .expect("the hook's log")
        .push((headers.clone(), call.clone()));
    // The signature is checked here, as a hook's owner would, over the raw body.
    let id = headers["webhook-id"].to_str().unwrap_or_default();
    let timestamp = headers["webhook-timestamp"].to_str().unwrap_or_default();
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(SECRET.as_bytes()).expect("a key");
    mac.update(format!("{id}.{timestamp}.{body}").as_bytes());
    let expected = format!(
        "v1,{}",
        base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            mac.finalize().into_bytes()
        )
    );
    if headers["webhook-signature"].to_str().unwrap_or_default() != expected {
        return (StatusCode::UNAUTHORIZED, "bad signature").into_response();
    }
    let delay = *hook.delay.lock().expect("the delay");
    tokio::time::sleep(delay).await;
    if let Some(status) = *hook.status.lock().expect("the status") {
        return StatusCode::from_u16(status)
            .expect("a status")
            .into_response();
    }
    let command = call["input"]["command"].as_str().unwrap_or_default();
    let answer = if command.contains("deny") {
        json!({"decision": "deny", "message": "not on my watch"})
    } else if command.contains("ask") {
        json!({"decision": "ask"})
    } else if command.contains("swap") {
        json!({"decision": "allow", "input": {"command": "echo forbidden > forbidden.txt"}})
    } else if command.contains("rewrite") {
        json!({"decision": "allow", "input": {"command": "echo rewritten > rewritten.txt"}})
    } else {
        json!({"decision": "allow"})
    };
    axum::Json(answer).into_response()
}

async fn serve_hook() -> (SocketAddr, Arc<Hook>) {
    let state = Arc::new(Hook::default());
    let router = axum::Router::new()
        .route("/hook", axum::routing::post(hook))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move { axum::serve(listener, router).await });
    (addr, state)
}

/// An agent with the hook and these fields; a conversation of it. Returns its id and cwd.
async fn conversation(
    app: &TestApp,
    name: &str,
    hook: Value,
    extra: Value,
) -> (String, std::path::PathBuf) {
    let mut body = json!({
        "name": name,
        "model": "fake-model",
        "hooks": {"pre_tool_use": hook},
    });
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
    app.post("/v1/agents", body).await.expect(201);
    let conv = app
        .post("/v1/conversations", json!({"agent": name}))
        .await
        .expect(201);
    (
        conv["id"].as_str().expect("an id").to_owned(),
        std::path::PathBuf::from(conv["cwd"].as_str().expect("a cwd")),
    )
}

/// The hook allows (over the agent's require_approval), denies with its message, asks (a
/// confirm request), and replaces an input, which the core plans again so the rules still
/// hold; a call the rules deny never reaches it; every request is signed and says what is
/// called; each decision is stored as a system event.
#[tokio::test]
async fn a_hook_allows_denies_asks_and_replaces_input() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &[ALLOW_LOOPBACK]).await;
        let (addr, server) = serve_hook().await;
        let (id, cwd) = conversation(
            &app,
            "hooked",
            json!({"url": format!("http://{addr}/hook"), "secret": SECRET}),
            json!({
                "require_approval": ["bash"],
                "permissions": [{"tool": "bash", "input": {"command": "*forbidden*"}, "action": "deny", "message": "the rules forbid it"}],
            }),
        )
        .await;
        let agent = app.get("/v1/agents/hooked").await.expect(200);
        assert_eq!(agent["hooks"]["pre_tool_use"]["on_failure"], "deny");
        assert_eq!(agent["hooks"]["pre_tool_use"]["timeout_ms"], 5000);
        assert!(!agent.to_string().contains(SECRET), "{agent}");

        app.llm.push([
            Llm::bash("call_allowed", "echo allowed > allowed.txt"),
            Llm::bash("call_denied", "echo deny > denied.txt"),
            Llm::bash("call_forbidden", "echo forbidden > forbidden.txt"),
            Llm::bash("call_rewritten", "echo rewrite > original.txt"),
            Llm::bash("call_to_forbidden", "echo swap"),
            Llm::bash("call_asked", "echo ask > asked.txt"),
            Llm::text("done"),
        ]);
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.send(&id, "go").await;
        let request = ws.frame_of("client_request").await;
        assert!(
            request["request_type"]["confirm"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("echo ask")),
            "{request}"
        );
        let request_id = request["request_id"].as_str().expect("an id");
        app.post(
            &format!("/v1/conversations/{id}/requests/{request_id}"),
            json!({"payload": {"confirmed": true}}),
        )
        .await
        .expect(200);
        app.wait_kind(&id, "idle").await;

        assert_eq!(app.tool_result(&id, "call_allowed").await["ok"], true);
        assert!(cwd.join("allowed.txt").exists());
        let denied = app.tool_result(&id, "call_denied").await;
        assert_eq!(denied["ok"], false);
        assert_eq!(denied["output"], "not on my watch");
        assert!(!cwd.join("denied.txt").exists());
        let forbidden = app.tool_result(&id, "call_forbidden").await;
        assert_eq!(forbidden["output"], "the rules forbid it");
        assert_eq!(app.tool_result(&id, "call_rewritten").await["ok"], true);
        assert!(cwd.join("rewritten.txt").exists());
        assert!(!cwd.join("original.txt").exists());
        let to_forbidden = app.tool_result(&id, "call_to_forbidden").await;
        assert_eq!(to_forbidden["ok"], false);
        assert!(
            to_forbidden["output"]
                .as_str()
                .is_some_and(|o| o.contains("refused") && o.contains("the rules forbid it")),
            "{to_forbidden}"
        );
        assert!(!cwd.join("forbidden.txt").exists());
        assert!(cwd.join("asked.txt").exists());

        // Signed (checked by the server: a bad signature is a 401, which would have denied),
        // and one request per call the rules let through.
        let seen = server.seen.lock().expect("the log").clone();
        let called: Vec<&str> = seen
            .iter()
            .map(|(_, call)| call["tool_use_id"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(
            called,
            [
                "call_allowed",
                "call_denied",
                "call_rewritten",
                "call_to_forbidden",
                "call_asked"
            ]
        );
        let (headers, first) = &seen[0];
        assert_eq!(first["type"], "pre_tool_use");
        assert_eq!(first["tool"], "bash");
        assert_eq!(first["conversation_id"], id.as_str());
        assert_eq!(first["agent"], json!({"name": "hooked", "version": 1}));
        assert_eq!(
            first["input"],
            json!({"command": "echo allowed > allowed.txt"})
        );
        assert!(
            headers["webhook-id"]
                .to_str()
                .is_ok_and(|v| v.starts_with("msg_"))
        );

        // Each decision is stored with the call (a durable system event).
        let replay = Ws::connect(&app.ws_url(&id, "&after_event_id=0")).await;
        let mut replay = replay;
        replay.frame().await;
        let decisions = replay
            .frames_until(|f| {
                f["type"] == "system_event"
                    && f["event"]["type"] == "pre_tool_use_decision"
                    && f["event"]["tool_use_id"] == "call_asked"
            })
            .await;
        let decisions: Vec<(String, String)> = decisions
            .iter()
            .filter(|f| {
                f["type"] == "system_event" && f["event"]["type"] == "pre_tool_use_decision"
            })
            .map(|f| {
                (
                    f["event"]["tool_use_id"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    f["event"]["decision"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                )
            })
            .collect();
        assert_eq!(
            decisions,
            [
                ("call_allowed".into(), "allow".into()),
                ("call_denied".into(), "deny".into()),
                ("call_rewritten".into(), "allow".into()),
                ("call_to_forbidden".into(), "allow".into()),
                ("call_asked".into(), "ask".into()),
            ]
        );
        app.cleanup(db).await;
    }
}

/// A hook that answers too late, with an error status, or not at all decides by its
/// `on_failure`: deny (the default), allow or ask. A hook on an internal address the
/// operator did not allow is never reached (the egress policy), and the call is denied.
#[tokio::test]
async fn a_hook_that_fails_decides_by_its_on_failure() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[ALLOW_LOOPBACK]).await;
    let (addr, server) = serve_hook().await;
    *server.delay.lock().expect("the delay") = Duration::from_millis(1500);
    let url = format!("http://{addr}/hook");
    for (name, on_failure) in [
        ("slow-deny", "deny"),
        ("slow-allow", "allow"),
        ("slow-ask", "ask"),
    ] {
        let (id, cwd) = conversation(
            &app,
            name,
            json!({"url": url, "secret": SECRET, "timeout_ms": 200, "on_failure": on_failure}),
            // `allow` on failure is as if there were no hook: require_approval still asks.
            if on_failure == "allow" {
                json!({"require_approval": ["bash"]})
            } else {
                json!({})
            },
        )
        .await;
        app.llm.push([
            Llm::bash("call_slow", "echo ran > ran.txt"),
            Llm::text("done"),
        ]);
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.send(&id, "go").await;
        if on_failure != "deny" {
            let request = ws.frame_of("client_request").await;
            let request_id = request["request_id"].as_str().expect("an id");
            app.post(
                &format!("/v1/conversations/{id}/requests/{request_id}"),
                json!({"payload": {"confirmed": true}}),
            )
            .await
            .expect(200);
        }
        app.wait_kind(&id, "idle").await;
        let result = app.tool_result(&id, "call_slow").await;
        if on_failure == "deny" {
            assert_eq!(result["ok"], false);
            assert!(
                result["output"]
                    .as_str()
                    .is_some_and(|o| o.contains("hook failed") && o.contains("200 ms")),
                "{result}"
            );
            assert!(!cwd.join("ran.txt").exists());
        } else {
            assert_eq!(result["ok"], true, "{on_failure}: {result}");
            assert!(cwd.join("ran.txt").exists());
        }
    }
    // An error status.
    *server.delay.lock().expect("the delay") = Duration::ZERO;
    *server.status.lock().expect("the status") = Some(500);
    let (id, cwd) = conversation(
        &app,
        "erroring",
        json!({"url": url, "secret": SECRET}),
        json!({}),
    )
    .await;
    app.llm.push([
        Llm::bash("call_err", "echo ran > ran.txt"),
        Llm::text("done"),
    ]);
    app.send(&id, "go").await;
    app.wait_kind(&id, "idle").await;
    let result = app.tool_result(&id, "call_err").await;
    assert!(
        result["output"]
            .as_str()
            .is_some_and(|o| o.contains("HTTP 500")),
        "{result}"
    );
    assert!(!cwd.join("ran.txt").exists());
    app.cleanup(db).await;

    // Without the operator's allow list, a hook on loopback is out of reach, in every
    // spelling a tenant would try first.
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let (addr, server) = serve_hook().await;
    let port = addr.port();
    let spellings = [
        format!("http://{addr}/hook"),
        format!("http://localhost:{port}/hook"),
        format!("http://127.1:{port}/hook"),
        format!("http://0x7f000001:{port}/hook"),
        format!("http://2130706433:{port}/hook"),
        format!("http://0.0.0.0:{port}/hook"),
        format!("http://[::ffff:127.0.0.1]:{port}/hook"),
        format!("http://[::1]:{port}/hook"),
    ];
    for (n, url) in spellings.iter().enumerate() {
        let (id, cwd) = conversation(
            &app,
            &format!("internal-{n}"),
            json!({"url": url, "secret": SECRET, "on_failure": "deny"}),
            json!({}),
        )
        .await;
        app.llm.push([
            Llm::bash("call_internal", "echo ran > ran.txt"),
            Llm::text("done"),
        ]);
        app.send(&id, "go").await;
        app.wait_kind(&id, "idle").await;
        let result = app.tool_result(&id, "call_internal").await;
        assert_eq!(result["ok"], false, "{url}: {result}");
        assert!(!cwd.join("ran.txt").exists(), "{url}");
    }
    assert!(server.seen.lock().expect("the log").is_empty());
    app.cleanup(db).await;
}

/// A hook's secret is never shown nor exported; a document without it is refused at import
/// until it is given again. Bad hooks and bounds are 400. An agent's bounds hold: a turn
/// past its LLM steps ends in error `limit`, a spawn of more tasks than it allows is refused.
#[tokio::test]
async fn hook_secrets_stay_and_bounds_hold() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let hook = json!({"url": "https://hooks.example.com/pre", "secret": SECRET});
    app.post(
        "/v1/agents",
        json!({"name": "secretive", "model": "fake-model", "hooks": {"pre_tool_use": hook}}),
    )
    .await
    .expect(201);
    let exported = app.get("/v1/agents/secretive/export").await.expect(200);
    assert!(!exported.to_string().contains(SECRET), "{exported}");
    assert_eq!(
        exported["versions"][0]["definition"]["hooks"]["pre_tool_use"]["url"],
        "https://hooks.example.com/pre"
    );
    let refused = app
        .post("/v1/agents/import?as=copy", exported.clone())
        .await
        .expect_error(400, "invalid_request");
    assert!(refused.contains("secret"), "{refused}");
    let mut with_secret = exported;
    with_secret["versions"][0]["definition"]["hooks"]["pre_tool_use"]["secret"] = json!(SECRET);
    app.post("/v1/agents/import?as=copy", with_secret)
        .await
        .expect(201);

    for bad in [
        json!({"url": "ftp://x.example/hook", "secret": SECRET}),
        json!({"url": "not a url", "secret": SECRET}),
        json!({"url": "https://user:pw@x.example/hook", "secret": SECRET}),
        json!({"url": "https://x.example/hook"}),
        json!({"url": "https://x.example/hook", "secret": "short"}),
        json!({"url": "https://x.example/hook", "secret": "whsec_!!!!!!!!!!!!!!!!"}),
        json!({"url": "https://x.example/hook", "secret": SECRET, "timeout_ms": 0}),
        json!({"url": "https://x.example/hook", "secret": SECRET, "timeout_ms": 30001}),
        json!({"url": "https://x.example/hook", "secret": SECRET, "on_failure": "maybe"}),
        json!({"url": "https://x.example/hook", "secret": SECRET, "extra": 1}),
    ] {
        app.post(
            "/v1/agents",
            json!({"name": "bad", "model": "m", "hooks": {"pre_tool_use": bad}}),
        )
        .await
        .expect_error(400, "invalid_request");
    }
    for bad in [
        json!({"limits": {"max_llm_steps": 0}}),
        json!({"limits": {"max_llm_steps": 1_000_000}}),
        json!({"sub_agents": {"max_tasks": 1_000}}),
        json!({"sub_agents": {"timeout_ms": 0}}),
        json!({"limits": {"unknown": 1}}),
        // serde would take a struct from an array; the contract takes objects only.
        json!({"limits": [null, null]}),
        json!({"sub_agents": [1, 1, 1]}),
        json!({"hooks": {"pre_tool_use": ["https://x.example/hook", SECRET]}}),
        json!({"permissions": [["bash", {}, "allow", null]]}),
    ] {
        let mut body = json!({"name": "bad", "model": "m"});
        if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), bad) {
            body.extend(extra);
        }
        app.post("/v1/agents", body)
            .await
            .expect_error(400, "invalid_request");
    }
    app.get("/v1/agents/bad")
        .await
        .expect_error(404, "not_found");

    let made = app
        .post(
            "/v1/agents",
            json!({"name": "bounded", "model": "fake-model", "limits": {"max_llm_steps": 1}, "sub_agents": {"max_tasks": 1}}),
        )
        .await
        .expect(201);
    assert_eq!(made["limits"], json!({"max_llm_steps": 1}));
    assert_eq!(made["sub_agents"], json!({"max_tasks": 1}));
    let conv = app
        .post("/v1/conversations", json!({"agent": "bounded"}))
        .await
        .expect(201);
    let id = conv["id"].as_str().expect("an id").to_owned();
    app.llm.push([
        Llm::tool(
            "call_spawn",
            "spawn_sub_agents",
            json!({"tasks": [{"prompt": "one"}, {"prompt": "two"}]}),
        ),
        Llm::text("never asked: one step only"),
    ]);
    app.send(&id, "go").await;
    let state = app.wait_kind(&id, "error").await;
    assert_eq!(state["error_kind"], "limit", "{state}");
    let spawn = app.tool_result(&id, "call_spawn").await;
    assert_eq!(spawn["ok"], false);
    assert!(
        spawn["output"].as_str().is_some_and(|o| o.contains('1')),
        "{spawn}"
    );
    app.cleanup(db).await;
}
