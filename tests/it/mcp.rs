//! Bedrock as an MCP server (issue 23; docs/api.md, "MCP"), driven by rmcp's own client over
//! streamable HTTP against the real server: the tools, a tool-using turn with progress
//! notifications, questions answered by elicitation (accept, decline, a choice) and by the
//! respond tool for a client without elicitation, a cancel from the MCP side, tenant
//! isolation, bad arguments, and keys.
//!
//! Both protocol eras (issue 42): rmcp's client with the `initialize` handshake (2025-11-25)
//! and with `server/discover` (2026-07-28, where questions come as input-required results),
//! and the official Python SDK's client (PyPI `mcp` 2.x, tests/it/fixtures/) in its default
//! mode (2026-07-28) and forced to the handshake; a `requestState` that is not the caller's
//! is refused.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bedrock::testkit::Reply;
#[allow(deprecated)]
use rmcp::model::LoggingMessageNotificationParam;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ClientCapabilities, ClientConfig,
    ElicitRequestParams, ElicitResult, ElicitationAction, Implementation, InputResponses,
    NumberOrString, ProgressNotificationParam, ProgressToken, ProtocolVersion, RequestMetaObject,
};
use rmcp::service::{
    ClientLifecycleMode, ClientServiceExt as _, NotificationContext, RequestContext, RoleClient,
    RunningService, ServiceError,
};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientHandler, ErrorData, ServiceExt as _};
use serde_json::{Value, json};

use crate::support::{TestApp, TestDb, WAIT, eventually, running, unique_sleep, wait_running};

/// How the test client answers elicitations.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// It declares no elicitation capability.
    Unable,
    Accept,
    Decline,
}

#[derive(Clone)]
struct Client {
    answer: Answer,
    /// What the server sent: progress messages and elicitation messages.
    seen: Arc<Mutex<Vec<String>>>,
    /// The data of logging notifications.
    notices: Arc<Mutex<Vec<Value>>>,
    /// Elicitations that came in input-required results (rmcp's client hands them over
    /// under their input key, a request id, rather than a JSON-RPC request's number).
    in_rounds: Arc<Mutex<Vec<String>>>,
}

impl Client {
    fn new(answer: Answer) -> Self {
        Client {
            answer,
            seen: Arc::default(),
            notices: Arc::default(),
            in_rounds: Arc::default(),
        }
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn in_rounds(&self) -> Vec<String> {
        self.in_rounds.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl ClientHandler for Client {
    fn get_info(&self) -> ClientConfig {
        let capabilities = match self.answer {
            Answer::Unable => ClientCapabilities::default(),
            Answer::Accept | Answer::Decline => {
                ClientCapabilities::builder().enable_elicitation().build()
            }
        };
        ClientConfig::new(capabilities, Implementation::new("bedrock-tests", "0"))
    }

    async fn create_elicitation(
        &self,
        request: ElicitRequestParams,
        context: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, ErrorData> {
        if let NumberOrString::String(key) = &context.id
            && let Ok(mut in_rounds) = self.in_rounds.lock()
        {
            in_rounds.push(key.to_string());
        }
        let (message, schema) = match &request {
            ElicitRequestParams::FormElicitationParams {
                message,
                requested_schema,
                ..
            } => (
                message.clone(),
                serde_json::to_value(requested_schema).unwrap_or_default(),
            ),
            _ => (String::new(), Value::Null),
        };
        if let Ok(mut seen) = self.seen.lock() {
            seen.push(format!("elicit: {message}"));
        }
        Ok(match self.answer {
            Answer::Decline | Answer::Unable => ElicitResult::new(ElicitationAction::Decline),
            Answer::Accept => {
                let properties = &schema["properties"];
                let content = if properties.get("confirmed").is_some() {
                    json!({"confirmed": true})
                } else if let Some(choices) = properties["selected"]["enum"].as_array() {
                    json!({"selected": choices.last().cloned().unwrap_or_default()})
                } else {
                    json!({"text": "from the MCP client"})
                };
                ElicitResult::new(ElicitationAction::Accept).with_content(content)
            }
        })
    }

    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _: NotificationContext<RoleClient>,
    ) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.push(params.message.unwrap_or_default());
        }
    }

    #[allow(deprecated)]
    async fn on_logging_message(
        &self,
        params: LoggingMessageNotificationParam,
        _: NotificationContext<RoleClient>,
    ) {
        if let Ok(mut notices) = self.notices.lock() {
            notices.push(params.data);
        }
    }
}

async fn connect(app: &TestApp, key: &str, client: Client) -> RunningService<RoleClient, Client> {
    let config = StreamableHttpClientTransportConfig::with_uri(format!("{}/mcp", app.base))
        .auth_header(key.to_owned());
    client
        .serve(StreamableHttpClientTransport::from_config(config))
        .await
        .expect("the MCP session starts")
}

/// The protocol eras rmcp's client can speak.
#[derive(Clone, Copy, Debug)]
enum Era {
    /// The `initialize` handshake and a session (2025-11-25).
    Handshake,
    /// `server/discover`, no session (2026-07-28).
    Discover,
}

async fn connect_in(
    era: Era,
    app: &TestApp,
    key: &str,
    client: Client,
) -> RunningService<RoleClient, Client> {
    match era {
        Era::Handshake => connect(app, key, client).await,
        Era::Discover => {
            let config = StreamableHttpClientTransportConfig::with_uri(format!("{}/mcp", app.base))
                .auth_header(key.to_owned());
            client
                .serve_with_lifecycle(
                    StreamableHttpClientTransport::from_config(config),
                    ClientLifecycleMode::Discover {
                        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
                    },
                )
                .await
                .expect("the MCP client discovers the server")
        }
    }
}

fn params(tool: &str, arguments: Value) -> CallToolRequestParams {
    let mut params = CallToolRequestParams::new(tool.to_owned());
    if let Value::Object(map) = arguments {
        params = params.with_arguments(map);
    }
    params.meta = Some(RequestMetaObject::with_progress_token(ProgressToken(
        NumberOrString::String("progress-1".into()),
    )));
    params
}

async fn call(
    client: &RunningService<RoleClient, Client>,
    tool: &str,
    arguments: Value,
) -> CallToolResult {
    client
        .call_tool(params(tool, arguments))
        .await
        .expect("the tool answers")
}

fn text(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}

async fn create(client: &RunningService<RoleClient, Client>) -> String {
    let created = call(client, "create_conversation", json!({})).await;
    assert_ne!(created.is_error, Some(true), "{}", text(&created));
    created.structured_content.expect("the conversation")["id"]
        .as_str()
        .expect("an id")
        .to_owned()
}

/// Issue 38: an MCP client creates a conversation from one of its tenant's agents, and
/// cannot reach another tenant's.
#[tokio::test]
async fn an_mcp_client_creates_a_conversation_from_an_agent() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        app.post(
            "/v1/agents",
            json!({"name": "helper", "model": "fake-model", "tools": ["think"]}),
        )
        .await
        .expect(201);
        let client = connect(&app, &app.key_a, Client::new(Answer::Accept)).await;
        let created = call(&client, "create_conversation", json!({"agent": "helper@1"})).await;
        assert_ne!(created.is_error, Some(true), "{}", text(&created));
        let conversation = created.structured_content.expect("the conversation");
        assert_eq!(
            conversation["agent"],
            json!({"name": "helper", "version": 1})
        );
        assert_eq!(conversation["tools"], json!(["think"]));
        let other = connect(&app, &app.key_b, Client::new(Answer::Accept)).await;
        let refused = call(&other, "create_conversation", json!({"agent": "helper"})).await;
        assert_eq!(refused.is_error, Some(true));
        assert!(text(&refused).contains("not_found"), "{}", text(&refused));
        app.cleanup(db).await;
    }
}

