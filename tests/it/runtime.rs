//! The runtime through the real actor tree, a real database and the scripted fake LLM
//! (REQ-BED-003..006, 008, 009; the runtime issue).

use std::time::Duration;

use bedrock::state_machine::{ConvState, ErrorKind, MessageContent};
use bedrock::testkit::Reply;
use serde_json::{Value, json};

use crate::support::{
    TestDb, TestRuntime, WAIT, eventually, request_messages, roles, running, tool_names,
    unique_sleep,
};

fn tool_messages(request: &Value) -> Vec<(String, String)> {
    request_messages(request)
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap_or_default().to_owned(),
                m["content"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// REQ-BED-003/004: tools run serially in the order asked, and the LLM gets every result in
/// that order; a failed tool is a result, not an error state.
#[tokio::test]
async fn full_turn_runs_tools_serially_and_sends_results_in_order() {
    for db in TestDb::each().await {
        let rt = TestRuntime::start(&db, &[]).await;
        let conv = rt.create_conversation().await;
        rt.llm.push([
            Reply::Tools {
                text: Some("running two".into()),
                calls: vec![
                    (
                        "call_a".into(),
                        "bash".into(),
                        json!({"command": "sleep 0.2; echo first >> order.txt; echo A"}),
                    ),
                    (
                        "call_b".into(),
                        "bash".into(),
                        json!({"command": "echo second >> order.txt; exit 7"}),
                    ),
                ],
            },
            Reply::text("all done"),
        ]);
        let sent = rt.send(&conv, "do it").await.expect("accepted");
        assert_eq!(sent.sequence_id, 1);
        rt.wait_idle(&conv).await;

        let order = std::fs::read_to_string(rt.cwd(&conv).join("order.txt"))
            .expect("the tools ran in the cwd");
        assert_eq!(order, "first\nsecond\n", "{}", db.backend);
        let requests = rt.llm.requests();
        assert_eq!(requests.len(), 2);
        let results = tool_messages(&requests[1]);
        assert_eq!(results.len(), 2);
        assert_eq!(results[0], ("call_a".into(), "A\n".into()));
        assert_eq!(results[1].0, "call_b");
        assert!(
            results[1].1.contains("[tool failed]") && results[1].1.contains("exit status 7"),
            "{results:?}"
        );

        let history = rt.messages(&conv).await;
        let kinds: Vec<&str> = history
            .iter()
            .map(|m| m.content.message_type().as_str())
            .collect();
        assert_eq!(kinds, ["user", "agent", "tool", "tool", "agent"]);
        match &history[4].content {
            MessageContent::Agent {
                text, tool_uses, ..
            } => {
                assert_eq!(text.as_deref(), Some("all done"));
                assert!(tool_uses.is_empty());
            }
            other => panic!("expected the final agent message, got {other:?}"),
        }
        assert!(
            history[1].usage.is_some(),
            "agent messages carry their usage"
        );
        rt.assert_chain_valid(&conv).await;
        let record = rt.record(&conv).await;
        assert_eq!(record.usage.input_tokens, 200);
        assert_eq!(record.usage.output_tokens, 20);
        rt.stop().await;
        db.drop_db().await;
    }
}

/// REQ-BED-005: a cancel during an LLM request aborts the HTTP request at once, persists no
/// partial response, and leaves the conversation idle.
#[tokio::test]
async fn cancel_during_llm_request_aborts_it() {
    for db in TestDb::each().await {
        let rt = TestRuntime::start(&db, &[]).await;
        let conv = rt.create_conversation().await;
        rt.llm.push([Reply::StallAfterFirstChunk]);
        rt.send(&conv, "hello").await.expect("accepted");
        rt.wait_state(&conv, "llm_requesting", |s| {
            matches!(s, ConvState::LlmRequesting { .. })
        })
        .await;
        eventually("the request to reach the LLM", WAIT, || async {
            (!rt.llm.requests().is_empty()).then_some(())
        })
        .await;
        let outcome = rt.cancel(&conv).await;
        assert!(outcome.aborted_llm);
        rt.wait_idle(&conv).await;
        eventually("the LLM to see the hang-up", WAIT, || async {
            (rt.llm.hangups() == 1).then_some(())
        })
        .await;
        let history = rt.messages(&conv).await;
        assert_eq!(
            history.len(),
            1,
            "only the user message is stored: {history:?}"
        );
        // The conversation goes on: a new message gets a fresh answer.
        rt.llm.push([Reply::text("fresh")]);
        rt.send(&conv, "again")
            .await
            .expect("accepted after the cancel");
        rt.wait_idle(&conv).await;
        eventually("the fresh answer", WAIT, || async {
            (rt.messages(&conv).await.len() == 3).then_some(())
        })
        .await;
        rt.assert_chain_valid(&conv).await;
        rt.stop().await;
        db.drop_db().await;
    }
}

/// REQ-BED-005: a cancel during a tool kills its whole process group (the grandchild too),
/// records "cancelled by user" and skips the queued tool.
#[tokio::test]
async fn cancel_during_tool_kills_the_grandchild() {
    for db in TestDb::each().await {
        let rt = TestRuntime::start(&db, &[]).await;
        let conv = rt.create_conversation().await;
        let sleep = unique_sleep();
        rt.llm.push([Reply::Tools {
            text: None,
            calls: vec![
                (
                    "call_1".into(),
                    "bash".into(),
                    json!({"command": format!("bash -c '{sleep} & touch grandchild.started; wait' ")}),
                ),
                (
                    "call_2".into(),
                    "bash".into(),
                    json!({"command": "touch should-not-exist"}),
                ),
            ],
        }]);
        rt.send(&conv, "start").await.expect("accepted");
        let started = rt.cwd(&conv).join("grandchild.started");
        eventually("the grandchild to start", WAIT, || async {
            started.exists().then_some(())
        })
        .await;
        crate::support::wait_running(&sleep).await;
        let outcome = rt.cancel(&conv).await;
        assert_eq!(outcome.stopped_tools, vec!["call_1".to_owned()]);
        assert!(matches!(outcome.state, ConvState::Idle));
        eventually("the grandchild to die", WAIT, || async {
            (!running(&sleep)).then_some(())
        })
        .await;
        let history = rt.messages(&conv).await;
        let results: Vec<(String, bool, String)> = history
            .iter()
            .filter_map(|m| match &m.content {
                MessageContent::Tool(r) => {
                    Some((r.tool_use_id.clone(), r.cancelled, r.output.clone()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(
            results,
            vec![
                ("call_1".into(), true, "cancelled by user".into()),
                ("call_2".into(), true, "skipped due to cancellation".into()),
            ]
        );
        assert!(!rt.cwd(&conv).join("should-not-exist").exists());
        rt.assert_chain_valid(&conv).await;
        rt.stop().await;
        db.drop_db().await;
    }
}

/// REQ-BED-006: retryable failures are retried with backoff, visible as `retrying` frames,
/// and a later success ends the turn normally.
#[tokio::test]
async fn retries_then_success() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[]).await;
    let conv = rt.create_conversation().await;
    let mut frames = rt.runtime.hub.subscribe(&conv);
    rt.llm.push([
        Reply::status(500, "upstream broke"),
        Reply::status(429, "slow down"),
        Reply::text("finally"),
    ]);
    rt.send(&conv, "hi").await.expect("accepted");
    rt.wait_idle(&conv).await;
    assert_eq!(rt.llm.requests().len(), 3);
    let mut retrying = Vec::new();
    while let Ok(frame) = frames.try_recv() {
        if frame.kind == "retrying" {
            let value: Value = serde_json::from_str(&frame.json).expect("a JSON frame");
            retrying.push((
                value["attempt"].as_u64(),
                value["delay_ms"].as_u64(),
                value["error_kind"].as_str().map(str::to_owned),
            ));
        }
    }
    assert_eq!(
        retrying,
        vec![
            (Some(2), Some(1000), Some("network".into())),
            (Some(3), Some(2000), Some("rate_limit".into()))
        ]
    );
    rt.assert_chain_valid(&conv).await;
    rt.stop().await;
    db.drop_db().await;
}

/// REQ-BED-006: after three failed attempts the conversation is in error, and a new message
/// recovers it.
#[tokio::test]
async fn retries_exhausted_then_recovery() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[]).await;
    let conv = rt.create_conversation().await;
    rt.llm.push([
        Reply::status(503, "down"),
        Reply::status(503, "down"),
        Reply::status(503, "down"),
    ]);
    rt.send(&conv, "hi").await.expect("accepted");
    let (error_kind, message) = rt.wait_error(&conv).await;
    assert_eq!(error_kind, ErrorKind::Network);
    assert!(message.contains("after 3 attempts"), "{message}");
    assert_eq!(rt.llm.requests().len(), 3);
    rt.llm.push([Reply::text("back")]);
    rt.send(&conv, "again")
        .await
        .expect("a message recovers from error");
    rt.wait_idle(&conv).await;
    rt.assert_chain_valid(&conv).await;
    rt.stop().await;
    db.drop_db().await;
}

/// REQ-BED-006: a non-retryable failure is an error at once, with the backend's message.
#[tokio::test]
async fn non_retryable_error_fails_at_once() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[]).await;
    let conv = rt.create_conversation().await;
    rt.llm.push([Reply::status(401, "bad key")]);
    rt.send(&conv, "hi").await.expect("accepted");
    let (error_kind, message) = rt.wait_error(&conv).await;
    assert_eq!(error_kind, ErrorKind::Auth);
    assert!(message.contains("bad key"), "{message}");
    assert_eq!(rt.llm.requests().len(), 1);
    rt.stop().await;
    db.drop_db().await;
}

fn spawn_reply(tasks: &[&str]) -> Reply {
    Reply::tool(
        "call_spawn",
        "spawn_sub_agents",
        json!({"tasks": tasks.iter().map(|t| json!({"prompt": t})).collect::<Vec<_>>()}),
    )
}

/// REQ-BED-008/009: sub-agents run in parallel as non-user-initiated children, each must
/// submit_result; a failing one and one that never submits become failure entries, and the
/// aggregate reaches the parent in task order.
#[tokio::test]
async fn sub_agents_are_aggregated_in_task_order_with_failures() {
    for db in TestDb::each().await {
        let rt = TestRuntime::start(&db, &[]).await;
        let conv = rt.create_conversation().await;
        rt.llm.route(
            "parent task",
            [
                spawn_reply(&["task one", "task two", "task three"]),
                Reply::text("summary"),
            ],
        );
        rt.llm.route(
            "task one",
            [Reply::tool(
                "call_s1",
                "submit_result",
                json!({"result": "one done"}),
            )],
        );
        rt.llm.route(
            "task two",
            [Reply::text("I will not submit"), Reply::text("still not")],
        );
        rt.llm
            .route("task three", [Reply::status(401, "sub-agent key refused")]);
        rt.send(&conv, "parent task").await.expect("accepted");
        rt.wait_idle(&conv).await;
        eventually("the summary", WAIT, || async {
            (rt.messages(&conv).await.len() == 4).then_some(())
        })
        .await;

        let history = rt.messages(&conv).await;
        let aggregate = match &history[2].content {
            MessageContent::Tool(result) => {
                assert_eq!(result.tool_use_id, "call_spawn");
                assert!(result.ok);
                serde_json::from_str::<Value>(&result.output).expect("the aggregate is JSON")
            }
            other => panic!("expected the spawn result, got {other:?}"),
        };
        let entries = aggregate.as_array().expect("an array");
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0]["success"], true);
        assert_eq!(entries[0]["result"], "one done");
        assert_eq!(entries[1]["success"], false);
        assert!(
            entries[1]["result"]
                .as_str()
                .unwrap_or_default()
                .contains("without calling submit_result"),
            "{aggregate}"
        );
        assert_eq!(entries[2]["success"], false);
        assert!(
            entries[2]["result"]
                .as_str()
                .unwrap_or_default()
                .contains("sub-agent key refused"),
            "{aggregate}"
        );

        let children = rt.store.children(&conv).await.expect("children");
        assert_eq!(children.len(), 3);
        for (child, entry) in children.iter().zip(entries) {
            assert!(!child.user_initiated);
            assert_eq!(child.parent_id.as_deref(), Some(conv.as_str()));
            assert_eq!(
                entry["agent_id"],
                child.id.as_str(),
                "entries follow task order"
            );
            assert_eq!(
                child.cwd,
                rt.record(&conv).await.cwd,
                "sub-agents share the cwd"
            );
        }
        let listed = rt
            .store
            .list_conversations(&rt.tenant_id, false, 50, None)
            .await
            .expect("a listing");
        assert_eq!(listed.items.len(), 1, "sub-agents are not listed");

        // The sub-agents' requests offer submit_result and never spawn_sub_agents.
        let requests = rt.llm.requests();
        let sub_request = requests
            .iter()
            .find(|r| r.to_string().contains("task one"))
            .expect("a sub-agent request");
        let names = tool_names(sub_request);
        assert!(
            names.contains(&"submit_result".to_owned())
                && !names.contains(&"spawn_sub_agents".to_owned()),
            "{names:?}"
        );
        let parent_names = tool_names(&requests[0]);
        assert!(
            parent_names.contains(&"spawn_sub_agents".to_owned())
                && !parent_names.contains(&"submit_result".to_owned())
        );
        // The reminder reached the sub-agent that did not submit.
        assert!(
            requests
                .iter()
                .any(|r| r.to_string().contains("call the submit_result tool"))
        );
        rt.assert_chain_valid(&conv).await;
        for child in &children {
            rt.assert_chain_valid(&child.id).await;
            // A sub-agent's replay log starts at step 1 (its actor is started from the row
            // its supervisor just wrote, without reading a last step) and has no gap.
            let numbers: Vec<i64> = rt
                .store
                .steps_of(&child.id, i64::MAX)
                .await
                .expect("steps")
                .iter()
                .flat_map(|row| row.steps.iter().map(|step| step.n))
                .collect();
            assert!(!numbers.is_empty(), "{}", child.id);
            assert_eq!(numbers, (1..=numbers.len() as i64).collect::<Vec<_>>());
        }
        rt.stop().await;
        db.drop_db().await;
    }
}

