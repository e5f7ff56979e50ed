//! Tenants' own MCP tool servers (issue 23; docs/api.md, "MCP"): a real rmcp server started
//! here offers two tools (one slow); its tools join new conversations as `kit__echo` and
//! `kit__slow`, and run under the same rules as built-in tools: approvals, cancel (the MCP
//! call is cancelled), the output cap, failures as tool results. A server that does not
//! answer at creation is left out with a system message.
//!
//! The egress policy (src/egress.rs; docs/security.md, "Server-side requests (SSRF)"), as a
//! hostile tenant would try it: internal addresses in every spelling are refused at
//! registration; a server that answers with a secret in a failed response never shows it to
//! the tenant; a redirect is not followed; a server allowed at registration and no longer
//! allowed is not connected to; a name that resolves to loopback is refused by the
//! connection's resolver. The test servers listen on loopback only, and the apps that use
//! them allow 127.0.0.1 (`BEDROCK_EGRESS__ALLOW`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::middleware::Next;
use axum::response::IntoResponse as _;
use bedrock::egress::{Egress, EgressError, Lookup};
use bedrock::store::McpServer;

use bedrock::testkit::Reply;
use reqwest::Method;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::model::ContentBlock;
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler, tool, tool_handler, tool_router};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::support::{TestApp, TestDb, WAIT, eventually, request_messages, tool_names};

#[derive(Debug, Deserialize, schemars::JsonSchema)]
struct EchoArgs {
    /// What to say back.
    text: String,
}

/// What the test server saw.
#[derive(Debug, Default)]
struct Seen {
    calls: AtomicUsize,
    slow_started: AtomicUsize,
    slow_cancelled: AtomicUsize,
    tokens: std::sync::Mutex<Vec<String>>,
}

#[derive(Clone)]
struct Kit {
    seen: Arc<Seen>,
    tool_router: ToolRouter<Self>,
}

#[tool_router]
impl Kit {
    #[tool(description = "Says the text back.")]
    async fn echo(
        &self,
        Parameters(args): Parameters<EchoArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.seen.calls.fetch_add(1, Ordering::SeqCst);
        if let Some(parts) = ctx.extensions.get::<http::request::Parts>()
            && let Some(token) = parts.headers.get("x-token").and_then(|v| v.to_str().ok())
            && let Ok(mut tokens) = self.seen.tokens.lock()
        {
            tokens.push(token.to_owned());
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(format!(
            "echo: {}",
            args.text
        ))]))
    }

    #[tool(description = "Takes its time, until cancelled.")]
    async fn slow(&self, ctx: RequestContext<RoleServer>) -> Result<CallToolResult, ErrorData> {
        self.seen.slow_started.fetch_add(1, Ordering::SeqCst);
        tokio::select! {
            () = ctx.ct.cancelled() => {
                self.seen.slow_cancelled.fetch_add(1, Ordering::SeqCst);
                Err(ErrorData::internal_error("cancelled", None))
            }
            () = tokio::time::sleep(Duration::from_secs(120)) => {
                Ok(CallToolResult::success(vec![ContentBlock::text("finally")]))
            }
        }
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Kit {}

/// The allow list of the apps whose tests use the test servers (on 127.0.0.1).
const ALLOW_LOOPBACK: (&str, &str) = ("BEDROCK_EGRESS__ALLOW", r#"["127.0.0.1"]"#);

/// What a test server answers instead of MCP when told to: what a hostile tenant points
/// Bedrock at to read an internal service's reply.
#[derive(Debug, Default)]
struct Gate {
    mode: AtomicU8,
    requests: AtomicUsize,
    redirect_to: std::sync::Mutex<String>,
}

const MCP: u8 = 0;
const FORBIDDEN: u8 = 1;
const SERVER_ERROR: u8 = 2;
const NOT_JSON_RPC: u8 = 3;
const HTML: u8 = 4;
const REDIRECT: u8 = 5;

/// The body of every failed answer: it must never reach the tenant.
const SECRET: &str = "INTERNAL-SECRET-7f3a: db password hunter2";

async fn gate(
    State(gate): State<Arc<Gate>>,
    request: axum::extract::Request,
    next: Next,
) -> axum::response::Response {
    use http::StatusCode;
    use http::header::{CONTENT_TYPE, LOCATION};
    gate.requests.fetch_add(1, Ordering::SeqCst);
    let json = json!({"error": SECRET, "jsonrpc": "2.0"}).to_string();
    match gate.mode.load(Ordering::SeqCst) {
        FORBIDDEN => (StatusCode::FORBIDDEN, SECRET).into_response(),
        SERVER_ERROR => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(CONTENT_TYPE, "application/json")],
            json,
        )
            .into_response(),
        NOT_JSON_RPC => {
            (StatusCode::OK, [(CONTENT_TYPE, "application/json")], json).into_response()
        }
        HTML => (
            StatusCode::OK,
            [(CONTENT_TYPE, "text/html")],
            format!("<html>{SECRET}</html>"),
        )
            .into_response(),
        REDIRECT => {
            let to = gate
                .redirect_to
                .lock()
                .map(|to| to.clone())
                .unwrap_or_default();
            (StatusCode::TEMPORARY_REDIRECT, [(LOCATION, to)], SECRET).into_response()
        }
        _ => next.run(request).await,
    }
}

