//! Client tools (issue 38; docs/api.md, "Client tools"): tools the client runs. The LLM sees
//! them beside the built-in ones; a call of one is a durable `client_tool_call` frame that
//! the client answers exactly once, over the WebSocket, REST or MCP; its answer is the
//! call's tool result. A restart keeps the call pending and answerable; a timeout and a
//! cancel end it with a failed result; the chain stays valid through all of it (REQ-BED-004,
//! REQ-BED-005, REQ-BED-007). On SQLite and Postgres, through the real server.

use reqwest::Method;
use serde_json::{Value, json};

use crate::support::ws::Ws;
use crate::support::{TestApp, TestDb, request_messages, tool_names};
use bedrock::testkit::Reply as Llm;

fn lookup(timeout_ms: Option<u64>) -> Value {
    let mut tool = json!({
        "name": "lookup",
        "description": "Looks a word up in the client's own dictionary.",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    });
    if let Some(ms) = timeout_ms {
        tool["timeout_ms"] = json!(ms);
    }
    tool
}

/// A conversation of tenant a with the client tool `lookup`.
async fn conversation(app: &TestApp, timeout_ms: Option<u64>) -> String {
    let conv = app
        .post(
            "/v1/conversations",
            json!({"client_tools": [lookup(timeout_ms)]}),
        )
        .await
        .expect(201);
    assert_eq!(conv["client_tools"][0]["name"], "lookup");
    conv["id"].as_str().expect("an id").to_owned()
}

/// The LLM's request after the call carries exactly one tool result for it, right after
/// the assistant message that asked for it.
fn answered_in_next_request(app: &TestApp, tool_use_id: &str, output: &str) {
    let requests = app.llm.requests();
    let last = requests.last().expect("a request after the call");
    let messages = request_messages(last);
    let results: Vec<&Value> = messages
        .iter()
        .filter(|m| m["role"] == "tool" && m["tool_call_id"] == tool_use_id)
        .collect();
    assert_eq!(results.len(), 1, "{messages:?}");
    assert!(
        results[0]["content"]
            .as_str()
            .is_some_and(|c| c.contains(output)),
        "{results:?}"
    );
}

