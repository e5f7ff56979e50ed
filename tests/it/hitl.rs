//! Human in the loop and the system bus (the human-in-the-loop issue): requests to the
//! client, approvals, background tools, system events.

use bedrock::testkit::Reply as Llm;
use serde_json::{Value, json};

use crate::support::ws::{Ws, is_state};
use crate::support::{TestApp, TestDb, WAIT, eventually};

fn ask(id: &str, kind: &str, extra: Value) -> Llm {
    let mut input = json!({"question": format!("question {id}?"), "kind": kind});
    if let (Some(input), Some(extra)) = (input.as_object_mut(), extra.as_object()) {
        input.extend(extra.clone());
    }
    Llm::tool(id, "ask_user", input)
}

fn tool_output(messages: &[Value], tool_use_id: &str) -> Value {
    messages
        .iter()
        .find(|m| m["message_type"] == "tool" && m["content"]["tool_use_id"] == tool_use_id)
        .map(|m| m["content"].clone())
        .unwrap_or(Value::Null)
}

/// Every request kind, answered over the WebSocket and over REST; the answer is the result
/// the LLM sees.
#[tokio::test]
async fn each_request_kind_answered_over_websocket_and_rest() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let kinds: [(&str, Value, Value, &str); 4] = [
        (
            "confirm",
            json!({}),
            json!({"confirmed": true}),
            "the user answered: yes",
        ),
        (
            "prompt",
            json!({}),
            json!({"text": "Ada"}),
            "the user answered: Ada",
        ),
        (
            "select",
            json!({"options": ["red", "blue"]}),
            json!({"selected": ["blue"]}),
            "the user answered: blue",
        ),
        (
            "custom",
            json!({"type_name": "file_picker", "schema": {"type": "object"}}),
            json!({"custom": {"path": "a.txt"}}),
            "the user answered: {\"path\":\"a.txt\"}",
        ),
    ];
    let mut script = Vec::new();
    for (kind, extra, _, _) in &kinds {
        for via in ["ws", "rest"] {
            script.push(ask(&format!("{kind}_{via}"), kind, extra.clone()));
        }
    }
    script.push(Llm::text("thanks"));
    app.llm.push(script);
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    ws.send(&json!({"type": "user_message", "text": "ask me things"}))
        .await;
    for (kind, _, reply, _) in &kinds {
        for via in ["ws", "rest"] {
            let frames = ws.frames_until(|f| f["type"] == "client_request").await;
            let request = frames.last().expect("a client_request frame");
            assert!(
                request["event_id"].is_i64(),
                "client requests are durable frames"
            );
            assert!(request["request_type"].get(*kind).is_some(), "{request}");
            assert_eq!(request["tool_use_id"], format!("{kind}_{via}"));
            let request_id = request["request_id"].as_str().expect("an id").to_owned();
            // A client connecting now sees the pending request in its snapshot.
            let mut late = Ws::connect(&app.ws_url(&id, "")).await;
            let snapshot = late.frame().await;
            assert_eq!(
                snapshot["pending_requests"][0]["request_id"],
                request_id.as_str()
            );
            if via == "ws" {
                ws.send(&json!({"type": "respond", "request_id": request_id, "payload": reply}))
                    .await;
            } else {
                app.post(
                    &format!("/v1/conversations/{id}/requests/{request_id}"),
                    json!({"payload": reply}),
                )
                .await
                .expect(200);
            }
            // Every client learns the request was answered; a second answer is refused.
            let resolved = ws.frame_of("client_request_resolved").await;
            assert_eq!(resolved["request_id"], request_id.as_str());
            assert_eq!(resolved["status"], "answered");
            app.post(
                &format!("/v1/conversations/{id}/requests/{request_id}"),
                json!({"payload": reply}),
            )
            .await
            .expect_error(409, "already_answered");
        }
    }
    ws.frames_until(|f| is_state(f, "idle")).await;
    let messages = app.messages(&id).await;
    for (kind, _, _, expected) in &kinds {
        for via in ["ws", "rest"] {
            let output = tool_output(&messages, &format!("{kind}_{via}"));
            assert_eq!(output["ok"], true, "{output}");
            assert_eq!(output["output"], *expected);
        }
    }
    app.cleanup(db).await;
}