/// The test server on a loopback port: its URL, what it saw, and its stop switch.
async fn kit() -> (String, Arc<Seen>, CancellationToken) {
    let (url, seen, stop, _) = gated_kit().await;
    (url, seen, stop)
}

/// [`kit`] behind a [`Gate`].
async fn gated_kit() -> (String, Arc<Seen>, CancellationToken, Arc<Gate>) {
    let seen = Arc::new(Seen::default());
    let stop = CancellationToken::new();
    let shared = seen.clone();
    let service = StreamableHttpService::new(
        move || {
            Ok(Kit {
                seen: shared.clone(),
                tool_router: Kit::tool_router(),
            })
        },
        Arc::new(LocalSessionManager::default()),
        // The test names (rebind.test, ...) are hosts it serves too.
        StreamableHttpServerConfig::default()
            .with_allowed_hosts(["localhost", "127.0.0.1", "rebind.test", "mixed.test"])
            .with_cancellation_token(stop.child_token()),
    );
    let switch = Arc::new(Gate::default());
    let app = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn_with_state(switch.clone(), gate));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("an address");
    let until = stop.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { until.cancelled().await })
            .await;
    });
    (format!("http://{addr}/mcp"), seen, stop, switch)
}

/// [`kit`] on a runtime of its own, and what kills it: its tasks and sockets go at once,
/// as when a server's process is killed (the connections reset, every reconnect refused).
fn killable_kit() -> (String, Arc<Seen>, impl FnOnce()) {
    let (ready, told) = std::sync::mpsc::channel();
    let (kill, killed) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime");
        let (url, seen, _stop) = runtime.block_on(kit());
        let _ = ready.send((url, seen));
        let _ = runtime.block_on(killed);
        // Dropping the runtime drops every task: the listener and the connections close.
        runtime.shutdown_background();
    });
    let (url, seen) = told.recv().expect("the server starts");
    (url, seen, move || {
        let _ = kill.send(());
        let _ = thread.join();
    })
}

/// A tenant's MCP server killed in the middle of a call (issue 42, item 5): the call fails
/// within seconds with a result that names the server and what happened (the client's
/// reconnects are bounded), not at the tool time limit, and the conversation goes on.
#[tokio::test]
async fn a_server_killed_mid_call_fails_the_call_within_seconds() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &[ALLOW_LOOPBACK]).await;
        let (url, seen, kill) = killable_kit();
        app.post("/v1/mcp_servers", json!({"name": "kit", "url": url}))
            .await
            .expect(201);
        let conv = app.post("/v1/conversations", json!({})).await.expect(201);
        let id = conv["id"].as_str().expect("an id").to_owned();
        app.llm.push([
            Reply::tool("call_slow", "kit__slow", json!({})),
            Reply::text("the server died"),
        ]);
        app.send(&id, "slow please").await;
        eventually("the slow tool to start", WAIT, || async {
            (seen.slow_started.load(Ordering::SeqCst) == 1).then_some(())
        })
        .await;
        let killed_at = std::time::Instant::now();
        tokio::task::spawn_blocking(kill).await.expect("killed");
        eventually("the call to fail", Duration::from_secs(30), || async {
            let out = tool_output(&app.messages(&id).await, "call_slow");
            (!out.is_null()).then_some(())
        })
        .await;
        let failed_after = killed_at.elapsed();
        app.wait_kind(&id, "idle").await;
        let out = tool_output(&app.messages(&id).await, "call_slow");
        assert_eq!(out["ok"], false, "{out}");
        let text = out["output"].as_str().unwrap_or_default();
        assert!(text.contains("kit"), "names the server: {out}");
        // Seconds, not the tool time limit (120 s): bounded reconnects, a margin for a busy
        // machine.
        assert!(
            failed_after < Duration::from_secs(20),
            "failed after {failed_after:?}: {out}"
        );
        app.cleanup(db).await;
    }
}