/// Answered over the WebSocket and over REST; a second answer is refused with the first
/// answer's time; another tenant cannot answer or see the calls; the LLM was offered the
/// tool and got each answer as its call's result.
#[tokio::test]
async fn client_tools_are_answered_once_over_the_websocket_and_rest() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let id = conversation(&app, None).await;
        app.llm.push([
            Llm::tool("call_ws", "lookup", json!({"q": "ferrous"})),
            Llm::text("it means iron"),
            Llm::tool("call_rest", "lookup", json!({"q": "nope"})),
            Llm::text("the lookup failed"),
        ]);
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.send(&id, "what is ferrous?").await;
        let call = ws.frame_of("client_tool_call").await;
        assert_eq!(call["name"], "lookup");
        assert_eq!(call["tool_use_id"], "call_ws");
        assert_eq!(call["input"], json!({"q": "ferrous"}));
        assert!(call["event_id"].as_i64().is_some());
        assert!(call["expires_at"].as_str().is_some());
        let call_id = call["call_id"].as_str().expect("a call id").to_owned();
        let offered = tool_names(&app.llm.requests()[0]);
        assert!(offered.iter().any(|t| t == "lookup"), "{offered:?}");
        assert!(offered.iter().any(|t| t == "bash"), "{offered:?}");

        // Another tenant neither answers nor sees it.
        let path = format!("/v1/conversations/{id}/tool_results/{call_id}");
        app.request(
            Method::POST,
            &path,
            Some(&app.key_b),
            Some(json!({"output": "hijacked"})),
        )
        .await
        .expect_error(404, "not_found");
        app.request(
            Method::GET,
            &format!("/v1/conversations/{id}/client_tool_calls"),
            Some(&app.key_b),
            None,
        )
        .await
        .expect_error(404, "not_found");
        // A malformed answer is refused and answers nothing.
        app.post(&path, json!({"output": 42}))
            .await
            .expect_error(400, "invalid_request");

        ws.send(&json!({"type": "client_tool_result", "call_id": call_id, "output": "iron"}))
            .await;
        let resolved = ws.frame_of("client_tool_resolved").await;
        assert_eq!(resolved["status"], "answered");
        app.wait_kind(&id, "idle").await;
        let result = app.tool_result(&id, "call_ws").await;
        assert_eq!(result["ok"], true);
        assert_eq!(result["output"], "iron");
        answered_in_next_request(&app, "call_ws", "iron");
        // Answered once: the second answer gets 409 with the first answer's time.
        let again = app
            .post(&path, json!({"output": "steel"}))
            .await
            .expect_error(409, "already_answered");
        assert!(again.contains("answered at 20"), "{again}");
        ws.send(&json!({"type": "client_tool_result", "call_id": call_id, "output": "x"}))
            .await;
        let rejected = ws.frame_of("rejected").await;
        assert_eq!(rejected["code"], "already_answered", "{rejected}");

        // Over REST, as an error.
        app.send(&id, "and nope?").await;
        let call = ws.frame_of("client_tool_call").await;
        let call_id = call["call_id"].as_str().expect("a call id").to_owned();
        let taken = app
            .post(
                &format!("/v1/conversations/{id}/tool_results/{call_id}"),
                json!({"output": "no such word", "is_error": true}),
            )
            .await
            .expect(200);
        assert_eq!(taken, json!({"answered": true, "call_id": call_id}));
        app.wait_kind(&id, "idle").await;
        let result = app.tool_result(&id, "call_rest").await;
        assert_eq!(result["ok"], false);
        assert_eq!(result["output"], "no such word");

        let calls = app
            .get(&format!("/v1/conversations/{id}/client_tool_calls"))
            .await
            .expect(200);
        let calls = calls["calls"].as_array().expect("calls").clone();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["tool_use_id"], "call_rest");
        assert_eq!(calls[0]["status"], "answered");
        assert_eq!(calls[0]["is_error"], true);
        assert_eq!(calls[1]["output"], "iron");
        let pending = app
            .get(&format!(
                "/v1/conversations/{id}/client_tool_calls?pending=true"
            ))
            .await
            .expect(200);
        assert_eq!(pending["calls"], json!([]));
        app.cleanup(db).await;
    }
}