/// A reply of the wrong kind is a 400; an unanswered request expires and the tool sees the
/// timeout; an answer after that is 409 expired.
#[tokio::test]
async fn wrong_kind_timeout_and_late_answer() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    app.llm.push([
        ask("q1", "confirm", json!({"timeout_ms": 1500})),
        Llm::text("ok"),
    ]);
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    app.send(&id, "ask").await;
    let request = ws.frame_of("client_request").await;
    let request_id = request["request_id"].as_str().expect("an id").to_owned();
    assert_eq!(request["timeout_ms"], 1500);
    let path = format!("/v1/conversations/{id}/requests/{request_id}");
    app.post(&path, json!({"payload": {"text": "not a confirm"}}))
        .await
        .expect_error(400, "invalid_request");
    let resolved = ws.frame_of("client_request_resolved").await;
    assert_eq!(resolved["status"], "expired");
    app.post(&path, json!({"payload": {"confirmed": true}}))
        .await
        .expect_error(409, "expired");
    app.wait_kind(&id, "idle").await;
    let output = tool_output(&app.messages(&id).await, "q1");
    assert_eq!(output["ok"], false);
    assert_eq!(output["output"], "the user did not answer within 1 s");
    app.cleanup(db).await;
}

/// The model chooses ask_user's timeout_ms, so a tenant does: a huge one (9e15 ms crashed the
/// tool's task inside chrono) is cut to `requests.max_timeout_ms`, and the question works.
#[tokio::test]
async fn a_huge_timeout_is_cut_to_the_longest_allowed() {
    for db in TestDb::each().await {
        let app =
            TestApp::spawn_with(&db, &[("BEDROCK_REQUESTS__MAX_TIMEOUT_MS", "1234567")]).await;
        let id = app.conversation().await;
        app.llm.push([
            ask(
                "q1",
                "prompt",
                json!({"timeout_ms": 9_000_000_000_000_000_u64}),
            ),
            Llm::text("ok"),
        ]);
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.send(&id, "ask").await;
        let request = ws.frame_of("client_request").await;
        assert_eq!(request["timeout_ms"], 1_234_567, "{request}");
        let request_id = request["request_id"].as_str().expect("an id").to_owned();
        app.post(
            &format!("/v1/conversations/{id}/requests/{request_id}"),
            json!({"payload": {"text": "Ada"}}),
        )
        .await
        .expect(200);
        app.wait_kind(&id, "idle").await;
        let output = tool_output(&app.messages(&id).await, "q1");
        assert_eq!(output["output"], "the user answered: Ada", "{output}");
        app.cleanup(db).await;
    }
}

/// A cancel resolves the pending request (cancelled) so nothing waits forever.
#[tokio::test]
async fn cancel_with_a_request_pending() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    app.llm.push([ask("q1", "prompt", json!({}))]);
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    app.send(&id, "ask").await;
    let request = ws.frame_of("client_request").await;
    let request_id = request["request_id"].as_str().expect("an id").to_owned();
    app.post(&format!("/v1/conversations/{id}/cancel"), json!({}))
        .await
        .expect(202);
    let resolved = ws.frame_of("client_request_resolved").await;
    assert_eq!(resolved["status"], "cancelled");
    app.post(
        &format!("/v1/conversations/{id}/requests/{request_id}"),
        json!({"payload": {"text": "late"}}),
    )
    .await
    .expect_error(409, "expired");
    let output = tool_output(&app.messages(&id).await, "q1");
    assert_eq!(output["output"], "cancelled by user");
    let snapshot = Ws::connect(&app.ws_url(&id, "")).await.frame().await;
    assert_eq!(snapshot["pending_requests"], json!([]));
    app.cleanup(db).await;
}

/// A restart expires every pending request.
#[tokio::test]
async fn restart_with_a_request_pending() {
    let db = TestDb::sqlite();
    let mut app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    app.llm.push([ask("q1", "confirm", json!({}))]);
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    app.send(&id, "ask").await;
    let request = ws.frame_of("client_request").await;
    let request_id = request["request_id"].as_str().expect("an id").to_owned();
    drop(ws);
    app.stop().await;
    app.start().await;
    assert_eq!(app.state(&id).await, json!({"kind": "idle"}));
    app.post(
        &format!("/v1/conversations/{id}/requests/{request_id}"),
        json!({"payload": {"confirmed": true}}),
    )
    .await
    .expect_error(409, "expired");
    let snapshot = Ws::connect(&app.ws_url(&id, "")).await.frame().await;
    assert_eq!(snapshot["pending_requests"], json!([]));
    app.cleanup(db).await;
}