/// REQ-BED-005: cancelling the parent while it awaits sub-agents stops them all (their LLM
/// requests are dropped) and answers the spawn call with a synthetic result.
#[tokio::test]
async fn cancel_while_awaiting_sub_agents_stops_them() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[]).await;
    let conv = rt.create_conversation().await;
    rt.llm
        .route("parent", [spawn_reply(&["slow one", "slow two"])]);
    rt.llm.route("slow one", [Reply::Stall]);
    rt.llm.route("slow two", [Reply::Stall]);
    rt.send(&conv, "parent").await.expect("accepted");
    rt.wait_state(&conv, "awaiting_sub_agents", |s| {
        matches!(s, ConvState::AwaitingSubAgents { .. })
    })
    .await;
    eventually("both sub-agents to call the LLM", WAIT, || async {
        (rt.llm.requests().len() == 3).then_some(())
    })
    .await;
    let outcome = rt.cancel(&conv).await;
    assert_eq!(outcome.stopped_sub_agents.len(), 2);
    assert!(matches!(outcome.state, ConvState::Idle));
    eventually("the sub-agents' requests to be dropped", WAIT, || async {
        (rt.llm.hangups() == 2).then_some(())
    })
    .await;
    let history = rt.messages(&conv).await;
    match &history.last().expect("messages").content {
        MessageContent::Tool(result) => {
            assert_eq!(result.tool_use_id, "call_spawn");
            assert!(result.cancelled && !result.ok);
            assert!(
                result.output.contains("cancelled by user"),
                "{}",
                result.output
            );
        }
        other => panic!("expected the synthetic spawn result, got {other:?}"),
    }
    // The stopped sub-agents are closed too, not left busy.
    for child in rt.store.children(&conv).await.expect("children") {
        let child = rt
            .wait_state(&child.id, "the sub-agent to rest", |s| !s.is_busy())
            .await;
        assert!(matches!(child.state, ConvState::Idle), "{:?}", child.state);
        rt.assert_chain_valid(&child.id).await;
    }
    rt.assert_chain_valid(&conv).await;
    rt.stop().await;
    db.drop_db().await;
}

