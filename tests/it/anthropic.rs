//! Anthropic's Messages API (issue 25): the runtime's scenarios that matter, run against
//! the fake's Anthropic side. It streams the same scripted replies as Anthropic's events,
//! cut into pieces of odd sizes, with pings and comments between them. Each scenario checks
//! what is stored and what the request carried: text, tools, retries (429, 529, 500), cancel,
//! a truncated stream, bad tool JSON, images, sub-agents and auth.

use std::time::Duration;

use bedrock::persistence::WriteJob;
use bedrock::state_machine::{ConvState, ErrorKind, ImageRef, MessageContent};
use bedrock::store::NewAttachment;
use bedrock::testkit::Reply;
use serde_json::{Value, json};

use crate::support::rt::Api;
use crate::support::{TestDb, TestRuntime, WAIT, eventually};

async fn anthropic(db: &TestDb) -> TestRuntime {
    TestRuntime::start_on(db, &[], Api::Anthropic).await
}

fn messages(request: &Value) -> &[Value] {
    request["messages"].as_array().map_or(&[], Vec::as_slice)
}

/// REQ-BED-004 on Anthropic's API: a tool-using turn. The request has the system prompt on
/// top with a cache breakpoint, the tools in Anthropic's form, the tool call as a tool_use
/// block, its result as a tool_result block, and a cache breakpoint on the last message.
#[tokio::test]
async fn a_tool_using_turn() {
    for db in TestDb::each().await {
        let rt = anthropic(&db).await;
        let conv = rt.create(Some("Be brief.")).await;
        rt.llm.push([
            Reply::Tools {
                text: Some("Listing.".into()),
                calls: vec![(
                    "toolu_01".into(),
                    "bash".into(),
                    json!({"command": "echo from-the-tool"}),
                )],
            },
            Reply::text("The tool said hello ünïcode ✓."),
        ]);
        rt.send(&conv, "list it").await.expect("accepted");
        rt.wait_idle(&conv).await;
        let stored = rt.messages(&conv).await;
        let contents: Vec<&MessageContent> = stored.iter().map(|m| &m.content).collect();
        assert!(
            matches!(contents[1], MessageContent::Agent { text: Some(t), tool_uses, .. }
            if t == "Listing." && tool_uses[0].id == "toolu_01" && tool_uses[0].input == json!({"command": "echo from-the-tool"}))
        );
        assert!(
            matches!(contents[2], MessageContent::Tool(r) if r.ok && r.output.contains("from-the-tool"))
        );
        assert!(
            matches!(contents[3], MessageContent::Agent { text: Some(t), .. }
            if t == "The tool said hello ünïcode ✓.")
        );
        assert_eq!(stored[3].usage.map(|u| u.output_tokens), Some(10));

        let requests = rt.llm.requests();
        assert_eq!(requests.len(), 2);
        let second = &requests[1];
        assert_eq!(second["stream"], true);
        assert_eq!(second["model"], "fake-model");
        assert!(second["max_tokens"].as_u64().is_some());
        assert_eq!(second["system"][0]["cache_control"]["type"], "ephemeral");
        assert!(
            second["system"][0]["text"]
                .as_str()
                .is_some_and(|t| t.ends_with("Be brief."))
        );
        assert!(second["tools"].as_array().is_some_and(|tools| {
            tools
                .iter()
                .any(|t| t["name"] == "bash" && t["input_schema"]["type"] == "object")
        }));
        let sent = messages(second);
        assert_eq!(sent.len(), 3);
        assert_eq!(sent[0]["role"], "user");
        assert_eq!(sent[1]["role"], "assistant");
        assert_eq!(sent[1]["content"][1]["type"], "tool_use");
        assert_eq!(sent[1]["content"][1]["id"], "toolu_01");
        let result = &sent[2]["content"][0];
        assert_eq!(result["type"], "tool_result");
        assert_eq!(result["tool_use_id"], "toolu_01");
        assert_eq!(result["is_error"], false);
        assert_eq!(result["cache_control"]["type"], "ephemeral");
        // Only the last message is a breakpoint.
        assert!(sent[0]["content"][0].get("cache_control").is_none());
        rt.assert_chain_valid(&conv).await;
        rt.stop().await;
        db.drop_db().await;
    }
}