#[tokio::test]
async fn an_mcp_client_runs_a_tool_using_turn() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let handler = Client::new(Answer::Accept);
        let client = connect(&app, &app.key_a, handler.clone()).await;
        let mut names: Vec<String> = client
            .list_all_tools()
            .await
            .expect("tools")
            .into_iter()
            .map(|t| t.name.to_string())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "cancel",
                "create_conversation",
                "get_messages",
                "respond",
                "send_message"
            ]
        );
        let id = create(&client).await;
        app.llm.push([
            Reply::bash("call_1", "echo from-the-tool"),
            Reply::text("The tool said hello."),
        ]);
        let result = call(
            &client,
            "send_message",
            json!({"conversation_id": id, "text": "run it"}),
        )
        .await;
        assert_eq!(text(&result), "The tool said hello.");
        let data = result.structured_content.expect("structured content");
        assert_eq!(data["state"]["kind"], "idle");
        assert_eq!(data["tool_calls"][0]["name"], "bash");
        assert_eq!(data["tool_calls"][0]["ok"], true);
        assert!(
            data["tool_calls"][0]["output"]
                .as_str()
                .is_some_and(|o| o.contains("from-the-tool"))
        );
        let seen = handler.seen();
        assert!(
            seen.iter().any(|s| s == "state: tool_executing"),
            "{seen:?}"
        );
        assert!(seen.iter().any(|s| s == "state: idle"), "{seen:?}");
        // The same history over REST.
        assert_eq!(app.messages(&id).await.len(), 4);
        let listed = call(&client, "get_messages", json!({"conversation_id": id})).await;
        assert_eq!(
            listed.structured_content.expect("messages")["messages"]
                .as_array()
                .map(Vec::len),
            Some(4)
        );
        // Bad arguments: an error (of the protocol, or of the tool), and the session goes on.
        let bad = client
            .call_tool(params("send_message", json!({"text": 5})))
            .await;
        assert!(
            bad.as_ref().map_or(true, |r| r.is_error == Some(true)),
            "{bad:?}"
        );
        // Another tenant's conversation is not found, as over REST.
        let other = connect(&app, &app.key_b, Client::new(Answer::Accept)).await;
        let refused = call(
            &other,
            "send_message",
            json!({"conversation_id": id, "text": "hi"}),
        )
        .await;
        assert_eq!(refused.is_error, Some(true));
        assert!(
            text(&refused).starts_with("not_found"),
            "{}",
            text(&refused)
        );
        other.cancel().await.expect("closes");
        client.cancel().await.expect("closes");
        app.cleanup(db).await;
    }
}

/// Questions during a turn become elicitations: accepted (a confirm, a choice), declined. In
/// both eras: sent in the middle of the call (2025-11-25), or as input-required results that
/// rmcp's client answers and retries (2026-07-28).
#[tokio::test]
async fn questions_are_elicitations() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    for era in [Era::Handshake, Era::Discover] {
        questions_are_elicitations_in(era, &app).await;
    }
    app.cleanup(db).await;
}