/// What a hostile tenant tries first with its own MCP server: one that never answers a
/// call. The call is cut at the tool time limit (here 2 s), the server is told to cancel,
/// and the conversation goes on: a tenant's server holds its own conversation no longer
/// than a slow command would.
#[tokio::test]
async fn a_server_that_never_answers_is_cut_at_the_tool_time_limit() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(
            &db,
            &[ALLOW_LOOPBACK, ("BEDROCK_TOOLS__BASH_TIMEOUT_MS", "2000")],
        )
        .await;
        let (url, seen, stop) = kit().await;
        app.post("/v1/mcp_servers", json!({"name": "kit", "url": url}))
            .await
            .expect(201);
        let conv = app.post("/v1/conversations", json!({})).await.expect(201);
        let id = conv["id"].as_str().expect("an id").to_owned();
        app.llm.push([
            Reply::tool("call_slow", "kit__slow", json!({})),
            Reply::text("it never answered"),
        ]);
        app.send(&id, "slow please").await;
        app.wait_kind(&id, "idle").await;
        let out = tool_output(&app.messages(&id).await, "call_slow");
        assert_eq!(out["ok"], false, "{out}");
        assert!(
            out["output"]
                .as_str()
                .unwrap_or_default()
                .contains("did not answer within 2 s"),
            "{out}"
        );
        eventually("the server to be told to cancel", WAIT, || async {
            (seen.slow_cancelled.load(Ordering::SeqCst) == 1).then_some(())
        })
        .await;
        stop.cancel();
        app.cleanup(db).await;
    }
}

fn tool_output(messages: &[Value], id: &str) -> Value {
    messages
        .iter()
        .find(|m| m["message_type"] == "tool" && m["content"]["tool_use_id"] == id)
        .map(|m| m["content"].clone())
        .unwrap_or(Value::Null)
}