/// require_approval: an approved command runs; a denied one provably does not, and the LLM
/// gets a failed result saying so; approval requests and responses appear as system events.
#[tokio::test]
async fn approvals_approved_and_denied() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let created = app
        .post("/v1/conversations", json!({"require_approval": ["bash"]}))
        .await
        .expect(201);
    let id = created["id"].as_str().expect("an id").to_owned();
    let cwd = std::path::PathBuf::from(created["cwd"].as_str().expect("a cwd"));
    app.llm.push([
        Llm::bash("approved_call", "touch approved.txt"),
        Llm::bash("denied_call", "touch denied.txt"),
        Llm::tool("think_call", "think", json!({"thoughts": "not gated"})),
        Llm::text("done"),
    ]);
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    app.send(&id, "go").await;
    // The first: approved over REST.
    let frames = ws.frames_until(|f| f["type"] == "client_request").await;
    let approval_event = frames
        .iter()
        .rev()
        .find(|f| f["type"] == "system_event")
        .cloned();
    let request = frames.last().expect("a request").clone();
    let request_id = request["request_id"].as_str().expect("an id").to_owned();
    assert!(
        request["request_type"]["confirm"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("touch approved.txt")
    );
    let frames2 = ws
        .frames_until(|f| f["type"] == "system_event" && f["event"]["type"] == "approval_request")
        .await;
    let approval_event = approval_event
        .or_else(|| frames2.last().cloned())
        .expect("an approval_request event");
    assert_eq!(approval_event["event"]["request_id"], request_id.as_str());
    assert_eq!(approval_event["event"]["tool_name"], "bash");
    app.post(
        &format!("/v1/conversations/{id}/requests/{request_id}"),
        json!({"payload": {"confirmed": true}}),
    )
    .await
    .expect(200);
    // The second: denied with an approval_response system event.
    let request = ws.frame_of("client_request").await;
    let request_id = request["request_id"].as_str().expect("an id").to_owned();
    app.post(
        &format!("/v1/conversations/{id}/events"),
        json!({"event": {"type": "approval_response", "request_id": request_id, "approved": false}}),
    )
    .await
    .expect(202);
    let frames = ws.frames_until(|f| is_state(f, "idle")).await;
    let responses: Vec<&Value> = frames
        .iter()
        .filter(|f| {
            f["type"] == "system_event"
                && f["event"]["type"] == "approval_response"
                && f["event"]["tool_use_id"].is_string()
        })
        .collect();
    assert_eq!(
        responses.len(),
        1,
        "the denial's response (the approval's came earlier)"
    );
    assert_eq!(responses[0]["event"]["approved"], false);
    assert!(
        cwd.join("approved.txt").exists(),
        "the approved command ran"
    );
    assert!(
        !cwd.join("denied.txt").exists(),
        "the denied command did not run"
    );
    let messages = app.messages(&id).await;
    assert_eq!(tool_output(&messages, "approved_call")["ok"], true);
    let denied = tool_output(&messages, "denied_call");
    assert_eq!(denied["ok"], false);
    assert_eq!(
        denied["output"],
        "the user denied permission to run bash; it did not run"
    );
    assert_eq!(
        tool_output(&messages, "think_call")["ok"],
        true,
        "tools not named are not gated"
    );
    app.cleanup(db).await;
}