async fn questions_are_elicitations_in(era: Era, app: &TestApp) {
    for (answer, question, expected) in [
        (
            Answer::Accept,
            json!({"question": "Deploy?", "kind": "confirm"}),
            "the user answered: yes",
        ),
        (
            Answer::Decline,
            json!({"question": "Deploy?", "kind": "confirm"}),
            "the user answered: no",
        ),
        (
            Answer::Accept,
            json!({"question": "Colour?", "kind": "select", "options": ["red", "green"]}),
            "green",
        ),
        (
            Answer::Accept,
            json!({"question": "Your name?", "kind": "prompt"}),
            "from the MCP client",
        ),
    ] {
        let handler = Client::new(answer);
        let client = connect_in(era, app, &app.key_a, handler.clone()).await;
        let negotiated = client.peer_info().map(|info| info.protocol_version.clone());
        let expected_version = match era {
            Era::Handshake => ProtocolVersion::V_2025_11_25,
            Era::Discover => ProtocolVersion::V_2026_07_28,
        };
        assert_eq!(negotiated, Some(expected_version), "{era:?}");
        let id = create(&client).await;
        app.llm.push([
            Reply::tool("call_ask", "ask_user", question.clone()),
            Reply::text("thanks"),
        ]);
        let result = call(
            &client,
            "send_message",
            json!({"conversation_id": id, "text": "ask me"}),
        )
        .await;
        assert_eq!(text(&result), "thanks");
        let output = result.structured_content.expect("structured")["tool_calls"][0]["output"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            output.contains(expected),
            "{era:?} {answer:?} {question}: {output}"
        );
        let asked = question["question"].as_str().unwrap_or_default();
        assert!(
            handler
                .seen()
                .iter()
                .any(|s| s == &format!("elicit: {asked}")),
            "{era:?}: {:?}",
            handler.seen()
        );
        // 2026-07-28: the question came in an input-required result (a round), keyed by its
        // request id; 2025-11-25: as a request in the middle of the call, never in a round.
        let in_rounds = handler.in_rounds();
        match era {
            Era::Discover => assert_eq!(in_rounds.len(), 1, "{in_rounds:?}"),
            Era::Handshake => assert!(in_rounds.is_empty(), "{in_rounds:?}"),
        }
        client.cancel().await.expect("closes");
    }
}

/// A client without elicitation gets a notification naming the request, and answers it with
/// the respond tool while send_message waits.
#[tokio::test]
async fn the_respond_tool_answers_for_a_client_without_elicitation() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let handler = Client::new(Answer::Unable);
    let client = Arc::new(connect(&app, &app.key_a, handler.clone()).await);
    let id = create(&client).await;
    app.llm.push([
        Reply::tool(
            "call_ask",
            "ask_user",
            json!({"question": "Your name?", "kind": "prompt"}),
        ),
        Reply::text("hello Ada"),
    ]);
    let sending = {
        let (client, id) = (client.clone(), id.clone());
        tokio::spawn(async move {
            call(
                &client,
                "send_message",
                json!({"conversation_id": id, "text": "ask"}),
            )
            .await
        })
    };
    let notice = eventually("the request's notification", WAIT, || async {
        handler.notices.lock().ok().and_then(|n| n.first().cloned())
    })
    .await;
    let request_id = notice["request_id"]
        .as_str()
        .expect("a request id")
        .to_owned();
    assert!(
        notice["message"]
            .as_str()
            .is_some_and(|m| m.contains("Your name?") && m.contains("respond")),
        "{notice}"
    );
    let answered = call(
        &client,
        "respond",
        json!({"conversation_id": id, "request_id": request_id, "payload": {"text": "Ada"}}),
    )
    .await;
    assert_ne!(answered.is_error, Some(true), "{}", text(&answered));
    let result = sending.await.expect("the send ends");
    assert_eq!(text(&result), "hello Ada");
    // Answered once: a second answer is the API's 409.
    let again = call(
        &client,
        "respond",
        json!({"conversation_id": id, "request_id": request_id, "payload": {"text": "Bob"}}),
    )
    .await;
    assert!(
        text(&again).starts_with("already_answered"),
        "{}",
        text(&again)
    );
    app.cleanup(db).await;
}

/// Issue 38: an MCP client runs a client tool. The call is a notification naming it; the
/// client answers it with the respond tool (call_id and output) while send_message goes on,
/// and the answer is the call's result.
#[tokio::test]
async fn an_mcp_client_answers_a_client_tool_call_with_respond() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    app.post(
        "/v1/agents",
        json!({"name": "looker", "model": "fake-model", "client_tools": [{
            "name": "lookup",
            "description": "the client's dictionary",
            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
        }]}),
    )
    .await
    .expect(201);
    let handler = Client::new(Answer::Unable);
    let client = Arc::new(connect(&app, &app.key_a, handler.clone()).await);
    let created = call(&client, "create_conversation", json!({"agent": "looker"})).await;
    assert_ne!(created.is_error, Some(true), "{}", text(&created));
    let id = created.structured_content.expect("the conversation")["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    app.llm.push([
        Reply::tool("call_lookup", "lookup", json!({"q": "ferrous"})),
        Reply::text("ferrous means iron"),
    ]);
    let sending = {
        let (client, id) = (client.clone(), id.clone());
        tokio::spawn(async move {
            call(
                &client,
                "send_message",
                json!({"conversation_id": id, "text": "what is ferrous?"}),
            )
            .await
        })
    };
    let notice = eventually("the client tool call's notification", WAIT, || async {
        handler
            .notices
            .lock()
            .ok()
            .and_then(|n| n.iter().find(|n| n.get("call_id").is_some()).cloned())
    })
    .await;
    assert_eq!(notice["name"], "lookup");
    assert_eq!(notice["input"], json!({"q": "ferrous"}));
    let call_id = notice["call_id"].as_str().expect("a call id").to_owned();
    // Half an answer is refused (invalid params) and answers nothing.
    let half = client
        .call_tool(params(
            "respond",
            json!({"conversation_id": id, "call_id": call_id}),
        ))
        .await;
    assert!(half.is_err(), "{half:?}");
    // Another tenant's MCP client cannot answer it.
    let other = connect(&app, &app.key_b, Client::new(Answer::Unable)).await;
    let hijack = call(
        &other,
        "respond",
        json!({"conversation_id": id, "call_id": call_id, "output": "hijacked"}),
    )
    .await;
    assert_eq!(hijack.is_error, Some(true), "{}", text(&hijack));
    assert!(text(&hijack).starts_with("not_found"), "{}", text(&hijack));
    let answered = call(
        &client,
        "respond",
        json!({"conversation_id": id, "call_id": call_id, "output": "iron"}),
    )
    .await;
    assert_ne!(answered.is_error, Some(true), "{}", text(&answered));
    let result = sending.await.expect("the send ends");
    assert_eq!(text(&result), "ferrous means iron");
    let messages = app.messages(&id).await;
    let tool_result = messages
        .iter()
        .find(|m| m["content"]["tool_use_id"] == "call_lookup")
        .expect("the call's result");
    assert_eq!(tool_result["content"]["output"], "iron");
    app.cleanup(db).await;
}