/// REQ-BED-008: a sub-agent that runs past its time limit becomes a failure entry.
#[tokio::test]
async fn sub_agent_timeout_is_a_failure_entry() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(
        &db,
        &[
            ("BEDROCK_SUB_AGENTS__TIMEOUT_MS", "1500"),
            ("BEDROCK_SUB_AGENTS__GRACE_MS", "1000"),
        ],
    )
    .await;
    let conv = rt.create_conversation().await;
    rt.llm.route(
        "parent",
        [spawn_reply(&["quick", "forever"]), Reply::text("noted")],
    );
    rt.llm.route(
        "quick",
        [Reply::tool("s", "submit_result", json!({"result": "fast"}))],
    );
    // It stalls in its turn and again in its grace turn.
    rt.llm.route("forever", [Reply::Stall, Reply::Stall]);
    rt.send(&conv, "parent").await.expect("accepted");
    rt.wait_idle(&conv).await;
    let spawn = rt.tool_output(&conv, "call_spawn").await;
    let entries: Value = serde_json::from_str(&spawn).expect("JSON");
    assert_eq!(entries[0]["success"], true);
    assert_eq!(entries[1]["success"], false);
    assert!(
        entries[1]["result"]
            .as_str()
            .unwrap_or_default()
            .contains("time limit of 1.5 s and did not call submit_result in its grace turn"),
        "{entries}"
    );
    eventually("the stalled requests to be dropped", WAIT, || async {
        (rt.llm.hangups() == 2).then_some(())
    })
    .await;
    // The sub-agent that ran out of time is closed, not left busy.
    let slow_id = entries[1]["agent_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let slow = rt
        .wait_state(&slow_id, "the timed-out sub-agent to rest", |s| {
            !s.is_busy()
        })
        .await;
    assert!(
        matches!(slow.state, ConvState::Error { .. }),
        "{:?}",
        slow.state
    );
    rt.assert_chain_valid(&slow_id).await;
    rt.stop().await;
    db.drop_db().await;
}

