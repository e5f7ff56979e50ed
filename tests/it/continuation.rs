//! Context continuation (issue 25; docs/api.md, "Context continuation"), through the real
//! server: a turn that fills the context to the threshold is followed by the summary request
//! (no tools); the summary ends the conversation in `context_exhausted`, which refuses
//! messages over REST and the WebSocket; `POST .../continue` starts a new conversation from
//! the summary, and from rest asks for the summary first.

use bedrock::state_machine::SUMMARY_REQUEST;
use bedrock::testkit::Reply;
use reqwest::Method;
use serde_json::{Value, json};

use crate::support::ws::Ws;
use crate::support::{TestApp, TestDb, request_messages};

/// Every fake answer counts 110 tokens of context: with a window of 120 each answer passes
/// 90% of it.
const SMALL_WINDOW: (&str, &str) = ("BEDROCK_MODELS__DEFAULT__CONTEXT_WINDOW", "120");

fn texts(messages: &[Value]) -> Vec<(String, String)> {
    messages
        .iter()
        .map(|m| {
            (
                m["message_type"].as_str().unwrap_or_default().to_owned(),
                m["content"]["text"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_full_context_is_summarised_and_continued() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &[SMALL_WINDOW]).await;
        let id = app.conversation().await;
        app.llm.push([
            Reply::text("hi there"),
            Reply::Tools {
                text: Some("We greeted each other.".into()),
                calls: vec![(
                    "call_in_summary".into(),
                    "bash".into(),
                    json!({"command": "echo never"}),
                )],
            },
        ]);
        app.send(&id, "hello").await;
        let state = app.wait_kind(&id, "context_exhausted").await;
        assert_eq!(state["summary"], "We greeted each other.");

        // The second request was the summary request: no tool may be called, the request
        // last.
        let requests = app.llm.requests();
        assert_eq!(requests.len(), 2);
        assert!(requests[0].get("tool_choice").is_none());
        assert_eq!(requests[1]["tool_choice"], "none", "{}", requests[1]);
        let last = request_messages(&requests[1])
            .last()
            .expect("messages")
            .clone();
        assert_eq!(last["content"], SUMMARY_REQUEST);
        // Stored: the answer, the request, the summary, and its tool call answered unrun.
        let messages = app.messages(&id).await;
        let kinds: Vec<&str> = messages
            .iter()
            .map(|m| m["message_type"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(kinds, ["user", "agent", "system", "agent", "tool"]);
        assert_eq!(messages[4]["content"]["cancelled"], true);
        assert!(!crate::support::running("echo never"));

        // Messages are refused, over REST and the WebSocket.
        let refused = app
            .post(
                &format!("/v1/conversations/{id}/messages"),
                json!({"text": "more"}),
            )
            .await
            .expect_error(409, "context_exhausted");
        assert!(refused.contains("/continue"), "{refused}");
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        let snapshot = ws.frame_of("snapshot").await;
        assert_eq!(
            snapshot["conversation"]["state"]["kind"],
            "context_exhausted"
        );
        ws.send(&json!({"type": "user_message", "text": "more"}))
            .await;
        assert_eq!(ws.frame_of("rejected").await["code"], "context_exhausted");

        // Continued: a new conversation whose one message is the summary.
        let continued = app
            .post(&format!("/v1/conversations/{id}/continue"), json!({}))
            .await
            .expect(201);
        let new_id = continued["id"].as_str().expect("an id").to_owned();
        assert_eq!(continued["continued_from"]["conversation_id"], id.as_str());
        assert_eq!(continued["state"]["kind"], "idle");
        let original = app
            .get(&format!("/v1/conversations/{id}"))
            .await
            .expect(200);
        assert_eq!(continued["cwd"], original["cwd"]);
        let seeded = texts(&app.messages(&new_id).await);
        assert_eq!(seeded.len(), 1);
        assert_eq!(seeded[0].0, "system");
        assert!(seeded[0].1.contains(&id) && seeded[0].1.ends_with("We greeted each other."));
        // It goes on from the summary: its first request starts with it.
        app.llm
            .push([Reply::text("carrying on"), Reply::text("Still greeting.")]);
        app.send(&new_id, "and now?").await;
        // Its window is as small: that answer fills it too, and it is summarised in turn.
        app.wait_kind(&new_id, "context_exhausted").await;
        let requests = app.llm.requests();
        let first = requests
            .iter()
            .find(|r| {
                request_messages(r)
                    .last()
                    .is_some_and(|m| m["content"] == "and now?")
            })
            .expect("the continuation's first request");
        let sent = request_messages(first);
        assert!(
            sent[1]["content"]
                .as_str()
                .is_some_and(|t| t.ends_with("We greeted each other.")),
            "{sent:?}"
        );
        // The source can be continued again (the same summary), and another tenant cannot.
        app.post(&format!("/v1/conversations/{id}/continue"), json!({}))
            .await
            .expect(201);
        app.request(
            Method::POST,
            &format!("/v1/conversations/{id}/continue"),
            Some(&app.key_b),
            None,
        )
        .await
        .expect_error(404, "not_found");
        app.cleanup(db).await;
    }
}

/// From rest, `/continue` asks for the summary first and waits for it; a busy conversation
/// is refused, and a summary that fails is a clear 409.
#[tokio::test]
async fn continue_from_rest_asks_for_the_summary() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    app.llm.push([Reply::text("an answer")]);
    app.send(&id, "hello").await;
    app.wait_kind(&id, "idle").await;
    app.llm.push([Reply::text("The user said hello.")]);
    let continued = app
        .post(&format!("/v1/conversations/{id}/continue"), json!({}))
        .await
        .expect(201);
    let source = app.state(&id).await;
    assert_eq!(source["kind"], "context_exhausted");
    assert_eq!(source["summary"], "The user said hello.");
    let new_id = continued["id"].as_str().expect("an id");
    let seeded = texts(&app.messages(new_id).await);
    assert!(seeded[0].1.ends_with("The user said hello."));

    // Busy: refused.
    let busy = app.conversation().await;
    app.llm.push([Reply::Stall]);
    app.send(&busy, "think").await;
    app.wait_kind(&busy, "llm_requesting").await;
    app.post(&format!("/v1/conversations/{busy}/continue"), json!({}))
        .await
        .expect_error(409, "agent_busy");
    app.post(&format!("/v1/conversations/{busy}/cancel"), json!({}))
        .await
        .expect(202);
    app.wait_kind(&busy, "idle").await;

    // A summary request the backend refuses.
    app.llm.push([Reply::status(401, "key revoked")]);
    let failed = app
        .post(&format!("/v1/conversations/{busy}/continue"), json!({}))
        .await
        .expect_error(409, "summary_failed");
    assert!(failed.contains("key revoked"), "{failed}");
    app.cleanup(db).await;
}
