//! The runtime through the real actor tree, a real database and the scripted fake LLM
//! (REQ-BED-003..006, 008, 009; the runtime issue).

use bedrock::state_machine::{ConvState, ErrorKind, MessageContent};
use bedrock::testkit::Reply;
use serde_json::{Value, json};

use crate::support::{TestDb, TestRuntime, WAIT, eventually};

fn tool_messages(request: &Value) -> Vec<(String, String)> {
    request["messages"]
        .as_array()
        .map(|ms| {
            ms.iter()
                .filter(|m| m["role"] == "tool")
                .map(|m| {
                    (
                        m["tool_call_id"].as_str().unwrap_or_default().to_owned(),
                        m["content"].as_str().unwrap_or_default().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
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
            MessageContent::Agent { text, tool_uses } => {
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

fn pid_alive(pid: i32) -> bool {
    // Signal 0 checks for existence; a zombie is reaped by its parent shortly.
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
}

/// REQ-BED-005: a cancel during a tool kills its whole process group (the grandchild too),
/// records "cancelled by user" and skips the queued tool.
#[tokio::test]
async fn cancel_during_tool_kills_the_grandchild() {
    for db in TestDb::each().await {
        let rt = TestRuntime::start(&db, &[]).await;
        let conv = rt.create_conversation().await;
        rt.llm.push([Reply::Tools {
            text: None,
            calls: vec![
                (
                    "call_1".into(),
                    "bash".into(),
                    json!({"command": "bash -c 'sleep 300 & echo $! > grandchild.pid; wait' "}),
                ),
                (
                    "call_2".into(),
                    "bash".into(),
                    json!({"command": "touch should-not-exist"}),
                ),
            ],
        }]);
        rt.send(&conv, "start").await.expect("accepted");
        let pid_file = rt.cwd(&conv).join("grandchild.pid");
        let pid: i32 = eventually("the grandchild to start", WAIT, || async {
            std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|s| s.trim().parse().ok())
        })
        .await;
        assert!(pid_alive(pid));
        let outcome = rt.cancel(&conv).await;
        assert_eq!(outcome.stopped_tools, vec!["call_1".to_owned()]);
        assert!(matches!(outcome.state, ConvState::Idle));
        eventually("the grandchild to die", WAIT, || async {
            (!pid_alive(pid)).then_some(())
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
    let mut frames = rt.runtime.services.hub.subscribe(&conv);
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
    let record = rt
        .wait_state(&conv, "error", |s| matches!(s, ConvState::Error { .. }))
        .await;
    match record.state {
        ConvState::Error {
            error_kind,
            message,
        } => {
            assert_eq!(error_kind, ErrorKind::Network);
            assert!(message.contains("after 3 attempts"), "{message}");
        }
        other => panic!("{other:?}"),
    }
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
    let record = rt
        .wait_state(&conv, "error", |s| matches!(s, ConvState::Error { .. }))
        .await;
    match record.state {
        ConvState::Error {
            error_kind,
            message,
        } => {
            assert_eq!(error_kind, ErrorKind::Auth);
            assert!(message.contains("bad key"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(rt.llm.requests().len(), 1);
    rt.stop().await;
    db.drop_db().await;
}