async fn expect_error(rt: &TestRuntime, conv: &str, kind: ErrorKind, needle: &str) {
    let record = rt
        .wait_state(conv, "error", |s| matches!(s, ConvState::Error { .. }))
        .await;
    match record.state {
        ConvState::Error {
            error_kind,
            message,
        } => {
            assert_eq!(error_kind, kind, "{message}");
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
        other => panic!("{other:?}"),
    }
    rt.assert_chain_valid(conv).await;
}

/// The gateway's hard limits, each hit mechanically with a clear message.
#[tokio::test]
async fn gateway_limit_response_bytes() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[("BEDROCK_LLM__MAX_RESPONSE_BYTES", "20000")]).await;
    let conv = rt.create_conversation().await;
    rt.llm.push([Reply::Huge { size: 100_000 }]);
    rt.send(&conv, "talk a lot").await.expect("accepted");
    expect_error(
        &rt,
        &conv,
        ErrorKind::Limit,
        "exceeds the limit of 20000 bytes",
    )
    .await;
    assert_eq!(
        rt.messages(&conv).await.len(),
        2,
        "no partial response is stored"
    );
    rt.stop().await;
    db.drop_db().await;
}

#[tokio::test]
async fn gateway_limit_tool_argument_bytes() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[("BEDROCK_LLM__MAX_TOOL_ARGS_BYTES", "1000")]).await;
    let conv = rt.create_conversation().await;
    let arguments = json!({"command": "x".repeat(5000)}).to_string();
    rt.llm.push([Reply::RawToolCall {
        id: "c".into(),
        name: "bash".into(),
        arguments,
    }]);
    rt.send(&conv, "big call").await.expect("accepted");
    expect_error(
        &rt,
        &conv,
        ErrorKind::Limit,
        "exceed the limit of 1000 bytes",
    )
    .await;
    rt.stop().await;
    db.drop_db().await;
}