#[tokio::test]
async fn tenant_mcp_tools_run_like_built_in_ones() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(
            &db,
            &[("BEDROCK_TOOLS__OUTPUT_CAP_BYTES", "64"), ALLOW_LOOPBACK],
        )
        .await;
        let (url, seen, stop) = kit().await;
        // Registered; the header's value is never shown again.
        let created = app
            .post(
                "/v1/mcp_servers",
                json!({"name": "kit", "url": url, "headers": {"x-token": "s3cret"}}),
            )
            .await
            .expect(201);
        assert_eq!(created["header_names"], json!(["x-token"]));
        assert!(!created.to_string().contains("s3cret"));
        let listed = app.get("/v1/mcp_servers").await.expect(200);
        assert_eq!(listed["servers"][0]["name"], "kit");
        assert!(!listed.to_string().contains("s3cret"));
        app.post("/v1/mcp_servers", json!({"name": "kit", "url": url}))
            .await
            .expect_error(409, "mcp_server_exists");
        app.post("/v1/mcp_servers", json!({"name": "a__b", "url": url}))
            .await
            .expect_error(400, "invalid_request");
        app.post("/v1/mcp_servers", json!({"name": "x", "url": "ftp://x"}))
            .await
            .expect_error(400, "invalid_request");
        // Another tenant does not see it.
        let other = app
            .request(Method::GET, "/v1/mcp_servers", Some(&app.key_b), None)
            .await
            .expect(200);
        assert_eq!(other["servers"], json!([]));

        // A new conversation gets its tools, gated where asked.
        let conv = app
            .post(
                "/v1/conversations",
                json!({"require_approval": ["kit__slow"]}),
            )
            .await
            .expect(201);
        assert_eq!(conv["mcp_tools"], json!(["kit__echo", "kit__slow"]));
        let id = conv["id"].as_str().expect("an id").to_owned();
        app.llm.push([
            Reply::tool(
                "call_echo",
                "kit__echo",
                json!({"text": "hello from the LLM"}),
            ),
            Reply::text("echoed"),
        ]);
        app.send(&id, "echo it").await;
        app.wait_kind(&id, "idle").await;
        let requests = app.llm.requests();
        let names = tool_names(&requests[0]);
        assert!(names.contains(&"kit__echo".to_owned()) && names.contains(&"bash".to_owned()));
        let messages = app.messages(&id).await;
        let echo = tool_output(&messages, "call_echo");
        assert_eq!(echo["ok"], true);
        assert_eq!(echo["output"], "echo: hello from the LLM");
        assert_eq!(*seen.tokens.lock().expect("tokens"), ["s3cret"]);
        // The result reached the LLM as a tool result.
        let last = request_messages(requests.last().expect("a request"));
        assert!(
            last.iter()
                .any(|m| m["content"] == "echo: hello from the LLM")
        );

        // The output cap (64 bytes).
        app.llm.push([
            Reply::tool("call_long", "kit__echo", json!({"text": "x".repeat(500)})),
            Reply::text("long"),
        ]);
        app.send(&id, "a long one").await;
        app.wait_kind(&id, "idle").await;
        let long = tool_output(&app.messages(&id).await, "call_long");
        assert!(
            long["output"]
                .as_str()
                .is_some_and(|o| o.contains("[output truncated: 506 bytes, 64 kept]")),
            "{long}"
        );

        // Approval, then cancel mid-call: the MCP call is cancelled.
        app.llm
            .push([Reply::tool("call_slow", "kit__slow", json!({}))]);
        app.send(&id, "slow please").await;
        let request_id = eventually("a pending request", WAIT, || async {
            let mut ws = crate::support::ws::Ws::connect(&app.ws_url(&id, "")).await;
            let snapshot = ws.frame_of("snapshot").await;
            snapshot["pending_requests"][0]["request_id"]
                .as_str()
                .map(str::to_owned)
        })
        .await;
        app.post(
            &format!("/v1/conversations/{id}/requests/{request_id}"),
            json!({"payload": {"confirmed": true}}),
        )
        .await
        .expect(200);
        eventually("the slow tool to start", WAIT, || async {
            (seen.slow_started.load(Ordering::SeqCst) == 1).then_some(())
        })
        .await;
        app.post(&format!("/v1/conversations/{id}/cancel"), json!({}))
            .await
            .expect(202);
        app.wait_kind(&id, "idle").await;
        eventually("the server to see the cancel", WAIT, || async {
            (seen.slow_cancelled.load(Ordering::SeqCst) == 1).then_some(())
        })
        .await;
        assert_eq!(
            tool_output(&app.messages(&id).await, "call_slow")["cancelled"],
            true
        );

        // The server down mid-conversation: a failed result the LLM can read.
        stop.cancel();
        app.llm.push([
            Reply::tool("call_down", "kit__echo", json!({"text": "anyone?"})),
            Reply::text("it is down"),
        ]);
        app.send(&id, "again").await;
        app.wait_kind(&id, "idle").await;
        let down = tool_output(&app.messages(&id).await, "call_down");
        assert_eq!(down["ok"], false);
        assert!(
            down["output"].as_str().is_some_and(|o| o.contains("kit")),
            "{down}"
        );

        // Down at creation: left out, and the conversation says so.
        let later = app.post("/v1/conversations", json!({})).await.expect(201);
        assert!(later.get("mcp_tools").is_none(), "{later}");
        let later_id = later["id"].as_str().expect("an id");
        let notice = app.messages(later_id).await;
        assert_eq!(notice.len(), 1);
        assert_eq!(notice[0]["message_type"], "system");
        assert!(
            notice[0]["content"]["text"]
                .as_str()
                .is_some_and(|t| t.contains("MCP server kit")),
            "{notice:?}"
        );
        // Removed: 204, then 404.
        app.request(
            Method::DELETE,
            "/v1/mcp_servers/kit",
            Some(&app.key_a),
            None,
        )
        .await
        .expect(204);
        app.request(
            Method::DELETE,
            "/v1/mcp_servers/kit",
            Some(&app.key_a),
            None,
        )
        .await
        .expect_error(404, "not_found");
        app.cleanup(db).await;
    }
}

