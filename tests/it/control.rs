//! Conversation control (issue 24): interrupt-and-send, fork, and sub-agent limits with a
//! grace turn, through the real server (and the runtime where only it can show the race).

use bedrock::runtime::{SendError, UserMessage};
use bedrock::state_machine::{ConvState, IfBusy, MessageContent, Rejection};
use bedrock::testkit::Reply as Llm;
use serde_json::{Value, json};

use crate::support::rt::TestRuntime;
use crate::support::ws::{Ws, is_state};
use crate::support::{
    TestApp, TestDb, WAIT, eventually, request_messages, running, tool_names, unique_sleep,
    wait_running,
};

fn kinds(messages: &[Value]) -> Vec<String> {
    messages
        .iter()
        .map(|m| m["message_type"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// `if_busy=interrupt` over REST: the running tool is stopped as by a cancel, the new
/// message starts the next turn, and the LLM sees the cancelled call answered before it.
#[tokio::test]
async fn interrupt_and_send_replaces_a_running_turn() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let id = app.conversation().await;
        let sleep = unique_sleep();
        app.llm
            .push([Llm::bash("call_sleep", &sleep), Llm::text("redirected")]);
        app.send(&id, "first").await;
        wait_running(&sleep).await;
        let path = format!("/v1/conversations/{id}/messages?if_busy=interrupt");
        let body = json!({"text": "second", "message_id": "m-2"});
        let sent = app.post(&path, body.clone()).await.expect(202);
        assert_eq!(sent["message"]["message_type"], "user");
        app.wait_kind(&id, "idle").await;
        eventually(
            "the interrupted tool's process to be gone",
            WAIT,
            || async { (!running(&sleep)).then_some(()) },
        )
        .await;
        let messages = app.messages(&id).await;
        assert_eq!(kinds(&messages), ["user", "agent", "tool", "user", "agent"]);
        assert_eq!(messages[2]["content"]["output"], "cancelled by user");
        assert_eq!(messages[2]["content"]["cancelled"], true);
        assert_eq!(messages[3]["content"]["text"], "second");
        assert_eq!(messages[4]["content"]["text"], "redirected");
        // The new turn's request: the cancelled call answered, then the new message.
        let requests = app.llm.requests();
        let last = request_messages(requests.last().expect("a request"));
        let tail: Vec<&str> = last
            .iter()
            .rev()
            .take(2)
            .map(|m| m["role"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(tail, ["user", "tool"], "{last:#?}");
        // The same message_id again: the original, nothing interrupted or stored.
        let repeat = app.post(&path, body).await.expect(200);
        assert_eq!(repeat["message"]["id"], sent["message"]["id"]);
        assert_eq!(app.messages(&id).await.len(), 5);
        // An unknown policy is a 400 in the contract's shape.
        app.post(
            &format!("/v1/conversations/{id}/messages?if_busy=sometimes"),
            json!({"text": "x"}),
        )
        .await
        .expect_error(400, "invalid_request");
        // Concurrent interrupts over REST: each is accepted or `agent_busy`, at least one is
        // accepted, and exactly the accepted ones are stored.
        let again = unique_sleep();
        app.llm.fallback(Llm::bash("call_again", &again));
        app.send(&id, "sleep again").await;
        wait_running(&again).await;
        let before = app.messages(&id).await.len();
        let sends = (0..4).map(|n| {
            app.request(
                reqwest::Method::POST,
                &path,
                Some(&app.key_a),
                Some(json!({ "text": format!("instead {n}") })),
            )
        });
        let replies = futures::future::join_all(sends).await;
        let accepted = replies.iter().filter(|r| r.status == 202).count();
        for reply in &replies {
            assert!(
                reply.status == 202
                    || (reply.status == 409 && reply.body["error"]["code"] == "agent_busy"),
                "{reply:?}"
            );
        }
        assert!(accepted >= 1);
        app.post(&format!("/v1/conversations/{id}/cancel"), json!({}))
            .await
            .expect(202);
        app.wait_kind(&id, "idle").await;
        let after = app.messages(&id).await;
        let users = |messages: &[Value]| {
            messages
                .iter()
                .filter(|m| m["message_type"] == "user")
                .count()
        };
        assert_eq!(users(&after), users(&after[..before]) + accepted);
        app.cleanup(db).await;
    }
}

/// Several interrupting sends that saw the same running turn: the conversation takes them
/// one by one, and exactly one is accepted; the others are `agent_busy` (REST can only show
/// this as a race, so it is shown here at the actor).
#[tokio::test]
async fn of_concurrent_interrupts_exactly_one_is_accepted() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[]).await;
    let conv = rt.create_conversation().await;
    let sleep = unique_sleep();
    rt.llm.push([Llm::bash("call_sleep", &sleep), Llm::Stall]);
    rt.send(&conv, "first").await.expect("accepted");
    wait_running(&sleep).await;
    let live = rt
        .runtime
        .conversations
        .get(&conv)
        .expect("the conversation runs");
    let seen = live.cancel.running_turn();
    assert!(seen.is_some(), "a turn runs");
    let sends = (0..4).map(|n| {
        let (live, seen) = (live.clone(), seen.clone());
        async move {
            let message = UserMessage {
                text: format!("instead {n}"),
                images: Vec::new(),
                client_message_id: None,
                if_busy: IfBusy::Interrupt { running: seen },
            };
            live.send(message, WAIT)
                .await
                .expect("the conversation answers")
        }
    });
    let outcomes = futures::future::join_all(sends).await;
    let accepted = outcomes.iter().filter(|o| o.is_ok()).count();
    let busy = outcomes
        .iter()
        .filter(|o| matches!(o, Err(SendError::Rejected(Rejection::AgentBusy))))
        .count();
    assert_eq!((accepted, busy), (1, 3), "{outcomes:?}");
    eventually(
        "the interrupted tool's process to be gone",
        WAIT,
        || async { (!running(&sleep)).then_some(()) },
    )
    .await;
    let users = rt
        .messages(&conv)
        .await
        .iter()
        .filter(|m| matches!(m.content, MessageContent::User { .. }))
        .count();
    assert_eq!(users, 2, "the first message and the one accepted");
    rt.cancel(&conv).await;
    rt.assert_chain_valid(&conv).await;
    rt.stop().await;
    db.drop_db().await;
}

/// The WebSocket's user_message frame takes `if_busy` too.
#[tokio::test]
async fn websocket_user_message_can_interrupt() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    let sleep = unique_sleep();
    app.llm
        .push([Llm::bash("call_sleep", &sleep), Llm::text("as you say")]);
    ws.send(&json!({"type": "user_message", "text": "go"}))
        .await;
    ws.frames_until(|f| is_state(f, "tool_executing")).await;
    // Without the policy: refused as before.
    ws.send(&json!({"type": "user_message", "text": "stop that"}))
        .await;
    let refused = ws.frames_until(|f| f["type"] == "rejected").await;
    assert_eq!(refused.last().expect("a frame")["code"], "agent_busy");
    ws.send(&json!({"type": "user_message", "text": "stop that", "if_busy": "interrupt"}))
        .await;
    let frames = ws
        .frames_until(|f| f["type"] == "message" && f["message"]["content"]["text"] == "as you say")
        .await;
    let order: Vec<String> = frames
        .iter()
        .filter(|f| f["type"] == "message")
        .map(|f| {
            f["message"]["message_type"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(order, ["tool", "user", "agent"]);
    assert!(!frames.iter().any(|f| is_state(f, "cancelling")));
    app.cleanup(db).await;
}

fn spawn_with(tasks: Value) -> Llm {
    Llm::tool("call_spawn", "spawn_sub_agents", json!({ "tasks": tasks }))
}

fn submit(result: &str) -> Llm {
    Llm::tool("call_submit", "submit_result", json!({"result": result}))
}

/// The spawn call's aggregated result in the parent's history.
fn spawn_entries(messages: &[Value]) -> Value {
    let output = messages
        .iter()
        .find(|m| m["message_type"] == "tool" && m["content"]["tool_use_id"] == "call_spawn")
        .expect("the spawn result")["content"]["output"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    serde_json::from_str(&output).expect("the aggregate is JSON")
}

/// A sub-agent at its step limit gets one grace step with only submit_result offered: one
/// that submits succeeds, one that does not fails saying which limit. The parent's clients
/// see each sub-agent's state and steps as `sub_agent` frames; GET /children has them.
#[tokio::test]
async fn sub_agents_at_their_step_limit_get_a_grace_turn() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let id = app.conversation().await;
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.llm.route(
            "parent",
            [
                spawn_with(json!([
                    {"prompt": "obliging", "max_steps": 1},
                    {"prompt": "stubborn", "max_steps": 1},
                ])),
                Llm::text("noted"),
            ],
        );
        app.llm.route(
            "obliging",
            [Llm::bash("o1", "echo one"), submit("what I found")],
        );
        app.llm.route(
            "stubborn",
            [Llm::bash("s1", "echo one"), Llm::text("still working")],
        );
        ws.send(&json!({"type": "user_message", "text": "parent"}))
            .await;
        let frames = ws
            .frames_until(|f| f["type"] == "message" && f["message"]["content"]["text"] == "noted")
            .await;
        let messages = app.messages(&id).await;
        let entries = spawn_entries(&messages);
        assert_eq!(entries[0]["success"], true, "{entries}");
        assert_eq!(entries[0]["result"], "what I found");
        assert_eq!(entries[1]["success"], false, "{entries}");
        let why = entries[1]["result"].as_str().unwrap_or_default();
        assert!(
            why.contains("limit of 1 LLM step") && why.contains("grace turn"),
            "{why}"
        );
        // The grace steps offered submit_result alone, after the system message.
        let requests = app.llm.requests();
        let grace: Vec<&Value> = requests
            .iter()
            .filter(|r| tool_names(r) == ["submit_result"])
            .collect();
        assert_eq!(grace.len(), 2, "one grace step per sub-agent");
        for request in grace {
            let text = request.to_string();
            assert!(text.contains("you have reached your limit of 1 LLM step"));
        }
        // Live progress: each sub-agent's frames, ending completed / error, with steps.
        let agent_frames: Vec<&Value> =
            frames.iter().filter(|f| f["type"] == "sub_agent").collect();
        for (n, outcome) in [(0, "completed"), (1, "error")] {
            let agent_id = entries[n]["agent_id"].as_str().unwrap_or_default();
            let own: Vec<&&Value> = agent_frames
                .iter()
                .filter(|f| f["agent_id"] == agent_id)
                .collect();
            assert!(
                own.iter()
                    .any(|f| f["state"]["kind"] == "tool_executing" && f["steps"] == 1),
                "{own:#?}"
            );
            let last = own.last().expect("frames of the sub-agent");
            assert_eq!(last["state"]["kind"], outcome);
            assert_eq!(last["steps"], 2, "the step and the grace step");
            assert_eq!(last["max_steps"], 1);
        }
        let children = app
            .get(&format!("/v1/conversations/{id}/children"))
            .await
            .expect(200);
        let states: Vec<&str> = children["conversations"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|c| c["state"]["kind"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(states, ["completed", "error"]);
        app.cleanup(db).await;
    }
}

/// A sub-agent past its own time limit (its task's, under the configured one) has its
/// running tool stopped and gets the grace turn; one that stalls in it fails when the grace
/// time is over, saying which limit.
#[tokio::test]
async fn sub_agents_past_their_time_limit_get_a_grace_turn() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[("BEDROCK_SUB_AGENTS__GRACE_MS", "1000")]).await;
    let conv = rt.create_conversation().await;
    let sleep = unique_sleep();
    rt.llm.route(
        "parent",
        [
            spawn_with(json!([
                {"prompt": "sleeper", "timeout_ms": 800},
                {"prompt": "staller", "timeout_ms": 800},
                {"prompt": "slowpoke", "max_steps": 1},
            ])),
            Llm::text("noted"),
        ],
    );
    rt.llm
        .route("sleeper", [Llm::bash("z", &sleep), submit("woke up early")]);
    rt.llm.route("staller", [Llm::Stall, Llm::Stall]);
    // Its grace turn, begun at its step limit, is bounded by grace_ms too.
    rt.llm
        .route("slowpoke", [Llm::bash("p", "echo one"), Llm::Stall]);
    rt.send(&conv, "parent").await.expect("accepted");
    rt.wait_idle(&conv).await;
    assert!(!running(&sleep), "the stopped tool's process is gone");
    let spawn = rt.tool_output(&conv, "call_spawn").await;
    let entries: Value = serde_json::from_str(&spawn).expect("JSON");
    assert_eq!(entries[0]["success"], true, "{entries}");
    assert_eq!(entries[0]["result"], "woke up early");
    assert_eq!(entries[1]["success"], false);
    let why = entries[1]["result"].as_str().unwrap_or_default();
    assert!(
        why.contains("time limit of 0.8 s") && why.contains("grace turn"),
        "{why}"
    );
    // The sleeper's tool was answered as stopped by the limit.
    let sleeper = entries[0]["agent_id"].as_str().unwrap_or_default();
    let stopped = rt
        .messages(sleeper)
        .await
        .into_iter()
        .find_map(|m| match m.content {
            MessageContent::Tool(r) if r.tool_use_id == "z" => Some(r),
            _ => None,
        })
        .expect("the stopped tool's result");
    assert!(stopped.cancelled && stopped.output.contains("time limit"));
    assert_eq!(entries[2]["success"], false);
    let why = entries[2]["result"].as_str().unwrap_or_default();
    assert!(
        why.contains("limit of 1 LLM step") && why.contains("grace turn"),
        "{why}"
    );
    let staller = entries[1]["agent_id"].as_str().unwrap_or_default();
    let record = rt.record(staller).await;
    assert!(
        matches!(record.state, ConvState::Error { .. }),
        "{:?}",
        record.state
    );
    for id in [conv.as_str(), sleeper, staller] {
        rt.assert_chain_valid(id).await;
    }
    rt.stop().await;
    db.drop_db().await;
}

/// A finished turn with a tool call (user, agent + tool_use, tool, agent: 4 messages).
async fn turn_with_a_tool(app: &TestApp, id: &str, text: &str) {
    app.llm.push([
        Llm::bash("call_echo", "echo hello > notes.txt"),
        Llm::text("wrote it"),
    ]);
    app.send(id, text).await;
    app.wait_kind(id, "idle").await;
}

/// A fork copies the history up to its point and the workspace; its first turn sends the
/// LLM exactly the forked history; lists and JSON show where it came from.
#[tokio::test]
async fn fork_copies_history_and_workspace() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let source = app.conversation().await;
        turn_with_a_tool(&app, &source, "first").await;
        app.llm.push([Llm::text("second answer")]);
        app.send(&source, "second").await;
        app.wait_kind(&source, "idle").await;
        let source_second = app.llm.requests().last().cloned().expect("a request");
        // Fork after the first turn, sharing the directory: the fork's first request is
        // the source's second one, message for message (system prompt included).
        let shared = app
            .post(
                &format!("/v1/conversations/{source}/fork"),
                json!({"at_sequence_id": 4, "cwd": "share"}),
            )
            .await
            .expect(201);
        assert_eq!(
            shared["forked_from"],
            json!({"conversation_id": source, "sequence_id": 4})
        );
        assert_eq!(shared["user_initiated"], true);
        assert_eq!(shared["state"]["kind"], "idle");
        assert_eq!(
            shared["cwd"],
            app.get(&format!("/v1/conversations/{source}"))
                .await
                .expect(200)["cwd"]
        );
        let fork = shared["id"].as_str().expect("an id").to_owned();
        let copied = app.messages(&fork).await;
        let original = app.messages(&source).await;
        assert_eq!(kinds(&copied), ["user", "agent", "tool", "agent"]);
        for (copy, from) in copied.iter().zip(&original) {
            assert_eq!(copy["content"], from["content"]);
            assert_eq!(copy["sequence_id"], from["sequence_id"]);
            assert_ne!(copy["id"], from["id"], "copies have ids of their own");
        }
        app.llm.push([Llm::text("another second answer")]);
        app.send(&fork, "second").await;
        app.wait_kind(&fork, "idle").await;
        let fork_first = app.llm.requests().last().cloned().expect("a request");
        assert_eq!(
            request_messages(&fork_first),
            request_messages(&source_second),
            "the fork's first request is the forked history and its new message"
        );
        // The source is untouched.
        assert_eq!(app.messages(&source).await.len(), 6);
        // The default: the whole stored history, and a copy of the workspace.
        let copy = app
            .post(&format!("/v1/conversations/{source}/fork"), json!({}))
            .await
            .expect(201);
        assert_eq!(copy["forked_from"]["sequence_id"], 6);
        let copy_id = copy["id"].as_str().expect("an id").to_owned();
        let (from_dir, copy_dir) = (app.cwd(&source).await, app.cwd(&copy_id).await);
        assert_ne!(from_dir, copy_dir);
        assert_eq!(
            std::fs::read_to_string(copy_dir.join("notes.txt")).expect("the copied file"),
            "hello\n"
        );
        std::fs::write(copy_dir.join("notes.txt"), "changed").expect("a write");
        assert_eq!(
            std::fs::read_to_string(from_dir.join("notes.txt")).expect("the source's file"),
            "hello\n"
        );
        // Listed with its origin; forks are user conversations.
        let listed = app.get("/v1/conversations").await.expect(200);
        let entry = listed["conversations"]
            .as_array()
            .expect("a list")
            .iter()
            .find(|c| c["id"] == copy_id.as_str())
            .cloned()
            .expect("the fork is listed");
        assert_eq!(entry["forked_from"]["conversation_id"], source.as_str());
        app.cleanup(db).await;
    }
}