#[tokio::test]
async fn gateway_limit_request_bytes() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[("BEDROCK_LLM__MAX_REQUEST_BYTES", "3000")]).await;
    let conv = rt.create_conversation().await;
    rt.send(&conv, &"y".repeat(4000)).await.expect("accepted");
    expect_error(&rt, &conv, ErrorKind::Limit, "over the limit of 3000 bytes").await;
    assert!(
        rt.llm.requests().is_empty(),
        "an oversized request is never sent"
    );
    rt.stop().await;
    db.drop_db().await;
}

#[tokio::test]
async fn gateway_limits_of_time_are_network_failures_and_retried() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(
        &db,
        &[
            ("BEDROCK_LLM__FIRST_BYTE_TIMEOUT_MS", "300"),
            ("BEDROCK_LLM__IDLE_TIMEOUT_MS", "300"),
        ],
    )
    .await;
    // Time to first byte, then idle between chunks, then a stream cut short: all retried.
    let first = rt.create_conversation().await;
    rt.llm.latency(Duration::from_millis(1500));
    rt.llm.push([
        Reply::text("late"),
        Reply::text("late"),
        Reply::text("late"),
    ]);
    rt.send(&first, "hi").await.expect("accepted");
    expect_error(&rt, &first, ErrorKind::Network, "time to first byte").await;
    assert_eq!(rt.llm.requests().len(), 3);

    rt.llm.latency(Duration::ZERO);
    let second = rt.create_conversation().await;
    rt.llm.push([
        Reply::StallAfterFirstChunk,
        Reply::Truncated,
        Reply::text("third time lucky"),
    ]);
    rt.send(&second, "hi").await.expect("accepted");
    rt.wait_idle(&second).await;
    let history = rt.messages(&second).await;
    assert_eq!(history.len(), 2);
    match &history[1].content {
        MessageContent::Agent { text, .. } => assert_eq!(text.as_deref(), Some("third time lucky")),
        other => panic!("{other:?}"),
    }
    rt.stop().await;
    db.drop_db().await;
}