/// The URLs a hostile tenant registers first: internal addresses in every spelling a URL
/// parser accepts, and the names of the host itself.
const INTERNAL: &[&str] = &[
    "http://127.0.0.1:5432/",
    "http://127.0.0.1/mcp",
    "http://127.0.0.2:8080/mcp",
    "http://127.1/",
    "http://2130706433/",
    "http://0x7f000001/",
    "http://0x7f.1/",
    "http://0177.0.0.1/",
    "http://017700000001/",
    "http://127.0.0.1./",
    "http://%31%32%37.0.0.1/",
    "http://0.0.0.0:8080/",
    "http://0/",
    "http://[::1]:8080/mcp",
    "http://[::]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:7f00:1]/",
    "http://[::127.0.0.1]/",
    "http://[64:ff9b::127.0.0.1]/",
    "http://[2002:7f00:1::]/",
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://2852039166/",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://[::ffff:169.254.169.254]/",
    "http://169.254.1.1/",
    "http://[fe80::1]/",
    "http://10.0.0.1/",
    "http://172.16.0.1/",
    "http://192.168.0.1/",
    "http://[::ffff:10.0.0.1]/",
    "http://100.64.0.1/",
    "http://[fc00::1]/",
    "http://[fd12::1]/",
    "http://224.0.0.1/",
    "http://[ff02::1]/",
    "http://255.255.255.255/",
    "http://192.0.2.1/",
    "http://198.18.0.1/",
    "http://240.0.0.1/",
    "http://localhost/",
    "http://LOCALHOST:8080/",
    "http://localhost./",
    "http://mcp.localhost/",
    "https://localhost:8443/mcp",
];

/// Names in /etc/hosts (other than localhost, refused by name) that resolve to loopback:
/// refused for what they resolve to. The lookup reads the file; nothing leaves the host.
fn loopback_names_in_hosts_file() -> Vec<String> {
    let hosts = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
    hosts
        .lines()
        .map(|line| line.split('#').next().unwrap_or_default())
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let ip: std::net::IpAddr = words.next()?.parse().ok()?;
            ip.is_loopback()
                .then(|| words.map(str::to_owned).collect::<Vec<_>>())
        })
        .flatten()
        .filter(|name| {
            let name = name.to_ascii_lowercase();
            name != "localhost"
                && !name.ends_with(".localhost")
                && name.contains(|c: char| c.is_ascii_alphabetic())
        })
        .collect()
}

#[tokio::test]
async fn internal_addresses_are_refused_at_registration_in_every_spelling() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let mut urls: Vec<String> = INTERNAL.iter().map(|u| (*u).to_owned()).collect();
        for name in loopback_names_in_hosts_file() {
            urls.push(format!("http://{name}:8080/mcp"));
        }
        for url in &urls {
            let message = app
                .post("/v1/mcp_servers", json!({"name": "inside", "url": url}))
                .await
                .expect_error(400, "egress_refused");
            assert!(
                message.starts_with("url: the address of ") && message.contains("is not allowed ("),
                "{url}: {message}"
            );
        }
        let message = app
            .post(
                "/v1/mcp_servers",
                json!({"name": "creds", "url": "http://user:pw@8.8.8.8/mcp"}),
            )
            .await
            .expect_error(400, "egress_refused");
        assert!(message.contains("user name or password"), "{message}");
        // The metadata address names its range.
        let message = app
            .post(
                "/v1/mcp_servers",
                json!({"name": "meta", "url": "http://0xa9fea9fe/"}),
            )
            .await
            .expect_error(400, "egress_refused");
        assert_eq!(
            message,
            "url: the address of 169.254.169.254 is not allowed (cloud metadata)"
        );
        // Nothing was stored; a public address is (it is not connected to here).
        assert_eq!(
            app.get("/v1/mcp_servers").await.expect(200)["servers"],
            json!([])
        );
        app.post(
            "/v1/mcp_servers",
            json!({"name": "public", "url": "http://8.8.8.8/mcp"}),
        )
        .await
        .expect(201);
        app.request(
            Method::DELETE,
            "/v1/mcp_servers/public",
            Some(&app.key_a),
            None,
        )
        .await
        .expect(204);
        app.cleanup(db).await;
    }
}