/// Only where the chain is valid; a point past the end, another tenant's conversation and
/// a workspace over the limit are refused in the contract's shape.
#[tokio::test]
async fn fork_refuses_bad_points_other_tenants_and_large_workspaces() {
    for db in TestDb::each().await {
        fork_refusals(db).await;
    }
}

async fn fork_refusals(db: TestDb) {
    let app = TestApp::spawn_with(&db, &[("BEDROCK_WORKSPACE__FORK_MAX_BYTES", "1000")]).await;
    let source = app.conversation().await;
    turn_with_a_tool(&app, &source, "first").await;
    let path = format!("/v1/conversations/{source}/fork");
    // Message 2 asks for a tool whose result is message 3.
    let message = app
        .post(&path, json!({"at_sequence_id": 2}))
        .await
        .expect_error(409, "invalid_fork_point");
    assert!(message.contains("open tool call"), "{message}");
    app.post(&path, json!({"at_sequence_id": 5}))
        .await
        .expect_error(409, "invalid_fork_point");
    app.post(&path, json!({"at_sequence_id": -1}))
        .await
        .expect_error(400, "invalid_request");
    app.post(&path, json!({"cwd": "borrow"}))
        .await
        .expect_error(400, "invalid_request");
    // Found by schemathesis: serde reads a struct from an array of its fields.
    app.post(&path, json!([null, null]))
        .await
        .expect_error(400, "invalid_request");
    // Tenant b does not see tenant a's conversation.
    app.request(
        reqwest::Method::POST,
        &path,
        Some(&app.key_b),
        Some(json!({})),
    )
    .await
    .expect_error(404, "not_found");
    // An empty fork is a fork too.
    let empty = app
        .post(&path, json!({"at_sequence_id": 0, "cwd": "share"}))
        .await
        .expect(201);
    assert_eq!(
        app.messages(empty["id"].as_str().unwrap_or_default())
            .await
            .len(),
        0
    );
    // Too much to copy: 413, and sharing still works.
    std::fs::write(app.cwd(&source).await.join("big.bin"), vec![7u8; 4096]).expect("a file");
    let message = app
        .post(&path, json!({}))
        .await
        .expect_error(413, "payload_too_large");
    assert!(message.contains("fork_max_bytes"), "{message}");
    app.post(&path, json!({"cwd": "share"})).await.expect(201);
    // A source whose directory is gone has nothing to copy.
    std::fs::remove_dir_all(app.cwd(&source).await).expect("removed");
    app.post(&path, json!({}))
        .await
        .expect_error(409, "workspace_missing");
    app.cleanup(db).await;
}