#[tokio::test]
async fn gateway_limit_total_time() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[("BEDROCK_LLM__TOTAL_TIMEOUT_MS", "400")]).await;
    let conv = rt.create_conversation().await;
    rt.llm.fallback(Reply::StallAfterFirstChunk);
    rt.send(&conv, "hi").await.expect("accepted");
    expect_error(
        &rt,
        &conv,
        ErrorKind::Network,
        "longer than the limit of 400 ms",
    )
    .await;
    rt.stop().await;
    db.drop_db().await;
}

/// The per-backend concurrency limit: requests beyond it wait their turn.
#[tokio::test]
async fn gateway_concurrency_limit() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[("BEDROCK_LLM__MAX_CONCURRENCY", "1")]).await;
    rt.llm.latency(Duration::from_millis(200));
    let mut convs = Vec::new();
    for _ in 0..3 {
        let conv = rt.create_conversation().await;
        rt.send(&conv, "hi").await.expect("accepted");
        convs.push(conv);
    }
    for conv in &convs {
        rt.wait_idle(conv).await;
    }
    assert_eq!(rt.llm.requests().len(), 3);
    assert_eq!(rt.llm.max_in_flight(), 1);
    rt.stop().await;
    db.drop_db().await;
}

/// Tool arguments that are not JSON reach the tool as a failure the model can act on, and go
/// back to the model as a JSON object that holds them (`{"invalid_arguments": ...}`): a
/// backend that parses past arguments (llama-server) must not refuse every later request
/// (issue 42). The stored message keeps them as they came.
#[tokio::test]
async fn invalid_tool_arguments_are_a_failed_result() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[]).await;
    let conv = rt.create_conversation().await;
    rt.llm.push([
        Reply::RawToolCall {
            id: "c1".into(),
            name: "bash".into(),
            arguments: "{\"command\": \"ls".into(),
        },
        Reply::text("sorry"),
    ]);
    rt.send(&conv, "hi").await.expect("accepted");
    rt.wait_idle(&conv).await;
    let requests = rt.llm.requests();
    let results = tool_messages(&requests[1]);
    assert!(
        results[0]
            .1
            .contains("invalid arguments: expected a JSON object"),
        "{results:?}"
    );
    let assistant = request_messages(&requests[1])
        .iter()
        .find(|m| m["role"] == "assistant")
        .expect("the assistant message");
    let sent = assistant["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .expect("arguments are a string");
    let parsed: Value = serde_json::from_str(sent).expect("valid JSON");
    assert_eq!(
        parsed,
        serde_json::json!({"invalid_arguments": "{\"command\": \"ls"})
    );
    rt.assert_chain_valid(&conv).await;
    rt.stop().await;
    db.drop_db().await;
}