/// A tool call of `kit__echo` in conversation `id`; its result.
async fn echo_result(app: &TestApp, id: &str, call: &str) -> Value {
    app.llm.push([
        Reply::tool(call, "kit__echo", json!({"text": "hello"})),
        Reply::text("done"),
    ]);
    app.send(id, "echo").await;
    app.wait_kind(id, "idle").await;
    tool_output(&app.messages(id).await, call)
}

/// The conversation's first message: the system notice of servers left out.
async fn notice(app: &TestApp) -> String {
    let created = app.post("/v1/conversations", json!({})).await.expect(201);
    assert!(created.get("mcp_tools").is_none(), "{created}");
    let id = created["id"].as_str().expect("an id");
    let messages = app.messages(id).await;
    assert_eq!(messages[0]["message_type"], "system", "{messages:?}");
    messages[0]["content"]["text"]
        .as_str()
        .expect("a text")
        .to_owned()
}

#[tokio::test]
async fn a_failed_answer_is_never_shown_to_the_tenant_and_a_redirect_is_not_followed() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &[ALLOW_LOOPBACK]).await;
        let (url, seen, stop, gate) = gated_kit().await;
        // Allowed: 127.0.0.1 and nothing else of loopback.
        app.post(
            "/v1/mcp_servers",
            json!({"name": "other", "url": url.replace("127.0.0.1", "127.0.0.2")}),
        )
        .await
        .expect_error(400, "egress_refused");
        app.post("/v1/mcp_servers", json!({"name": "kit", "url": url}))
            .await
            .expect(201);
        let conv = app.post("/v1/conversations", json!({})).await.expect(201);
        assert_eq!(conv["mcp_tools"], json!(["kit__echo", "kit__slow"]));
        let id = conv["id"].as_str().expect("an id").to_owned();
        assert_eq!(
            echo_result(&app, &id, "call_ok").await["output"],
            "echo: hello"
        );

        // A listener where the redirect points: nothing may connect to it.
        let trap = tokio::net::TcpListener::bind("127.0.0.2:0")
            .await
            .expect("a port on 127.0.0.2");
        let trap_addr = trap.local_addr().expect("an address");
        let trapped = Arc::new(AtomicUsize::new(0));
        let count = trapped.clone();
        let trap_task = tokio::spawn(async move {
            while let Ok((_socket, _)) = trap.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
            }
        });
        if let Ok(mut to) = gate.redirect_to.lock() {
            *to = format!("http://{trap_addr}/mcp");
        }

        for (mode, words) in [
            (FORBIDDEN, "it answered HTTP 403"),
            (SERVER_ERROR, "it answered HTTP 500"),
            (NOT_JSON_RPC, "its answer is not valid MCP"),
            (HTML, "its answer is not valid MCP"),
            (
                REDIRECT,
                "it answered HTTP 307, a redirect, which is not followed",
            ),
        ] {
            gate.mode.store(mode, Ordering::SeqCst);
            // In a tool result.
            let result = echo_result(&app, &id, &format!("call_{mode}")).await;
            assert_eq!(result["ok"], false, "{result}");
            let output = result["output"].as_str().expect("an output");
            assert!(output.contains(words), "mode {mode}: {output}");
            assert!(
                !output.contains("SECRET") && !output.contains("hunter2"),
                "{output}"
            );
            // In the system message of a new conversation.
            let text = notice(&app).await;
            assert!(
                text.contains("MCP server kit") && text.contains(words),
                "mode {mode}: {text}"
            );
            assert!(
                !text.contains("SECRET") && !text.contains("hunter2"),
                "{text}"
            );
        }
        assert_eq!(
            trapped.load(Ordering::SeqCst),
            0,
            "the redirect was followed"
        );
        // Serving MCP again: the same conversation's calls work.
        gate.mode.store(MCP, Ordering::SeqCst);
        assert_eq!(
            echo_result(&app, &id, "call_again").await["output"],
            "echo: hello"
        );
        // Nowhere the tenant or its LLM can read.
        let all = serde_json::to_string(&app.messages(&id).await).expect("JSON");
        assert!(!all.contains("hunter2"), "{all}");
        let requests = serde_json::to_string(&app.llm.requests()).expect("JSON");
        assert!(!requests.contains("hunter2"));
        assert_eq!(seen.calls.load(Ordering::SeqCst), 2);
        trap_task.abort();
        stop.cancel();
        app.cleanup(db).await;
    }
}