/// REQ-BED-005: a send_message the MCP client cancels cancels the turn: the tool's process
/// is killed. In both eras: notifications/cancelled (2025-11-25, sent when the call is
/// dropped), the call's response stream closed (2026-07-28).
#[tokio::test]
async fn cancelling_the_call_cancels_the_turn() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    for era in [Era::Handshake, Era::Discover] {
        cancelling_the_call_cancels_the_turn_in(era, &app).await;
    }
    app.cleanup(db).await;
}

async fn cancelling_the_call_cancels_the_turn_in(era: Era, app: &TestApp) {
    let client = connect_in(era, app, &app.key_a, Client::new(Answer::Accept)).await;
    let id = create(&client).await;
    let sleep = unique_sleep();
    app.llm.push([Reply::bash("call_sleep", &sleep)]);
    let sending = client.call_tool(params(
        "send_message",
        json!({"conversation_id": id, "text": "sleep"}),
    ));
    let outcome = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::select! {
            _ = sending => panic!("the turn ended on its own"),
            () = wait_running(&sleep) => {}
        }
    })
    .await;
    assert!(outcome.is_ok());
    // The call future is dropped here: the client sends notifications/cancelled, or closes
    // the call's stream.
    app.wait_kind(&id, "idle").await;
    let messages = app.messages(&id).await;
    assert_eq!(
        messages.last().expect("messages")["content"]["cancelled"],
        true,
        "{era:?}"
    );
    eventually("the tool's process to be killed", WAIT, || async {
        (!running(&sleep)).then_some(())
    })
    .await;
    client.cancel().await.expect("closes");
}

/// `/mcp` takes the API's keys: none, or a bad one, is the contract's 401.
#[tokio::test]
async fn mcp_needs_a_key() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let response = app
        .http
        .post(format!("{}/mcp", app.base))
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}))
        .send()
        .await
        .expect("an answer");
    assert_eq!(response.status().as_u16(), 401);
    let body: Value = response.json().await.expect("JSON");
    assert_eq!(body["error"]["code"], "unauthorized");
    let config = StreamableHttpClientTransportConfig::with_uri(format!("{}/mcp", app.base))
        .auth_header("bk_not-a-key".to_owned());
    let refused = Client::new(Answer::Accept)
        .serve(StreamableHttpClientTransport::from_config(config))
        .await;
    assert!(refused.is_err());
    app.cleanup(db).await;
}

/// A `requestState` is good only for the caller it was given to, once, on its conversation
/// (issue 42): a forged one, another tenant's, another key's of the same tenant, one on
/// another conversation and a replayed one are refused with an MCP error (or, for another tenant's conversation, `not_found`), and
/// none of them answers the question or touches the turn; the owner's retry without the answer
/// is asked again, and its retry with it ends the turn.
#[tokio::test]
async fn a_request_state_is_refused_unless_it_is_the_callers() {
    for db in TestDb::each().await {
        a_request_state_is_refused_unless_it_is_the_callers_on(db).await;
    }
}