/// REQ-BED-011: text deltas reach clients live, from Anthropic's text_delta events.
#[tokio::test]
async fn deltas_are_streamed_live() {
    let db = TestDb::sqlite();
    let rt = anthropic(&db).await;
    let conv = rt.create_conversation().await;
    let mut frames = rt.runtime.hub.subscribe(&conv);
    rt.llm.push([Reply::text("streamed in pieces")]);
    rt.send(&conv, "hi").await.expect("accepted");
    // Frames until the agent's message (the row may be idle before its frames are out).
    let mut deltas = String::new();
    loop {
        let frame = tokio::time::timeout(WAIT, frames.recv())
            .await
            .expect("the agent's message comes")
            .expect("the subscription stays");
        let value: Value = serde_json::from_str(&frame.json).expect("JSON");
        if frame.kind == "delta" {
            deltas.push_str(value["text"].as_str().unwrap_or_default());
        }
        if frame.kind == "message" && value["message"]["message_type"] == "agent" {
            break;
        }
    }
    rt.wait_idle(&conv).await;
    assert_eq!(deltas, "streamed in pieces");
    rt.stop().await;
    db.drop_db().await;
}

/// REQ-BED-006: 529 (overloaded) and 429 are rate limits, 500 a network failure; all are
/// retried, and the Retry-After of a 429 sets the delay.
#[tokio::test]
async fn overloaded_and_rate_limited_are_retried() {
    let db = TestDb::sqlite();
    let rt = anthropic(&db).await;
    let conv = rt.create_conversation().await;
    let mut frames = rt.runtime.hub.subscribe(&conv);
    rt.llm.push([
        Reply::status(529, "Overloaded"),
        Reply::Status {
            status: 429,
            message: "slow down".into(),
            retry_after_secs: Some(1),
        },
        Reply::text("finally"),
    ]);
    rt.send(&conv, "hi").await.expect("accepted");
    rt.wait_idle(&conv).await;
    let mut retrying = Vec::new();
    while let Ok(frame) = frames.try_recv() {
        if frame.kind == "retrying" {
            let value: Value = serde_json::from_str(&frame.json).expect("JSON");
            retrying.push(value["error_kind"].as_str().map(str::to_owned));
        }
    }
    assert_eq!(
        retrying,
        vec![Some("rate_limit".to_owned()), Some("rate_limit".to_owned())]
    );
    assert_eq!(rt.llm.requests().len(), 3);
    rt.assert_chain_valid(&conv).await;
    rt.stop().await;
    db.drop_db().await;
}

/// 401 is an auth failure, not retried, with Anthropic's words.
#[tokio::test]
async fn a_refused_key_fails_at_once() {
    let db = TestDb::sqlite();
    let rt = anthropic(&db).await;
    let conv = rt.create_conversation().await;
    rt.llm.push([Reply::status(401, "invalid x-api-key")]);
    rt.send(&conv, "hi").await.expect("accepted");
    let (kind, message) = rt.wait_error(&conv).await;
    assert_eq!(kind, ErrorKind::Auth);
    assert!(message.contains("invalid x-api-key"), "{message}");
    assert_eq!(rt.llm.requests().len(), 1);
    rt.stop().await;
    db.drop_db().await;
}

/// REQ-BED-005: a cancel during the streamed answer hangs up on the backend at once.
#[tokio::test]
async fn cancel_during_the_stream() {
    let db = TestDb::sqlite();
    let rt = anthropic(&db).await;
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
    assert!(rt.cancel(&conv).await.aborted_llm);
    rt.wait_idle(&conv).await;
    eventually("the LLM to see the hang-up", WAIT, || async {
        (rt.llm.hangups() == 1).then_some(())
    })
    .await;
    assert_eq!(rt.messages(&conv).await.len(), 1);
    rt.stop().await;
    db.drop_db().await;
}