/// A backend may give a tool_use id again in a later step: that call is a new one, asked
/// anew, never answered with the earlier call's answer. An answer past the tools' output
/// cap is stored cut, as the LLM gets it.
#[tokio::test]
async fn a_reused_tool_use_id_is_a_new_call_and_big_answers_are_cut() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = conversation(&app, None).await;
    app.llm.push([
        Llm::tool("call_same", "lookup", json!({"q": "first"})),
        Llm::tool("call_same", "lookup", json!({"q": "second"})),
        Llm::text("done"),
    ]);
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    app.send(&id, "look twice").await;
    let first = ws.frame_of("client_tool_call").await;
    assert_eq!(first["input"], json!({"q": "first"}));
    let first_id = first["call_id"].as_str().expect("a call id").to_owned();
    app.post(
        &format!("/v1/conversations/{id}/tool_results/{first_id}"),
        json!({"output": "one"}),
    )
    .await
    .expect(200);
    let second = ws.frame_of("client_tool_call").await;
    assert_eq!(second["input"], json!({"q": "second"}));
    let second_id = second["call_id"].as_str().expect("a call id").to_owned();
    assert_ne!(first_id, second_id);
    let big = "x".repeat(100_000);
    app.post(
        &format!("/v1/conversations/{id}/tool_results/{second_id}"),
        json!({"output": big}),
    )
    .await
    .expect(200);
    app.wait_kind(&id, "idle").await;
    let outputs: Vec<String> = app
        .messages(&id)
        .await
        .into_iter()
        .filter(|m| m["content"]["tool_use_id"] == "call_same")
        .map(|m| {
            m["content"]["output"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(outputs.len(), 2);
    assert_eq!(outputs[0], "one");
    assert!(outputs[1].len() < 70_000, "{}", outputs[1].len());
    assert!(outputs[1].contains("[output truncated: 100000 bytes, 65536 kept]"));
    let calls = app
        .get(&format!("/v1/conversations/{id}/client_tool_calls"))
        .await
        .expect(200);
    assert!(
        calls["calls"][0]["output"]
            .as_str()
            .is_some_and(|o| o.len() < 70_000),
        "the stored answer is cut too"
    );
    app.cleanup(db).await;
}

/// A restart keeps the call pending: the conversation is still on it, a reconnecting
/// client finds it in the snapshot, and its answer after the restart is the call's result.
#[tokio::test]
async fn a_client_tool_call_survives_a_restart() {
    for db in TestDb::each().await {
        let mut app = TestApp::spawn(&db).await;
        let id = conversation(&app, None).await;
        app.llm.push([
            Llm::tool("call_slow", "lookup", json!({"q": "slow"})),
            Llm::text("thanks"),
        ]);
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.send(&id, "look it up").await;
        let call = ws.frame_of("client_tool_call").await;
        let call_id = call["call_id"].as_str().expect("a call id").to_owned();
        drop(ws);
        app.stop().await;
        app.start().await;

        assert_eq!(app.state(&id).await["kind"], "tool_executing");
        let snapshot = Ws::connect(&app.ws_url(&id, "")).await.frame().await;
        let pending = &snapshot["pending_client_tool_calls"];
        assert_eq!(pending.as_array().map(Vec::len), Some(1), "{snapshot}");
        assert_eq!(pending[0]["call_id"], call_id.as_str());
        assert_eq!(pending[0]["status"], "pending");
        app.post(
            &format!("/v1/conversations/{id}/tool_results/{call_id}"),
            json!({"output": "found it after the restart"}),
        )
        .await
        .expect(200);
        app.wait_kind(&id, "idle").await;
        let result = app.tool_result(&id, "call_slow").await;
        assert_eq!(result["ok"], true);
        assert_eq!(result["output"], "found it after the restart");
        answered_in_next_request(&app, "call_slow", "found it after the restart");
        // One result for the call: the restart made none.
        let results = app
            .messages(&id)
            .await
            .into_iter()
            .filter(|m| m["content"]["tool_use_id"] == "call_slow")
            .count();
        assert_eq!(results, 1);
        app.cleanup(db).await;
    }
}

/// A call not answered in time is a failed result the LLM reads; a cancel ends a call
/// with the cancelled result; either way a late answer is refused and the next request's
/// chain is valid.
#[tokio::test]
async fn client_tool_calls_time_out_and_are_cancelled() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let id = conversation(&app, Some(300)).await;
        app.llm.push([
            Llm::tool("call_late", "lookup", json!({"q": "late"})),
            Llm::text("no answer came"),
            Llm::tool("call_cancelled", "lookup", json!({"q": "never"})),
        ]);
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.send(&id, "look it up").await;
        let call = ws.frame_of("client_tool_call").await;
        let call_id = call["call_id"].as_str().expect("a call id").to_owned();
        let resolved = ws.frame_of("client_tool_resolved").await;
        assert_eq!(resolved["status"], "expired");
        app.wait_kind(&id, "idle").await;
        let result = app.tool_result(&id, "call_late").await;
        assert_eq!(result["ok"], false);
        assert!(
            result["output"]
                .as_str()
                .is_some_and(|o| o.contains("did not answer")),
            "{result}"
        );
        answered_in_next_request(&app, "call_late", "did not answer");
        app.post(
            &format!("/v1/conversations/{id}/tool_results/{call_id}"),
            json!({"output": "too late"}),
        )
        .await
        .expect_error(409, "expired");

        app.send(&id, "again").await;
        let call = ws.frame_of("client_tool_call").await;
        let call_id = call["call_id"].as_str().expect("a call id").to_owned();
        app.post(&format!("/v1/conversations/{id}/cancel"), json!({}))
            .await
            .expect(202);
        let resolved = ws.frame_of("client_tool_resolved").await;
        assert_eq!(resolved["status"], "cancelled");
        app.wait_kind(&id, "idle").await;
        let result = app.tool_result(&id, "call_cancelled").await;
        assert_eq!(result["ok"], false);
        assert_eq!(result["output"], "cancelled by user");
        app.post(
            &format!("/v1/conversations/{id}/tool_results/{call_id}"),
            json!({"output": "after the cancel"}),
        )
        .await
        .expect_error(409, "expired");
        app.cleanup(db).await;
    }
}