async fn a_request_state_is_refused_unless_it_is_the_callers_on(db: TestDb) {
    let app = TestApp::spawn(&db).await;
    let a = connect_in(Era::Discover, &app, &app.key_a, Client::new(Answer::Accept)).await;
    let b = connect_in(Era::Discover, &app, &app.key_b, Client::new(Answer::Accept)).await;
    let id = create(&a).await;
    let other = create(&a).await;
    let id_b = create(&b).await;
    app.llm.push([
        Reply::tool(
            "call_ask",
            "ask_user",
            json!({"question": "Your name?", "kind": "prompt"}),
        ),
        Reply::text("hello"),
    ]);
    let first = a
        .call_tool_once(params(
            "send_message",
            json!({"conversation_id": id, "text": "ask me"}),
        ))
        .await
        .expect("the call answers");
    let CallToolResponse::InputRequired(asked) = first else {
        panic!("not an input-required result: {first:?}");
    };
    let state = asked.request_state.clone().expect("a requestState");
    let requests = asked.input_requests.clone().expect("input requests");
    assert_eq!(requests.len(), 1, "{requests:?}");
    let request_id = requests.keys().next().expect("a request").clone();
    let mut answers = InputResponses::new();
    answers.insert(
        request_id.clone(),
        json!({"action": "accept", "content": {"text": "Mallory"}}),
    );
    let retry = |conversation: &str, state: &str| {
        params(
            "send_message",
            json!({"conversation_id": conversation, "text": "ask me"}),
        )
        .with_input_responses(answers.clone())
        .with_request_state(state.to_owned())
    };
    let refused = |outcome: Result<CallToolResponse, ServiceError>, what: &str| match outcome {
        Err(ServiceError::McpError(error)) => {
            assert_eq!(error.code.0, -32602, "{what}: {error:?}");
            assert!(
                error.message.contains("requestState is not valid"),
                "{what}: {error:?}"
            );
        }
        other => panic!("{what} was not refused: {other:?}"),
    };
    // Forged: a handle of the right shape that the server never gave.
    let forged = format!("bkr_{}", "0".repeat(64));
    refused(
        a.call_tool_once(retry(&id, &forged)).await,
        "a forged requestState",
    );
    refused(
        a.call_tool_once(retry(&id, "")).await,
        "an empty requestState",
    );
    // Tenant b with a's state: a's conversation is not found for b; on b's own conversation
    // the state is refused.
    match b.call_tool_once(retry(&id, &state)).await {
        Ok(CallToolResponse::Complete(result)) => {
            assert_eq!(result.is_error, Some(true));
            assert!(text(&result).starts_with("not_found"), "{}", text(&result));
        }
        other => panic!("another tenant's call was not refused: {other:?}"),
    }
    refused(
        b.call_tool_once(retry(&id_b, &state)).await,
        "another tenant's requestState",
    );
    // a's state on another conversation of a's.
    refused(
        a.call_tool_once(retry(&other, &state)).await,
        "a requestState on another conversation",
    );
    // Another key of the same tenant, on the same conversation (which it may read): the
    // round is the key's that made the call, not the tenant's.
    let a2 = second_key(&app).await;
    let a2 = connect_in(Era::Discover, &app, &a2, Client::new(Answer::Accept)).await;
    refused(
        a2.call_tool_once(retry(&id, &state)).await,
        "a requestState of another key of the same tenant",
    );
    a2.cancel().await.expect("closes");
    // None of that answered the question: it is still pending, and the turn waits.
    let pending = app
        .get(&format!("/v1/conversations/{id}"))
        .await
        .expect(200);
    assert_eq!(pending["state"]["kind"], "tool_executing", "{pending}");
    // A retry without the answer is asked the question again, under a new requestState.
    let again = a
        .call_tool_once(
            params(
                "send_message",
                json!({"conversation_id": id, "text": "ask me"}),
            )
            .with_request_state(state.clone()),
        )
        .await
        .expect("the retry answers");
    let CallToolResponse::InputRequired(again) = again else {
        panic!("not asked again: {again:?}");
    };
    assert_eq!(
        again
            .input_requests
            .as_ref()
            .map(|r| r.keys().cloned().collect::<Vec<_>>()),
        Some(vec![request_id.clone()])
    );
    let first_state = state;
    let state = again.request_state.expect("a new requestState");
    assert_ne!(state, first_state);
    refused(
        a.call_tool_once(retry(&id, &first_state)).await,
        "a used requestState",
    );
    // The owner's retry answers it, once.
    let mut answers = InputResponses::new();
    answers.insert(
        request_id.clone(),
        json!({"action": "accept", "content": {"text": "Ada"}}),
    );
    let done = a
        .call_tool_once(
            params(
                "send_message",
                json!({"conversation_id": id, "text": "ask me"}),
            )
            .with_input_responses(answers)
            .with_request_state(state.clone()),
        )
        .await
        .expect("the retry answers");
    let CallToolResponse::Complete(done) = done else {
        panic!("the turn did not end: {done:?}");
    };
    assert_eq!(text(&done), "hello");
    let output = done.structured_content.expect("structured")["tool_calls"][0]["output"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(output.contains("the user answered: Ada"), "{output}");
    // One user message: the retries did not send it again.
    let users = app
        .messages(&id)
        .await
        .iter()
        .filter(|m| m["message_type"] == "user")
        .count();
    assert_eq!(users, 1);
    // Replayed.
    refused(
        a.call_tool_once(retry(&id, &state)).await,
        "a replayed requestState",
    );
    a.cancel().await.expect("closes");
    b.cancel().await.expect("closes");
    app.cleanup(db).await;
}

/// A second API key of tenant a (`bedrock tenant key create a`).
async fn second_key(app: &TestApp) -> String {
    let created = bedrock::app::create_key(&app.settings(), "a")
        .await
        .expect("a new key");
    created["api_key"].as_str().expect("a key").to_owned()
}

/// How many conversations have a live actor on the node (`bedrock_conversations_running`,
/// on the operator listener).
async fn conversations_running(app: &TestApp) -> u64 {
    let text = reqwest::get(format!("{}/metrics", app.metrics_base))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let counts: Vec<u64> = text
        .lines()
        .filter(|line| line.starts_with("bedrock_conversations_running"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|n| n as u64)
        .collect();
    assert!(
        !counts.is_empty(),
        "no bedrock_conversations_running in\n{text}"
    );
    counts.iter().sum()
}

/// Sends `text` on 2026-07-28 and expects the turn to ask (the fake LLM's `ask`): the
/// input-required result's requestState and its one request id.
async fn asked_in_a_round(
    client: &RunningService<RoleClient, Client>,
    app: &TestApp,
    id: &str,
    ask: Value,
) -> (String, String) {
    app.llm.push([Reply::tool("call_ask", "ask_user", ask)]);
    let first = client
        .call_tool_once(params(
            "send_message",
            json!({"conversation_id": id, "text": "ask me"}),
        ))
        .await
        .expect("the call answers");
    let CallToolResponse::InputRequired(asked) = first else {
        panic!("not an input-required result: {first:?}");
    };
    let requests = asked.input_requests.expect("input requests");
    assert_eq!(requests.len(), 1, "{requests:?}");
    (
        asked.request_state.expect("a requestState"),
        requests.keys().next().expect("a request").clone(),
    )
}

/// A retry of `send_message` on `id` with `state` and `answers` (request id, elicitation
/// result).
fn retried(id: &str, state: &str, answers: &[(&str, Value)]) -> CallToolRequestParams {
    let mut params = params(
        "send_message",
        json!({"conversation_id": id, "text": "ask me"}),
    )
    .with_request_state(state.to_owned());
    if !answers.is_empty() {
        let mut responses = InputResponses::new();
        for (request_id, answer) in answers {
            responses.insert((*request_id).to_owned(), answer.clone());
        }
        params = params.with_input_responses(responses);
    }
    params
}

/// The MCP error of a refused call, or a failed test.
fn mcp_error(outcome: Result<CallToolResponse, ServiceError>, what: &str) -> ErrorData {
    match outcome {
        Err(ServiceError::McpError(error)) => error,
        other => panic!("{what} was not refused: {other:?}"),
    }
}

fn complete(outcome: Result<CallToolResponse, ServiceError>, what: &str) -> CallToolResult {
    match outcome {
        Ok(CallToolResponse::Complete(result)) => result,
        other => panic!("{what} did not end the call: {other:?}"),
    }
}

/// A round waiting for its retry holds nothing of the conversation: when the turn is
/// cancelled meanwhile (over REST) the conversation rests, its actor stopped, while the
/// round still waits; the retry without answers then ends with the cancelled turn's result
/// rather than asking the dead question again, and the handle is used up.
#[tokio::test]
async fn a_round_does_not_hold_a_cancelled_turn() {
    for db in TestDb::each().await {
        let app =
            TestApp::spawn_with(&db, &[("BEDROCK_CONVERSATIONS__IDLE_TIMEOUT_MS", "300")]).await;
        let client = connect_in(Era::Discover, &app, &app.key_a, Client::new(Answer::Accept)).await;
        let id = create(&client).await;
        let (state, _) = asked_in_a_round(
            &client,
            &app,
            &id,
            json!({"question": "Your name?", "kind": "prompt"}),
        )
        .await;
        app.post(&format!("/v1/conversations/{id}/cancel"), json!({}))
            .await
            .expect(202);
        app.wait_kind(&id, "idle").await;
        eventually(
            "the conversation to rest while its round waits",
            WAIT,
            || async { (conversations_running(&app).await == 0).then_some(()) },
        )
        .await;
        let done = complete(
            client.call_tool_once(retried(&id, &state, &[])).await,
            "the retry after the cancel",
        );
        let data = done.structured_content.expect("structured");
        assert_eq!(data["state"]["kind"], "idle", "{data}");
        assert_eq!(data["tool_calls"][0]["name"], "ask_user", "{data}");
        assert_eq!(data["tool_calls"][0]["ok"], false, "{data}");
        mcp_error(
            client.call_tool_once(retried(&id, &state, &[])).await,
            "a used requestState",
        );
        client.cancel().await.expect("closes");
        app.cleanup(db).await;
    }
}

/// A round belongs to its turn: when the question was answered elsewhere and a later message
/// started another turn that asks its own, the retry ends with its own turn's result and
/// does not take the next turn's question.
#[tokio::test]
async fn a_retry_after_its_turn_ended_does_not_take_the_next_turns_questions() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let client = connect_in(Era::Discover, &app, &app.key_a, Client::new(Answer::Accept)).await;
        let id = create(&client).await;
        let (state, request_id) = asked_in_a_round(
            &client,
            &app,
            &id,
            json!({"question": "Your name?", "kind": "prompt"}),
        )
        .await;
        // Answered over REST; the turn ends.
        app.llm.push([Reply::text("hello Ada")]);
        app.post(
            &format!("/v1/conversations/{id}/requests/{request_id}"),
            json!({"payload": {"text": "Ada"}}),
        )
        .await
        .expect(200);
        app.wait_kind(&id, "idle").await;
        // Another turn, which asks.
        app.llm.push([Reply::tool(
            "call_next",
            "ask_user",
            json!({"question": "Your age?", "kind": "prompt"}),
        )]);
        app.send(&id, "and now?").await;
        app.wait_kind(&id, "tool_executing").await;
        let done = complete(
            client.call_tool_once(retried(&id, &state, &[])).await,
            "the retry of an ended turn",
        );
        assert_eq!(text(&done), "hello Ada");
        let data = done.structured_content.expect("structured");
        assert_eq!(data["state"]["kind"], "superseded", "{data}");
        assert_eq!(
            data["tool_calls"].as_array().map(Vec::len),
            Some(1),
            "{data}"
        );
        assert_eq!(data["tool_calls"][0]["id"], "call_ask", "{data}");
        // The next turn's question is still waiting for its own client.
        assert_eq!(app.state(&id).await["kind"], "tool_executing");
        app.post(&format!("/v1/conversations/{id}/cancel"), json!({}))
            .await
            .expect(202);
        app.wait_kind(&id, "idle").await;
        client.cancel().await.expect("closes");
        app.cleanup(db).await;
    }
}