/// A stream cut before message_stop is a network failure ("truncated"), retried; three in a
/// row end the turn in error with a valid chain.
#[tokio::test]
async fn a_truncated_stream_is_a_network_failure() {
    let db = TestDb::sqlite();
    let rt = anthropic(&db).await;
    let conv = rt.create_conversation().await;
    rt.llm
        .push([Reply::Truncated, Reply::Truncated, Reply::Truncated]);
    rt.send(&conv, "hi").await.expect("accepted");
    let (kind, message) = rt.wait_error(&conv).await;
    assert_eq!(kind, ErrorKind::Network);
    assert!(message.contains("truncated"), "{message}");
    rt.assert_chain_valid(&conv).await;
    rt.stop().await;
    db.drop_db().await;
}

/// Tool input that is not JSON reaches the tool as a failure the model can act on, and goes
/// back to the model as an object that says what it was.
#[tokio::test]
async fn bad_tool_json_is_a_failed_result() {
    let db = TestDb::sqlite();
    let rt = anthropic(&db).await;
    let conv = rt.create_conversation().await;
    rt.llm.push([
        Reply::RawToolCall {
            id: "toolu_bad".into(),
            name: "bash".into(),
            arguments: "{\"command\": \"ls".into(),
        },
        Reply::text("sorry"),
    ]);
    rt.send(&conv, "hi").await.expect("accepted");
    rt.wait_idle(&conv).await;
    let output = rt.tool_output(&conv, "toolu_bad").await;
    assert!(
        output.contains("invalid arguments: expected a JSON object"),
        "{output}"
    );
    let requests = rt.llm.requests();
    let sent = messages(&requests[1]);
    assert_eq!(
        sent[1]["content"][0]["input"],
        json!({"invalid_arguments": "{\"command\": \"ls"})
    );
    assert_eq!(sent[2]["content"][0]["is_error"], true);
    rt.assert_chain_valid(&conv).await;
    rt.stop().await;
    db.drop_db().await;
}

/// REQ-BED-013: images go as base64 image blocks before the text.
#[tokio::test]
async fn images_are_base64_blocks() {
    let db = TestDb::sqlite();
    let rt = anthropic(&db).await;
    let conv = rt.create_conversation().await;
    rt.runtime
        .persistence
        .write(WriteJob::InsertAttachments(vec![NewAttachment {
            id: "img-1".into(),
            tenant_id: rt.tenant_id.clone(),
            conversation_id: conv.clone(),
            media_type: "image/png".into(),
            data: vec![137, 80, 78, 71],
            width: 1,
            height: 1,
            created_at: chrono::Utc::now(),
        }]))
        .await
        .expect("the image is stored");
    rt.llm.push([Reply::text("a picture")]);
    rt.send_with(
        &conv,
        "what is this?",
        vec![ImageRef {
            id: "img-1".into(),
            media_type: "image/png".into(),
        }],
    )
    .await
    .expect("accepted");
    rt.wait_idle(&conv).await;
    let requests = rt.llm.requests();
    let content = &messages(&requests[0])[0]["content"];
    assert_eq!(content[0]["type"], "image");
    assert_eq!(content[0]["source"]["type"], "base64");
    assert_eq!(content[0]["source"]["media_type"], "image/png");
    assert_eq!(content[0]["source"]["data"], "iVBORw==");
    assert_eq!(content[1]["text"], "what is this?");
    rt.stop().await;
    db.drop_db().await;
}