/// A background task: started at once, its output as tool_progress, its result as a
/// tool_result system event and in the LLM's history; listed on the conversation.
#[tokio::test]
async fn background_task_progress_and_result_reach_client_and_llm() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    app.llm.push([
        Llm::tool("bg_call", "bash", json!({"command": "for i in 1 2 3; do echo line $i; sleep 0.2; done", "background": true})),
        Llm::text("started it"),
        Llm::text("saw the result"),
    ]);
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    app.send(&id, "run in background").await;
    let frames = ws
        .frames_until(|f| f["type"] == "system_event" && f["event"]["type"] == "tool_result")
        .await;
    let progress: Vec<&str> = frames
        .iter()
        .filter(|f| f["type"] == "tool_progress")
        .filter_map(|f| f["message"].as_str())
        .collect();
    assert_eq!(progress, ["line 1", "line 2", "line 3"]);
    let result = frames.last().expect("the result");
    assert_eq!(result["event"]["status"], "completed");
    assert_eq!(
        result["event"]["result"]["output"],
        "line 1\nline 2\nline 3\n"
    );
    let messages = app.messages(&id).await;
    let started = tool_output(&messages, "bg_call");
    assert!(
        started["output"]
            .as_str()
            .unwrap_or_default()
            .starts_with("started background task")
    );
    // The result lands in the history as a system message; the next turn's request has it.
    eventually("the system message", WAIT, || async {
        app.messages(&id)
            .await
            .iter()
            .any(|m| m["message_type"] == "system")
            .then_some(())
    })
    .await;
    app.wait_kind(&id, "idle").await;
    app.send(&id, "what happened?").await;
    app.wait_kind(&id, "idle").await;
    let request = app.llm.requests().last().cloned().expect("a request");
    assert!(
        request.to_string().contains("background task") && request.to_string().contains("line 3"),
        "{request}"
    );
    let tasks = app
        .get(&format!("/v1/conversations/{id}/tasks"))
        .await
        .expect(200);
    assert_eq!(tasks["tasks"][0]["status"], "completed");
    assert_eq!(tasks["tasks"][0]["tool_use_id"], "bg_call");
    app.cleanup(db).await;
}

/// An explicit cancel kills a background task; the LLM and clients learn it ended.
#[tokio::test]
async fn background_task_cancelled() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    app.llm.push([
        Llm::tool(
            "bg",
            "bash",
            json!({"command": "echo $$ > bg.pid; sleep 300", "background": true}),
        ),
        Llm::text("started"),
    ]);
    app.send(&id, "go").await;
    app.wait_kind(&id, "idle").await;
    let tasks = eventually("the task", WAIT, || async {
        let tasks = app
            .get(&format!("/v1/conversations/{id}/tasks"))
            .await
            .expect(200);
        (tasks["tasks"].as_array().map(Vec::len) == Some(1)).then_some(tasks)
    })
    .await;
    let task_id = tasks["tasks"][0]["task_id"]
        .as_str()
        .expect("an id")
        .to_owned();
    assert_eq!(tasks["tasks"][0]["status"], "running");
    let cancelled = app
        .post(
            &format!("/v1/conversations/{id}/tasks/{task_id}/cancel"),
            json!({}),
        )
        .await
        .expect(202);
    assert_eq!(cancelled["task"]["status"], "cancelled");
    app.post(
        &format!("/v1/conversations/{id}/tasks/nope/cancel"),
        json!({}),
    )
    .await
    .expect_error(404, "not_found");
    eventually("the cancel to reach the history", WAIT, || async {
        app.messages(&id)
            .await
            .iter()
            .any(|m| {
                m["message_type"] == "system"
                    && m["content"]["text"]
                        .as_str()
                        .unwrap_or_default()
                        .contains("failed")
            })
            .then_some(())
    })
    .await;
    app.cleanup(db).await;
}

/// user_request handlers answer with user_response frames, idempotently on request_id; an
/// unknown kind gets an error, never silence.
#[tokio::test]
async fn user_requests_are_answered() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    app.llm.push([Llm::text("hello")]);
    app.send(&id, "hi").await;
    app.wait_kind(&id, "idle").await;
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    let path = format!("/v1/conversations/{id}/events");
    let post = |event: Value| app.post(&path, json!({"event": event}));
    let queued =
        post(json!({"type": "user_request", "request_id": "r1", "kind": "usage", "payload": {}}))
            .await
            .expect(202);
    assert_eq!(
        queued,
        json!({"queued": true, "event_type": "user_request"})
    );
    let usage = ws
        .frames_until(|f| f["type"] == "system_event" && f["event"]["type"] == "user_response")
        .await
        .pop()
        .expect("a response");
    assert_eq!(usage["event"]["request_id"], "r1");
    assert_eq!(usage["event"]["payload"]["input_tokens"], 100);
    assert_eq!(usage["event"]["payload"]["context_window"], 128000);
    // The same request_id again: accepted, nothing new.
    post(json!({"type": "user_request", "request_id": "r1", "kind": "usage"}))
        .await
        .expect(202);
    post(json!({"type": "user_request", "request_id": "r2", "kind": "tasks"}))
        .await
        .expect(202);
    let frames = ws
        .frames_until(|f| f["type"] == "system_event" && f["event"]["type"] == "user_response")
        .await;
    let response = frames.last().expect("a response");
    assert_eq!(
        response["event"]["request_id"], "r2",
        "r1 was not answered twice: {frames:?}"
    );
    assert_eq!(response["event"]["payload"]["tasks"], json!([]));
    post(json!({"type": "user_request", "request_id": "r3", "kind": "gas_price"}))
        .await
        .expect(202);
    let unknown = ws
        .frames_until(|f| f["type"] == "system_event" && f["event"]["type"] == "user_response")
        .await
        .pop()
        .expect("a response");
    assert!(
        unknown["event"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("unknown request kind"),
        "{unknown}"
    );
    // Over the WebSocket too.
    ws.send(&json!({"type": "system_event", "event": {"type": "user_request", "request_id": "r4", "kind": "usage"}})).await;
    let over_ws = ws
        .frames_until(|f| f["type"] == "system_event" && f["event"]["type"] == "user_response")
        .await
        .pop()
        .expect("a response");
    assert_eq!(over_ws["event"]["request_id"], "r4");
    app.cleanup(db).await;
}