/// An answer that does not fit its question (a number for a prompt's text, a choice that is
/// not an option, something that is not an elicitation result) is refused at once with
/// -32602 naming the request, not posted and not taken for a default; the question still
/// waits, and a retry with a right answer under the same requestState ends the turn.
#[tokio::test]
async fn a_wrong_answer_is_refused_naming_its_request() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let client = connect_in(Era::Discover, &app, &app.key_a, Client::new(Answer::Accept)).await;
        let id = create(&client).await;
        let (state, request_id) = asked_in_a_round(
            &client,
            &app,
            &id,
            json!({"question": "Colour?", "kind": "select", "options": ["red", "green"]}),
        )
        .await;
        for wrong in [
            json!({"action": "accept", "content": {"selected": 42}}),
            json!({"action": "accept", "content": {"selected": "blue"}}),
            json!({"action": "accept"}),
            json!({"selected": "red"}),
        ] {
            let error = mcp_error(
                client
                    .call_tool_once(retried(&id, &state, &[(&request_id, wrong.clone())]))
                    .await,
                &format!("the answer {wrong}"),
            );
            assert_eq!(error.code.0, -32602, "{wrong}: {error:?}");
            assert!(error.message.contains(&request_id), "{wrong}: {error:?}");
            assert_eq!(app.state(&id).await["kind"], "tool_executing", "{wrong}");
        }
        app.llm.push([Reply::text("green it is")]);
        let done = complete(
            client
                .call_tool_once(retried(
                    &id,
                    &state,
                    &[(
                        &request_id,
                        json!({"action": "accept", "content": {"selected": "green"}}),
                    )],
                ))
                .await,
            "a right answer",
        );
        assert_eq!(text(&done), "green it is");
        let output = done.structured_content.expect("structured")["tool_calls"][0]["output"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(output.contains("the user answered: green"), "{output}");
        client.cancel().await.expect("closes");
        app.cleanup(db).await;
    }
}