/// REQ-BED-011: text deltas reach subscribers live, before the message is stored.
#[tokio::test]
async fn deltas_are_streamed_live() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start(&db, &[]).await;
    let conv = rt.create_conversation().await;
    let mut frames = rt.runtime.hub.subscribe(&conv);
    rt.llm.push([Reply::text("streamed in pieces")]);
    rt.send(&conv, "hi").await.expect("accepted");
    // Frames until the agent's message (the row may be idle before its frames are out).
    let mut deltas = String::new();
    let mut kinds = Vec::new();
    loop {
        let frame = tokio::time::timeout(WAIT, frames.recv())
            .await
            .expect("the agent's message comes")
            .expect("the subscription stays");
        let value: Value = serde_json::from_str(&frame.json).expect("JSON");
        if frame.kind == "delta" {
            deltas.push_str(value["text"].as_str().unwrap_or_default());
        }
        kinds.push(frame.kind.clone());
        if frame.kind == "message" && value["message"]["message_type"] == "agent" {
            break;
        }
    }
    rt.wait_idle(&conv).await;
    assert_eq!(deltas, "streamed in pieces");
    let first_delta = kinds.iter().position(|k| k == "delta").expect("deltas");
    let agent_message = kinds
        .iter()
        .rposition(|k| k == "message")
        .expect("messages");
    assert!(first_delta < agent_message, "{kinds:?}");
    rt.stop().await;
    db.drop_db().await;
}

/// LLM requests whose history the gateway read from the database, from /metrics' counter.
fn history_reads(rt: &TestRuntime) -> u64 {
    rt.runtime
        .metrics
        .encode()
        .lines()
        .find(|line| line.starts_with("bedrock_history_reads_total"))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// REQ-BED-001/007: each LLM request carries the whole stored history, in order, across
/// turns; the gateway builds it from the messages the conversation hands over (a resting
/// conversation included), and reads the database only when it was not handed them, as
/// after the conversation's actor stopped.
#[tokio::test]
async fn history_is_handed_over_across_turns_and_read_after_a_restart() {
    for db in TestDb::each().await {
        let rt = TestRuntime::start(&db, &[]).await;
        let conv = rt.create_conversation().await;
        rt.llm.push([
            Reply::tool("call_1", "think", json!({"thoughts": "a plan"})),
            Reply::text("first answer"),
            Reply::text("second answer"),
        ]);
        rt.send(&conv, "one").await.expect("accepted");
        rt.wait_idle(&conv).await;
        rt.send(&conv, "two").await.expect("accepted");
        rt.wait_idle(&conv).await;
        let requests = rt.llm.requests();
        assert_eq!(requests.len(), 3, "{}", db.backend);
        assert_eq!(
            roles(&requests[2]),
            ["system", "user", "assistant", "tool", "assistant", "user"],
            "{}",
            db.backend
        );
        assert_eq!(requests[2]["messages"][4]["content"], "first answer");
        assert_eq!(requests[2]["messages"][5]["content"], "two");
        assert_eq!(history_reads(&rt), 0, "{}", db.backend);

        // The actor stops; the next one was handed nothing, so the gateway reads.
        let live = rt.runtime.conversations.get(&conv).expect("running");
        let stopped = live.shutdown(WAIT).await;
        assert!(stopped.is_ok(), "{stopped:?}");
        let registry = &rt.runtime.conversations;
        eventually("the actor to stop", WAIT, || async {
            registry.get(&conv).is_none().then_some(())
        })
        .await;
        rt.llm.push([Reply::text("third answer")]);
        rt.send(&conv, "three").await.expect("accepted");
        rt.wait_idle(&conv).await;
        let requests = rt.llm.requests();
        assert_eq!(
            roles(&requests[3]),
            [
                "system",
                "user",
                "assistant",
                "tool",
                "assistant",
                "user",
                "assistant",
                "user"
            ],
            "{}",
            db.backend
        );
        assert_eq!(requests[3]["messages"][6]["content"], "second answer");
        assert_eq!(history_reads(&rt), 1, "{}", db.backend);
        rt.assert_chain_valid(&conv).await;
        rt.stop().await;
        db.drop_db().await;
    }
}
