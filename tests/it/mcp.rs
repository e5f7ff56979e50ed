//! Bedrock as an MCP server (issue 23; docs/api.md, "MCP"), driven by rmcp's own client over
//! streamable HTTP against the real server: the tools, a tool-using turn with progress
//! notifications, questions answered by elicitation (accept, decline, a choice) and by the
//! respond tool for a client without elicitation, a cancel from the MCP side, tenant
//! isolation, bad arguments, and keys.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bedrock::testkit::Reply;
#[allow(deprecated)]
use rmcp::model::LoggingMessageNotificationParam;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, ElicitRequestParams,
    ElicitResult, ElicitationAction, Implementation, NumberOrString, ProgressNotificationParam,
    ProgressToken, RequestMetaObject,
};
use rmcp::service::{NotificationContext, RequestContext, RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientHandler, ErrorData, ServiceExt as _};
use serde_json::{Value, json};

use crate::support::{TestApp, TestDb, WAIT, eventually, unique_sleep, wait_running};

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
}

impl Client {
    fn new(answer: Answer) -> Self {
        Client {
            answer,
            seen: Arc::default(),
            notices: Arc::default(),
        }
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
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
        _: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, ErrorData> {
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

/// Questions during a turn become elicitations: accepted (a confirm, a choice), declined.
#[tokio::test]
async fn questions_are_elicitations() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
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
        let client = connect(&app, &app.key_a, handler.clone()).await;
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
        assert!(output.contains(expected), "{answer:?} {question}: {output}");
        let asked = question["question"].as_str().unwrap_or_default();
        assert!(
            handler
                .seen()
                .iter()
                .any(|s| s == &format!("elicit: {asked}")),
            "{:?}",
            handler.seen()
        );
        client.cancel().await.expect("closes");
    }
    app.cleanup(db).await;
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

/// A send_message the MCP client cancels (notifications/cancelled, sent when its call is
/// dropped) cancels the turn: the tool's process is killed.
#[tokio::test]
async fn cancelling_the_call_cancels_the_turn() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let client = connect(&app, &app.key_a, Client::new(Answer::Accept)).await;
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
    // The call future is dropped here: the client sends notifications/cancelled.
    app.wait_kind(&id, "idle").await;
    let messages = app.messages(&id).await;
    assert_eq!(
        messages.last().expect("messages")["content"]["cancelled"],
        true
    );
    client.cancel().await.expect("closes");
    app.cleanup(db).await;
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