#[tokio::test]
async fn a_server_no_longer_allowed_is_refused_at_connect_time() {
    for db in TestDb::each().await {
        let mut app = TestApp::spawn_with(&db, &[ALLOW_LOOPBACK]).await;
        let (url, _seen, stop, gate) = gated_kit().await;
        // Registered while allowed: by name (localhost, allowed through 127.0.0.1) and by
        // address.
        let by_name = url.replace("127.0.0.1", "localhost");
        app.post("/v1/mcp_servers", json!({"name": "kit", "url": by_name}))
            .await
            .expect(201);
        app.post("/v1/mcp_servers", json!({"name": "lit", "url": url}))
            .await
            .expect(201);
        let conv = app.post("/v1/conversations", json!({})).await.expect(201);
        assert_eq!(
            conv["mcp_tools"],
            json!(["kit__echo", "kit__slow", "lit__echo", "lit__slow"])
        );
        let id = conv["id"].as_str().expect("an id").to_owned();
        assert_eq!(echo_result(&app, &id, "call_ok").await["ok"], true);

        // The operator takes 127.0.0.1 off the allow list: the stored URLs are not connected
        // to, whatever they were at registration.
        app.stop().await;
        app.extra.clear();
        app.start().await;
        let before = gate.requests.load(Ordering::SeqCst);
        let result = echo_result(&app, &id, "call_refused").await;
        assert_eq!(result["ok"], false, "{result}");
        assert!(
            result["output"]
                .as_str()
                .is_some_and(|o| o.contains("the address of localhost is not allowed (loopback)")),
            "{result}"
        );
        let text = notice(&app).await;
        assert!(
            text.contains("the address of localhost is not allowed (loopback)")
                && text.contains("the address of 127.0.0.1 is not allowed (loopback)"),
            "{text}"
        );
        assert_eq!(
            gate.requests.load(Ordering::SeqCst),
            before,
            "a refused server was reached"
        );
        stop.cancel();
        app.cleanup(db).await;
    }
}

/// A resolver that knows a few test names (all loopback), and counts its lookups.
fn names(
    table: &'static [(&'static str, &'static [&'static str])],
    lookups: Arc<AtomicUsize>,
) -> Lookup {
    Arc::new(move |name: String| {
        lookups.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            table
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, ips)| ips.iter().filter_map(|ip| ip.parse().ok()).collect())
                .ok_or_else(|| std::io::Error::other("no such name"))
        })
    })
}

const NAMES: &[(&str, &[&str])] = &[
    ("rebind.test", &["127.0.0.1"]),
    ("mixed.test", &["127.0.0.2", "127.0.0.1"]),
];