/// REQ-BED-008/009: sub-agents run on the same API and submit their results; the parent
/// gets the aggregate as its tool result.
#[tokio::test]
async fn sub_agents() {
    let db = TestDb::sqlite();
    let rt = anthropic(&db).await;
    let conv = rt.create_conversation().await;
    rt.llm.route(
        "parent task",
        [
            Reply::tool(
                "toolu_spawn",
                "spawn_sub_agents",
                json!({"tasks": [{"prompt": "task one"}, {"prompt": "task two"}]}),
            ),
            Reply::text("summary"),
        ],
    );
    for (task, result) in [("task one", "one done"), ("task two", "two done")] {
        rt.llm.route(
            task,
            [Reply::tool(
                "toolu_submit",
                "submit_result",
                json!({"result": result}),
            )],
        );
    }
    rt.send(&conv, "parent task").await.expect("accepted");
    rt.wait_idle(&conv).await;
    let output = rt.tool_output(&conv, "toolu_spawn").await;
    let aggregate: Value = serde_json::from_str(&output).expect("the aggregate is JSON");
    assert_eq!(aggregate[0]["result"], "one done");
    assert_eq!(aggregate[1]["result"], "two done");
    assert_eq!(aggregate[0]["success"], true);
    // The sub-agents' requests offered submit_result in Anthropic's form.
    let sub_request = rt
        .llm
        .requests()
        .into_iter()
        .find(|r| messages(r)[0]["content"][0]["text"] == "task one")
        .expect("a sub-agent's request");
    assert!(
        sub_request["tools"]
            .as_array()
            .is_some_and(|tools| tools.iter().any(|t| t["name"] == "submit_result"))
    );
    eventually("the summary", Duration::from_secs(10), || async {
        (rt.messages(&conv).await.len() == 4).then_some(())
    })
    .await;
    rt.assert_chain_valid(&conv).await;
    rt.stop().await;
    db.drop_db().await;
}

/// Parallel tool calls: their results, each stored on its own, reach Anthropic in the one
/// user message right after the calls, tool_result blocks first, even with a background
/// notice among them (the fake refuses any other shape, as Anthropic does).
#[tokio::test]
async fn parallel_tool_calls_are_answered_in_one_message() {
    let db = TestDb::sqlite();
    let rt = anthropic(&db).await;
    let conv = rt.create_conversation().await;
    rt.llm.push([
        Reply::Tools {
            text: None,
            calls: vec![
                (
                    "toolu_a".into(),
                    "bash".into(),
                    json!({"command": "echo a"}),
                ),
                (
                    "toolu_b".into(),
                    "bash".into(),
                    json!({"command": "echo b"}),
                ),
            ],
        },
        Reply::text("both ran"),
    ]);
    rt.send(&conv, "run both").await.expect("accepted");
    rt.wait_idle(&conv).await;
    let requests = rt.llm.requests();
    assert_eq!(requests.len(), 2);
    let sent = messages(&requests[1]);
    let roles: Vec<&str> = sent
        .iter()
        .map(|m| m["role"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user"]);
    let ids: Vec<&str> = sent[2]["content"]
        .as_array()
        .expect("blocks")
        .iter()
        .map(|b| b["tool_use_id"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(ids, ["toolu_a", "toolu_b"]);
    let stored = rt.messages(&conv).await;
    assert!(
        matches!(&stored.last().expect("messages").content, MessageContent::Agent { text: Some(t), .. } if t == "both ran")
    );
    rt.assert_chain_valid(&conv).await;
    rt.stop().await;
    db.drop_db().await;
}

/// The summary request (issue 25) on Anthropic's API, after tools were used: the tools stay
/// defined with `tool_choice: none`, and the conversation ends exhausted with the summary.
#[tokio::test]
async fn the_summary_request_after_tools() {
    let db = TestDb::sqlite();
    let rt = TestRuntime::start_on(
        &db,
        &[("BEDROCK_MODELS__DEFAULT__CONTEXT_WINDOW", "120")],
        Api::Anthropic,
    )
    .await;
    let conv = rt.create_conversation().await;
    rt.llm.push([
        Reply::bash("toolu_1", "echo hi"),
        Reply::text("The user asked for a greeting; it was printed."),
    ]);
    rt.send(&conv, "greet").await.expect("accepted");
    let record = rt
        .wait_state(&conv, "context_exhausted", |s| {
            matches!(s, ConvState::ContextExhausted { .. })
        })
        .await;
    assert_eq!(
        record.state,
        ConvState::ContextExhausted {
            summary: "The user asked for a greeting; it was printed.".into()
        }
    );
    let requests = rt.llm.requests();
    let last = requests.last().expect("the summary request");
    assert_eq!(last["tool_choice"], json!({"type": "none"}));
    assert!(last["tools"].as_array().is_some_and(|t| !t.is_empty()));
    rt.assert_chain_valid(&conv).await;
    rt.stop().await;
    db.drop_db().await;
}
