//! Queued and steering messages (issue 39; docs/api.md, "Queued and steering messages"): a
//! message to a busy conversation waits for the running turn to end (`if_busy=enqueue`) or
//! joins it at its next LLM step (`if_busy=steer`), over REST and the WebSocket; the waiting
//! messages are listed and taken back; they survive a restart; their number is bounded;
//! another tenant sees none. The turn is held busy by a question (`ask_user`) until the test
//! answers it. On SQLite and Postgres, through the real server.

use reqwest::Method;
use serde_json::{Value, json};

use crate::support::ws::Ws;
use crate::support::{TestApp, TestDb, request_messages};
use bedrock::testkit::Reply as Llm;

fn question() -> Llm {
    Llm::tool(
        "call_q",
        "ask_user",
        json!({"question": "go on?", "kind": "confirm"}),
    )
}

async fn send(app: &TestApp, id: &str, text: &str, if_busy: &str) -> Value {
    app.post(
        &format!("/v1/conversations/{id}/messages?if_busy={if_busy}"),
        json!({"text": text}),
    )
    .await
    .expect(202)
}

/// The user messages stored, in order.
async fn user_texts(app: &TestApp, id: &str) -> Vec<String> {
    app.messages(id)
        .await
        .into_iter()
        .filter(|m| m["message_type"] == "user")
        .map(|m| m["content"]["text"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Enqueued messages wait and start the next turns in order; a steering one joins the
/// running turn at its next LLM step, after the tool result; a taken-back one is never
/// stored; the WebSocket enqueues too; another tenant neither sees nor takes them.
#[tokio::test]
async fn messages_wait_their_turn_or_steer_the_running_one() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let id = app.conversation().await;
        app.llm.push([
            question(),
            Llm::text("first turn done"),
            Llm::text("second turn done"),
            Llm::text("fourth turn done"),
        ]);
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.send(&id, "first").await;
        let request = ws.frame_of("client_request").await;

        let second = send(&app, &id, "second", "enqueue").await;
        assert_eq!(second["queued"]["position"], 1, "{second}");
        assert_eq!(second["queued"]["kind"], "enqueue");
        let third = send(&app, &id, "third", "enqueue").await;
        assert_eq!(third["queued"]["position"], 2);
        ws.send(&json!({"type": "user_message", "text": "fourth", "if_busy": "enqueue"}))
            .await;
        let steer = send(&app, &id, "also look at the tests", "steer").await;
        assert_eq!(steer["queued"]["kind"], "steer");
        assert_eq!(steer["queued"]["position"], 1);

        let listed = app
            .get(&format!("/v1/conversations/{id}/queue"))
            .await
            .expect(200);
        let texts: Vec<&str> = listed["queued"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|m| m["text"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(
            texts,
            ["also look at the tests", "second", "third", "fourth"]
        );

        // Another tenant sees and takes nothing.
        let third_id = third["queued"]["queued_id"].as_str().expect("an id");
        for (method, path) in [
            (Method::GET, format!("/v1/conversations/{id}/queue")),
            (
                Method::DELETE,
                format!("/v1/conversations/{id}/queue/{third_id}"),
            ),
            (Method::DELETE, format!("/v1/conversations/{id}/queue")),
        ] {
            app.request(method, &path, Some(&app.key_b), None)
                .await
                .expect_error(404, "not_found");
        }
        app.request(
            Method::DELETE,
            &format!("/v1/conversations/{id}/queue/{third_id}"),
            Some(&app.key_a),
            None,
        )
        .await
        .expect(204);
        app.request(
            Method::DELETE,
            &format!("/v1/conversations/{id}/queue/{third_id}"),
            Some(&app.key_a),
            None,
        )
        .await
        .expect_error(404, "not_found");

        // The question answered: the steering message goes in with the next step.
        let request_id = request["request_id"].as_str().expect("an id");
        app.post(
            &format!("/v1/conversations/{id}/requests/{request_id}"),
            json!({"payload": {"confirmed": true}}),
        )
        .await
        .expect(200);
        crate::support::eventually(
            "every waiting message to run",
            crate::support::WAIT,
            || async {
                let texts = user_texts(&app, &id).await;
                (texts.len() == 4 && app.state(&id).await["kind"] == "idle").then_some(())
            },
        )
        .await;
        assert_eq!(
            user_texts(&app, &id).await,
            ["first", "also look at the tests", "second", "fourth"]
        );
        // The steering message came right after the question's result, in the same turn.
        let requests = app.llm.requests();
        let after_answer = request_messages(&requests[1]);
        let roles: Vec<&str> = after_answer
            .iter()
            .map(|m| m["role"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(&roles[roles.len() - 2..], ["tool", "user"], "{roles:?}");
        assert_eq!(
            after_answer.last().expect("a message")["content"],
            "also look at the tests"
        );
        let listed = app
            .get(&format!("/v1/conversations/{id}/queue"))
            .await
            .expect(200);
        assert_eq!(listed["queued"], json!([]));
        // The turns a waiting message followed ended at rest, not interrupted.
        let metrics = reqwest::get(format!("{}/metrics", app.metrics_base))
            .await
            .expect("the operator listener answers")
            .text()
            .await
            .expect("text");
        let finished = |outcome: &str| -> f64 {
            metrics
                .lines()
                .filter(|l| {
                    l.starts_with("bedrock_turns_finished_total")
                        && l.contains(&format!("outcome=\"{outcome}\""))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        assert_eq!(finished("interrupted"), 0.0, "{metrics}");
        assert_eq!(finished("idle"), 3.0, "{metrics}");
        app.cleanup(db).await;
    }
}

/// The queue is stored with the turn: a restart ends the running turn, and the waiting
/// message then starts the next one, which runs.
#[tokio::test]
async fn the_queue_survives_a_restart() {
    for db in TestDb::each().await {
        let mut app = TestApp::spawn(&db).await;
        let id = app.conversation().await;
        app.llm
            .push([question(), Llm::text("answered after the restart")]);
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.send(&id, "ask me").await;
        ws.frame_of("client_request").await;
        send(&app, &id, "after the restart", "enqueue").await;
        drop(ws);
        app.stop().await;
        app.start().await;
        crate::support::eventually(
            "the waiting message to run",
            crate::support::WAIT,
            || async {
                let texts = user_texts(&app, &id).await;
                (texts.len() == 2 && app.state(&id).await["kind"] == "idle").then_some(())
            },
        )
        .await;
        assert_eq!(user_texts(&app, &id).await, ["ask me", "after the restart"]);
        let last = app.messages(&id).await.pop().expect("a message");
        assert_eq!(last["content"]["text"], "answered after the restart");
        app.cleanup(db).await;
    }
}

/// At most `turn.max_queued` messages wait; past it a send is 409 `queue_full`, and nothing
/// is stored. At rest, enqueue and steer are plain sends.
#[tokio::test]
async fn the_queue_is_bounded() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(
        &db,
        &[
            ("BEDROCK_TURN__MAX_QUEUED", "1"),
            ("BEDROCK_TURN__MAX_QUEUED_BYTES", "64"),
        ],
    )
    .await;
    let id = app.conversation().await;
    app.llm.push([question()]);
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    app.send(&id, "ask me").await;
    ws.frame_of("client_request").await;
    // A flood in bytes is refused before a flood in number.
    app.post(
        &format!("/v1/conversations/{id}/messages?if_busy=enqueue"),
        json!({"text": "x".repeat(65)}),
    )
    .await
    .expect_error(409, "queue_full");
    send(&app, &id, "one", "enqueue").await;
    app.post(
        &format!("/v1/conversations/{id}/messages?if_busy=steer"),
        json!({"text": "two"}),
    )
    .await
    .expect_error(409, "queue_full");
    app.request(
        Method::DELETE,
        &format!("/v1/conversations/{id}/queue"),
        Some(&app.key_a),
        None,
    )
    .await
    .expect(204);
    send(&app, &id, "three", "enqueue").await;
    // A cancel that clears the queue gives control back.
    app.post(
        &format!("/v1/conversations/{id}/cancel?clear_queue=true"),
        json!({}),
    )
    .await
    .expect(202);
    app.wait_kind(&id, "idle").await;
    assert_eq!(user_texts(&app, &id).await, ["ask me"]);
    // At rest: a plain send.
    app.llm.push([Llm::text("hi")]);
    let sent = app
        .post(
            &format!("/v1/conversations/{id}/messages?if_busy=enqueue"),
            json!({"text": "at rest"}),
        )
        .await
        .expect(202);
    assert_eq!(sent["message"]["content"]["text"], "at rest", "{sent}");
    app.cleanup(db).await;
}