#[tokio::test]
async fn the_connection_resolver_refuses_a_name_that_resolves_to_a_refused_address() {
    let (url, _seen, stop, gate) = gated_kit().await;
    let port = url::Url::parse(&url)
        .ok()
        .and_then(|u| u.port())
        .expect("a port");
    let server = |host: &str| McpServer {
        name: "kit".into(),
        url: format!("http://{host}:{port}/mcp"),
        headers: Default::default(),
        created_at: String::new(),
    };
    let lookups = Arc::new(AtomicUsize::new(0));
    let timeout = Duration::from_secs(5);

    // Nothing allowed: the name resolves to loopback, and nothing is connected to.
    let none = Egress::new(&[])
        .expect("a policy")
        .with_lookup(names(NAMES, lookups.clone()), timeout);
    let http = bedrock::mcp_client::http_client(&none).expect("a client");
    let error = bedrock::mcp_client::list_tools(&server("rebind.test"), &http, timeout)
        .await
        .expect_err("refused");
    assert_eq!(
        error,
        "the address of rebind.test is not allowed (loopback)"
    );
    assert!(
        lookups.load(Ordering::SeqCst) > 0,
        "the policy's resolver was not asked"
    );
    // The client's own requests too: the refusal is found in the error's chain.
    let request = http
        .http()
        .get(format!("http://rebind.test:{port}/mcp"))
        .build()
        .expect("a request");
    let error = http.execute(request).await.expect_err("refused");
    assert!(
        matches!(
            EgressError::find(&error),
            Some(EgressError::Refused {
                why: "loopback",
                ..
            })
        ),
        "{error:?}"
    );
    assert_eq!(gate.requests.load(Ordering::SeqCst), 0);

    // 127.0.0.1 allowed: the name is resolved by the policy's resolver (no DNS knows it)
    // and connected to; of a name's addresses, only the allowed ones are tried.
    let trap = tokio::net::TcpListener::bind(("127.0.0.2", port))
        .await
        .ok();
    let allowed = Egress::new(&["127.0.0.1".to_owned()])
        .expect("a policy")
        .with_lookup(names(NAMES, lookups.clone()), timeout);
    let http = bedrock::mcp_client::http_client(&allowed).expect("a client");
    for host in ["rebind.test", "mixed.test"] {
        let tools = bedrock::mcp_client::list_tools(&server(host), &http, timeout)
            .await
            .expect("listed");
        assert_eq!(tools.len(), 2, "{host}");
    }
    assert!(gate.requests.load(Ordering::SeqCst) > 0);
    if let Some(trap) = trap {
        let accepted = tokio::time::timeout(Duration::from_millis(100), trap.accept()).await;
        assert!(accepted.is_err(), "127.0.0.2 was connected to");
    }
    // A name nobody resolves: said so, and not connected to.
    let error = bedrock::mcp_client::list_tools(&server("nowhere.test"), &http, timeout)
        .await
        .expect_err("unresolved");
    assert_eq!(error, "nowhere.test does not resolve");
    stop.cancel();
}

/// Issue 38, as a hostile tenant tries it: an agent's `mcp_servers` chooses among its own
/// tenant's servers only. Naming another tenant's server gives no tool; naming none gives
/// none; naming its own gives that server's tools.
#[tokio::test]
async fn an_agent_reaches_only_its_own_tenants_mcp_servers() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &[ALLOW_LOOPBACK]).await;
        let (url, _seen, stop) = kit().await;
        app.post("/v1/mcp_servers", json!({"name": "kit", "url": url}))
            .await
            .expect(201);
        let (a, b) = (app.key_a.clone(), app.key_b.clone());
        agent(&app, &a, "with-kit", json!(["kit"]))
            .await
            .expect(201);
        agent(&app, &a, "without", json!([])).await.expect(201);
        agent(&app, &b, "thief", json!(["kit"])).await.expect(201);
        let mine = conversation(&app, &a, "with-kit").await.expect(201);
        assert_eq!(mine["mcp_tools"], json!(["kit__echo", "kit__slow"]));
        let none = conversation(&app, &a, "without").await.expect(201);
        assert!(none.get("mcp_tools").is_none(), "{none}");
        let theirs = conversation(&app, &b, "thief").await.expect(201);
        assert!(theirs.get("mcp_tools").is_none(), "{theirs}");
        stop.cancel();
        app.cleanup(db).await;
    }
}

async fn agent(app: &TestApp, key: &str, name: &str, servers: Value) -> crate::support::app::Reply {
    app.request(
        Method::POST,
        "/v1/agents",
        Some(key),
        Some(json!({"name": name, "model": "fake-model", "mcp_servers": servers})),
    )
    .await
}

async fn conversation(app: &TestApp, key: &str, name: &str) -> crate::support::app::Reply {
    app.request(
        Method::POST,
        "/v1/conversations",
        Some(key),
        Some(json!({"agent": name})),
    )
    .await
}