/// Rounds are capped per key and per tenant, and past a cap the OLDEST round goes: a key
/// keeps 2 here, so its first handle is refused once it has a third; tenant a keeps 3 over
/// its two keys, so the second key's rounds drop the first key's oldest. The rounds kept work,
/// and once every turn has ended nothing keeps a conversation from resting.
#[tokio::test]
async fn rounds_are_capped_per_key_and_per_tenant_oldest_first() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(
            &db,
            &[
                ("BEDROCK_MCP__ROUNDS_PER_KEY", "2"),
                ("BEDROCK_MCP__ROUNDS_PER_TENANT", "3"),
                ("BEDROCK_CONVERSATIONS__IDLE_TIMEOUT_MS", "300"),
            ],
        )
        .await;
        let a = connect_in(Era::Discover, &app, &app.key_a, Client::new(Answer::Accept)).await;
        let a2 = second_key(&app).await;
        let a2 = connect_in(Era::Discover, &app, &a2, Client::new(Answer::Accept)).await;
        let question = json!({"question": "Your name?", "kind": "prompt"});
        let mut rounds = Vec::new();
        for client in [&a, &a, &a, &a2, &a2] {
            let id = create(client).await;
            let (state, request_id) = asked_in_a_round(client, &app, &id, question.clone()).await;
            rounds.push((id, state, request_id));
        }
        let clients = [&a, &a, &a, &a2, &a2];
        // The key's oldest (its cap), then the tenant's oldest (its cap), were dropped.
        for (what, n) in [
            ("the key's oldest round", 0),
            ("the tenant's oldest round", 1),
        ] {
            let (id, state, _) = &rounds[n];
            let error = mcp_error(
                clients[n].call_tool_once(retried(id, state, &[])).await,
                what,
            );
            assert_eq!(error.code.0, -32602, "{what}: {error:?}");
            assert!(
                error.message.contains("requestState is not valid"),
                "{what}"
            );
            // Its turn goes on, its question pending: cancelled here.
            app.post(&format!("/v1/conversations/{id}/cancel"), json!({}))
                .await
                .expect(202);
            app.wait_kind(id, "idle").await;
        }
        for n in 2..5 {
            let (id, state, request_id) = &rounds[n];
            app.llm.push([Reply::text("hello Ada")]);
            let done = complete(
                clients[n]
                    .call_tool_once(retried(
                        id,
                        state,
                        &[(
                            request_id,
                            json!({"action": "accept", "content": {"text": "Ada"}}),
                        )],
                    ))
                    .await,
                "a round kept",
            );
            assert_eq!(text(&done), "hello Ada", "round {n}");
        }
        eventually("every conversation to rest", WAIT, || async {
            (conversations_running(&app).await == 0).then_some(())
        })
        .await;
        a.cancel().await.expect("closes");
        a2.cancel().await.expect("closes");
        app.cleanup(db).await;
    }
}

/// Whether the official Python MCP SDK (its 2.x API) is installed; a test that needs it says
/// loudly that it is skipped when it is not.
fn python_sdk(test: &str) -> bool {
    let found = std::process::Command::new("python3")
        .args(["-c", "import mcp, mcp_types; from mcp import Client"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        #[allow(clippy::print_stderr)]
        {
            eprintln!(
                "SKIPPED {test}: the official Python MCP SDK is missing (pip install \"mcp==2.3.0\")"
            );
        }
    }
    found
}

/// The official Python SDK's client (tests/it/fixtures/mcp_python_client.py): a process
/// driven one JSON command a line, answering one JSON line each.
struct PyClient {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    stderr: Arc<Mutex<String>>,
    /// The protocol version it negotiated.
    protocol: String,
}

impl PyClient {
    /// `mode`: the SDK's `mode` setting, "auto" (2026-07-28) or "legacy" (2025-11-25).
    async fn start(app: &TestApp, key: &str, mode: &str) -> PyClient {
        use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _};
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/it/fixtures/mcp_python_client.py"
        );
        let mut child = tokio::process::Command::new("python3")
            .arg(script)
            .arg(format!("{}/mcp", app.base))
            .arg(key)
            .arg(mode)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 starts");
        let stdin = child.stdin.take().expect("stdin");
        let lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut from = child.stderr.take().expect("stderr");
        let into = stderr.clone();
        tokio::spawn(async move {
            let mut text = String::new();
            let _ = from.read_to_string(&mut text).await;
            if let Ok(mut into) = into.lock() {
                into.push_str(&text);
            }
        });
        let mut client = PyClient {
            child,
            stdin,
            lines,
            stderr,
            protocol: String::new(),
        };
        let first = client.line().await;
        client.protocol = first["protocol"].as_str().unwrap_or_default().to_owned();
        client
    }

    async fn write(&mut self, line: &str) {
        use tokio::io::AsyncWriteExt as _;
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .expect("the Python client reads");
        self.stdin.flush().await.expect("the Python client reads");
    }

    /// Its next answer; generous, as a turn may take long on a busy machine.
    async fn line(&mut self) -> Value {
        let next = tokio::time::timeout(Duration::from_secs(240), self.lines.next_line()).await;
        match next {
            Ok(Ok(Some(line))) => serde_json::from_str(&line).expect("a JSON line"),
            other => {
                let _ = self.child.start_kill();
                let _ = self.child.wait().await;
                tokio::time::sleep(Duration::from_millis(200)).await;
                let stderr = self.stderr.lock().map(|s| s.clone()).unwrap_or_default();
                panic!("the Python client did not answer ({other:?}); its stderr:\n{stderr}");
            }
        }
    }

    async fn run(&mut self, command: Value) -> Value {
        self.write(&command.to_string()).await;
        self.line().await
    }

    /// Calls a tool; its result (a failed call fails the test).
    async fn call(&mut self, tool: &str, arguments: Value, extra: Value) -> Value {
        let mut command = json!({"op": "call", "tool": tool, "arguments": arguments});
        if let (Some(command), Some(extra)) = (command.as_object_mut(), extra.as_object()) {
            command.extend(extra.clone());
        }
        let answer = self.run(command).await;
        assert!(answer.get("result").is_some(), "{tool}: {answer}");
        answer
    }

    async fn quit(mut self) {
        self.write(r#"{"op": "quit"}"#).await;
        let _ = tokio::time::timeout(WAIT, self.child.wait()).await;
    }
}