/// An approval nobody answers times out: the tool does not run and the LLM is told.
#[tokio::test]
async fn approval_timeout_means_the_tool_does_not_run() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_REQUESTS__APPROVAL_TIMEOUT_MS", "1000")]).await;
    let created = app
        .post("/v1/conversations", json!({"require_approval": ["bash"]}))
        .await
        .expect(201);
    let id = created["id"].as_str().expect("an id").to_owned();
    let cwd = std::path::PathBuf::from(created["cwd"].as_str().expect("a cwd"));
    app.llm
        .push([Llm::bash("gated", "touch ran.txt"), Llm::text("ok")]);
    app.send(&id, "go").await;
    app.wait_kind(&id, "idle").await;
    eventually("the turn to end", WAIT, || async {
        (app.messages(&id).await.len() == 4).then_some(())
    })
    .await;
    let output = tool_output(&app.messages(&id).await, "gated");
    assert_eq!(output["ok"], false);
    assert_eq!(
        output["output"],
        "no approval came within 1 s; bash did not run"
    );
    assert!(!cwd.join("ran.txt").exists());
    app.cleanup(db).await;
}

/// Starts a background `sleep`; returns its task id and its command line.
async fn start_background(app: &TestApp, id: &str) -> (String, String) {
    let sleep = crate::support::unique_sleep();
    app.llm.push([
        Llm::tool(
            "bg",
            "bash",
            json!({"command": format!("touch bg.started; {sleep}"), "background": true}),
        ),
        Llm::text("started"),
    ]);
    app.send(id, "go").await;
    app.wait_kind(id, "idle").await;
    app.written(id, "bg.started").await;
    let tasks = app
        .get(&format!("/v1/conversations/{id}/tasks"))
        .await
        .expect(200);
    (
        tasks["tasks"][0]["task_id"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        sleep,
    )
}

fn process_gone(sleep: &str) -> bool {
    !crate::support::running(sleep)
}

/// Deleting a conversation kills its background tasks.
#[tokio::test]
async fn deleting_a_conversation_kills_its_background_tasks() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let (_, sleep) = start_background(&app, &id).await;
    crate::support::wait_running(&sleep).await;
    let deleted = app
        .request(
            reqwest::Method::DELETE,
            &format!("/v1/conversations/{id}"),
            Some(&app.key_a),
            None,
        )
        .await;
    assert_eq!(deleted.status, 204);
    eventually("the task's process to be killed", WAIT, || async {
        process_gone(&sleep).then_some(())
    })
    .await;
    app.cleanup(db).await;
}

/// A shutdown kills background tasks and the restart marks them failed.
#[tokio::test]
async fn background_tasks_are_failed_by_a_restart() {
    let db = TestDb::sqlite();
    let mut app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let (task_id, sleep) = start_background(&app, &id).await;
    app.stop().await;
    eventually("the task's process to be killed", WAIT, || async {
        process_gone(&sleep).then_some(())
    })
    .await;
    app.start().await;
    let tasks = app
        .get(&format!("/v1/conversations/{id}/tasks"))
        .await
        .expect(200);
    assert_eq!(tasks["tasks"][0]["task_id"], task_id.as_str());
    assert_eq!(tasks["tasks"][0]["status"], "failed", "{tasks}");
    assert!(
        tasks["tasks"][0]["output"]
            .as_str()
            .unwrap_or_default()
            .contains("interrupted by server"),
        "{tasks}"
    );
    app.cleanup(db).await;
}
