//! Tenants' own MCP tool servers (issue 23; docs/api.md, "MCP"): a real rmcp server started
//! here offers two tools (one slow); its tools join new conversations as `kit__echo` and
//! `kit__slow`, and run under the same rules as built-in tools: approvals, cancel (the MCP
//! call is cancelled), the output cap, failures as tool results. A server that does not
//! answer at creation is left out with a system message.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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
            () = tokio::time::sleep(std::time::Duration::from_secs(120)) => {
                Ok(CallToolResult::success(vec![ContentBlock::text("finally")]))
            }
        }
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Kit {}

/// The test server on a loopback port: its URL, what it saw, and its stop switch.
async fn kit() -> (String, Arc<Seen>, CancellationToken) {
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
        StreamableHttpServerConfig::default().with_cancellation_token(stop.child_token()),
    );
    let app = axum::Router::new().nest_service("/mcp", service);
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
    (format!("http://{addr}/mcp"), seen, stop)
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
        let app = TestApp::spawn_with(&db, &[("BEDROCK_TOOLS__OUTPUT_CAP_BYTES", "64")]).await;
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