/// The text of a CallToolResult as the Python client prints it.
fn py_text(answer: &Value) -> String {
    answer["result"]["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["text"].as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

fn py_tool_output(answer: &Value) -> String {
    answer["result"]["structuredContent"]["tool_calls"][0]["output"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// The official Python SDK's client in its default mode negotiates 2026-07-28 and gets the
/// agent's questions as input-required results: a prompt answered, a select, a declined
/// approval (its command does not run), progress, and a cancel (REQ-BED-005: the call's
/// stream closed). A forged requestState is refused.
#[tokio::test]
async fn the_python_sdk_on_2026_07_28() {
    if python_sdk("the_python_sdk_on_2026_07_28") {
        python_scenarios("auto", "2026-07-28").await;
    }
}

/// The same client forced to the handshake (`mode="legacy"`, 2025-11-25) gets the questions
/// as elicitations in the middle of the call, and cancels with notifications/cancelled
/// (REQ-BED-005).
#[tokio::test]
async fn the_python_sdk_on_2025_11_25() {
    if python_sdk("the_python_sdk_on_2025_11_25") {
        python_scenarios("legacy", "2025-11-25").await;
    }
}

async fn python_scenarios(mode: &str, protocol: &str) {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let mut py = PyClient::start(&app, &app.key_a, mode).await;
        assert_eq!(py.protocol, protocol, "{mode}");
        let tools = py.run(json!({"op": "tools"})).await;
        assert_eq!(
            tools["tools"],
            json!([
                "cancel",
                "create_conversation",
                "get_messages",
                "respond",
                "send_message"
            ])
        );
        let created = py.call("create_conversation", json!({}), json!({})).await;
        let id = created["result"]["structuredContent"]["id"]
            .as_str()
            .expect("an id")
            .to_owned();

        // A prompt, answered.
        app.llm.push([
            Reply::tool(
                "call_prompt",
                "ask_user",
                json!({"question": "Your name?", "kind": "prompt"}),
            ),
            Reply::text("hello Ada"),
        ]);
        let sent = py
            .call(
                "send_message",
                json!({"conversation_id": id, "text": "ask my name"}),
                json!({"answer": "accept", "text": "Ada"}),
            )
            .await;
        assert_eq!(py_text(&sent), "hello Ada", "{mode}: {sent}");
        assert!(
            py_tool_output(&sent).contains("the user answered: Ada"),
            "{mode}: {sent}"
        );
        assert_eq!(sent["elicited"], json!(["Your name?"]), "{mode}");
        assert!(
            sent["progress"]
                .as_array()
                .is_some_and(|p| p.iter().any(|m| m == "state: idle")),
            "{mode}: {sent}"
        );

        // A select: the client picks the last choice.
        app.llm.push([
            Reply::tool(
                "call_select",
                "ask_user",
                json!({"question": "Colour?", "kind": "select", "options": ["red", "green"]}),
            ),
            Reply::text("green it is"),
        ]);
        let sent = py
            .call(
                "send_message",
                json!({"conversation_id": id, "text": "pick a colour"}),
                json!({"answer": "accept"}),
            )
            .await;
        assert_eq!(py_text(&sent), "green it is", "{mode}: {sent}");
        assert!(
            py_tool_output(&sent).contains("the user answered: green"),
            "{mode}: {sent}"
        );

        // A declined approval: the command does not run.
        let gated = app
            .post("/v1/conversations", json!({"require_approval": ["bash"]}))
            .await
            .expect(201);
        let gated_id = gated["id"].as_str().expect("an id").to_owned();
        let cwd = std::path::PathBuf::from(gated["cwd"].as_str().expect("a cwd"));
        app.llm.push([
            Reply::bash("call_gated", "touch approved.txt"),
            Reply::text("it did not run"),
        ]);
        let sent = py
            .call(
                "send_message",
                json!({"conversation_id": gated_id, "text": "touch it"}),
                json!({"answer": "decline"}),
            )
            .await;
        assert_eq!(py_text(&sent), "it did not run", "{mode}: {sent}");
        assert_eq!(
            sent["result"]["structuredContent"]["tool_calls"][0]["ok"], false,
            "{mode}: {sent}"
        );
        assert!(
            sent["elicited"].as_array().is_some_and(|e| e.len() == 1
                && e[0]
                    .as_str()
                    .is_some_and(|m| m.contains("touch approved.txt"))),
            "{mode}: {sent}"
        );
        assert!(!cwd.join("approved.txt").exists());

        if mode == "auto" {
            // A forged requestState is refused before anything is sent or answered.
            let forged = py
                .run(json!({
                    "op": "call",
                    "tool": "send_message",
                    "arguments": {"conversation_id": id, "text": "forged"},
                    "request_state": format!("bkr_{}", "f".repeat(64)),
                }))
                .await;
            assert_eq!(forged["code"], -32602, "{forged}");
            assert!(
                forged["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("requestState is not valid")),
                "{forged}"
            );
        }

        // Cancel: the call is cancelled while its tool runs.
        let sleep = unique_sleep();
        app.llm.push([Reply::bash("call_sleep", &sleep)]);
        let started = py
            .run(json!({
                "op": "call",
                "tool": "send_message",
                "arguments": {"conversation_id": id, "text": "sleep"},
                "cancel": true,
            }))
            .await;
        assert_eq!(started, json!({"started": true}));
        wait_running(&sleep).await;
        py.write("cancel").await;
        assert_eq!(py.line().await, json!({"cancelled": true}));
        app.wait_kind(&id, "idle").await;
        let messages = app.messages(&id).await;
        assert_eq!(
            messages.last().expect("messages")["content"]["cancelled"],
            true,
            "{mode}: {messages:?}"
        );
        eventually("the tool's process to be killed", WAIT, || async {
            (!running(&sleep)).then_some(())
        })
        .await;
        let users = messages
            .iter()
            .filter(|m| m["message_type"] == "user")
            .count();
        assert_eq!(users, 3, "{mode}: one user message a send");
        py.quit().await;
        app.cleanup(db).await;
    }
}