/// An agent's client tools go to its conversations (and to a version's document); a client
/// tool may not shadow a built-in tool or an MCP tool's namespace; bad definitions are
/// refused with 400 and make nothing; a conversation of an agent may not bring its own.
#[tokio::test]
async fn client_tool_definitions_are_checked() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let agent = app
        .post(
            "/v1/agents",
            json!({"name": "helper", "model": "fake-model", "client_tools": [lookup(Some(5000))]}),
        )
        .await
        .expect(201);
    assert_eq!(agent["client_tools"][0]["timeout_ms"], 5000);
    let conv = app
        .post("/v1/conversations", json!({"agent": "helper"}))
        .await
        .expect(201);
    assert_eq!(conv["client_tools"][0]["name"], "lookup");
    let exported = app.get("/v1/agents/helper/export").await.expect(200);
    assert_eq!(
        exported["versions"][0]["definition"]["client_tools"][0]["name"],
        "lookup"
    );
    app.post(
        "/v1/conversations",
        json!({"agent": "helper", "client_tools": [lookup(None)]}),
    )
    .await
    .expect_error(400, "invalid_request");

    let schema = json!({"type": "object"});
    for bad in [
        json!([{"name": "bash", "input_schema": schema}]),
        json!([{"name": "ask_user", "input_schema": schema}]),
        json!([{"name": "submit_result", "input_schema": schema}]),
        json!([{"name": "srv__read", "input_schema": schema}]),
        json!([{"name": "has space", "input_schema": schema}]),
        json!([{"name": "", "input_schema": schema}]),
        json!([{"name": "x".repeat(65), "input_schema": schema}]),
        json!([{"name": "t", "input_schema": {"type": "string"}}]),
        json!([{"name": "t", "input_schema": "object"}]),
        json!([{"name": "t", "input_schema": schema}, {"name": "t", "input_schema": schema}]),
        json!([{"name": "t", "input_schema": schema, "timeout_ms": 0}]),
        json!([{"name": "t", "input_schema": schema, "timeout_ms": 999_999_999_999_u64}]),
        json!([{"name": "t", "input_schema": {"type": "object", "description": "x".repeat(17_000)}}]),
        json!([{"name": "t", "input_schema": schema, "unknown": 1}]),
        json!([["t", "a tool", schema, null]]),
    ] {
        app.post("/v1/conversations", json!({"client_tools": bad}))
            .await
            .expect_error(400, "invalid_request");
        app.post(
            "/v1/agents",
            json!({"name": "bad", "model": "m", "client_tools": bad}),
        )
        .await
        .expect_error(400, "invalid_request");
    }
    let many: Vec<Value> = (0..33)
        .map(|i| json!({"name": format!("t{i}"), "input_schema": schema}))
        .collect();
    app.post("/v1/conversations", json!({"client_tools": many}))
        .await
        .expect_error(400, "invalid_request");
    // Nothing was made by the refusals.
    let listed = app.get("/v1/conversations").await.expect(200);
    assert_eq!(listed["conversations"].as_array().map(Vec::len), Some(1));
    app.get("/v1/agents/bad")
        .await
        .expect_error(404, "not_found");
    app.cleanup(db).await;
}