/// A busy source is forked as stored: the running turn's open call is left out and the
/// fork is idle; the source's turn goes on.
#[tokio::test]
async fn fork_of_a_busy_conversation_takes_what_is_stored() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let source = app.conversation().await;
    let sleep = unique_sleep();
    app.llm
        .push([Llm::bash("call_sleep", &sleep), Llm::text("slept")]);
    app.send(&source, "sleep").await;
    wait_running(&sleep).await;
    let fork = app
        .post(
            &format!("/v1/conversations/{source}/fork"),
            json!({"cwd": "share"}),
        )
        .await
        .expect(201);
    assert_eq!(
        fork["forked_from"]["sequence_id"], 1,
        "before the open call"
    );
    assert_eq!(fork["state"]["kind"], "idle");
    let fork_id = fork["id"].as_str().expect("an id").to_owned();
    assert_eq!(kinds(&app.messages(&fork_id).await), ["user"]);
    assert_eq!(app.state(&source).await["kind"], "tool_executing");
    app.post(&format!("/v1/conversations/{source}/cancel"), json!({}))
        .await
        .expect(202);
    app.cleanup(db).await;
}

/// A fork shows the source's images without copying them, and keeps them when the source
/// is deleted.
#[tokio::test]
async fn forks_share_images_and_keep_them() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let source = app.conversation().await;
        app.llm.push([Llm::text("a green square")]);
        app.post(
            &format!("/v1/conversations/{source}/messages"),
            json!({"text": "what is it?", "images": [{"media_type": "image/png", "data": crate::api::png_base64(8, 8)}]}),
        )
        .await
        .expect(202);
        app.wait_kind(&source, "idle").await;
        let fork = app
            .post(
                &format!("/v1/conversations/{source}/fork"),
                json!({"cwd": "share"}),
            )
            .await
            .expect(201);
        let fork_id = fork["id"].as_str().expect("an id").to_owned();
        app.request(
            reqwest::Method::DELETE,
            &format!("/v1/conversations/{source}"),
            Some(&app.key_a),
            None,
        )
        .await
        .expect(204);
        app.llm.push([Llm::text("still green")]);
        app.send(&fork_id, "and now?").await;
        app.wait_kind(&fork_id, "idle").await;
        let request = app.llm.requests().last().cloned().expect("a request");
        assert!(
            request.to_string().contains("data:image/png;base64,"),
            "the fork's request still carries the image"
        );
        app.cleanup(db).await;
    }
}
