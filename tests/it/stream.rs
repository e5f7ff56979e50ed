//! Live streams over WebSocket and SSE (REQ-BED-011; the API issue).

use std::time::Duration;

use bedrock::testkit::Reply as Llm;
use futures::StreamExt;
use serde_json::{Value, json};

use crate::support::ws::{Next, Ws, is_state};
use crate::support::{TestApp, TestDb, WAIT};

/// The durable event ids of `frames`, which must be contiguous.
#[track_caller]
fn contiguous_ids(frames: &[Value], first: i64) -> Vec<i64> {
    let ids: Vec<i64> = frames
        .iter()
        .filter_map(|f| f["event_id"].as_i64())
        .collect();
    let expected: Vec<i64> = (first..first + ids.len() as i64).collect();
    assert_eq!(ids, expected, "durable frames are contiguous: {frames:#?}");
    ids
}

fn durable(frames: &[Value]) -> Vec<Value> {
    frames
        .iter()
        .filter(|f| f.get("event_id").is_some() && f["type"] != "snapshot")
        .cloned()
        .collect()
}

#[tokio::test]
async fn websocket_snapshot_live_frames_and_replay() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let id = app.conversation().await;
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        let snapshot = ws.frame().await;
        assert_eq!(snapshot["type"], "snapshot");
        assert_eq!(snapshot["conversation"]["id"], id.as_str());
        assert_eq!(snapshot["messages"], json!([]));
        assert_eq!(snapshot["pending_requests"], json!([]));
        assert_eq!(snapshot["event_id"], 0);
        // Drive a turn with a tool over the WebSocket alone.
        app.llm
            .push([Llm::bash("call_1", "echo from-tool"), Llm::text("done now")]);
        ws.send(&json!({"type": "user_message", "text": "go"}))
            .await;
        let frames = ws
            .frames_until(|f| {
                f["type"] == "message"
                    && f["message"]["message_type"] == "agent"
                    && f["message"]["content"]["text"] == "done now"
            })
            .await;
        let mut frames = frames;
        frames.extend(ws.frames_until(|f| is_state(f, "idle")).await);
        let live = durable(&frames);
        let ids = contiguous_ids(&live, 1);
        let kinds: Vec<String> = live
            .iter()
            .map(|f| match f["type"].as_str() {
                Some("state") => {
                    format!("state:{}", f["state"]["kind"].as_str().unwrap_or_default())
                }
                Some("message") => format!(
                    "message:{}",
                    f["message"]["message_type"].as_str().unwrap_or_default()
                ),
                other => other.unwrap_or_default().to_owned(),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "message:user",
                "state:awaiting_llm",
                "state:llm_requesting",
                "message:agent",
                "state:tool_executing",
                "message:tool",
                "state:awaiting_llm",
                "state:llm_requesting",
                "message:agent",
                "state:idle",
            ]
        );
        assert!(
            frames.iter().any(|f| f["type"] == "delta"),
            "deltas are streamed"
        );
        // Reconnect after event 4: exactly 5..=last, the same frames.
        let mut again = Ws::connect(&app.ws_url(&id, "&after_event_id=4")).await;
        let snapshot = again.frame().await;
        assert_eq!(snapshot["type"], "snapshot");
        assert_eq!(snapshot["event_id"], *ids.last().expect("ids"));
        let mut replayed = Vec::new();
        for _ in 5..=*ids.last().expect("ids") {
            replayed.push(again.frame().await);
        }
        assert_eq!(replayed, live[4..].to_vec());
        // Nothing more comes (no duplicates after the replay).
        assert!(
            again.next(Duration::from_millis(300)).await.is_none(),
            "no extra frames"
        );
        app.cleanup(db).await;
    }
}

#[tokio::test]
async fn websocket_rejects_bad_frames_and_stays_open() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_SERVER__MAX_WS_FRAME_BYTES", "2000")]).await;
    let id = app.conversation().await;
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    for garbage in [
        "not json",
        "{\"type\": \"nope\"}",
        "{\"no_type\": 1}",
        "[1, 2]",
        "{\"type\": \"user_message\"}",
    ] {
        ws.send_text(garbage).await;
        let reply = ws.frame().await;
        assert_eq!(reply["type"], "rejected", "{garbage}");
        assert_eq!(reply["code"], "invalid_request");
    }
    ws.send_text(&format!(
        "{{\"type\": \"user_message\", \"text\": \"{}\"}}",
        "x".repeat(3000)
    ))
    .await;
    let reply = ws.frame().await;
    assert_eq!(
        (reply["type"].clone(), reply["code"].clone()),
        (json!("rejected"), json!("payload_too_large"))
    );
    ws.send(&json!({"type": "system_event", "event": {"type": "tool_result"}}))
        .await;
    assert_eq!(ws.frame().await["code"], "forbidden_event_type");
    ws.send(&json!({"type": "respond", "request_id": "nope", "payload": {"confirmed": true}}))
        .await;
    assert_eq!(ws.frame().await["code"], "not_found");
    ws.send(&json!({"type": "ping"})).await;
    assert_eq!(ws.frame().await, json!({"type": "pong"}));
    // Busy: a second message while the first turn runs is refused with agent_busy.
    app.llm.latency(Duration::from_millis(800));
    ws.send(&json!({"type": "user_message", "text": "one"}))
        .await;
    ws.frames_until(|f| is_state(f, "llm_requesting")).await;
    ws.send(&json!({"type": "user_message", "text": "two"}))
        .await;
    let busy = ws.frames_until(|f| f["type"] == "rejected").await;
    assert_eq!(busy.last().expect("a frame")["code"], "agent_busy");
    ws.frames_until(|f| is_state(f, "idle")).await;
    app.cleanup(db).await;
}

#[tokio::test]
async fn websocket_cancel_stops_a_running_tool() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    app.llm.push([Llm::bash("call_sleep", "sleep 120")]);
    ws.send(&json!({"type": "user_message", "text": "wait"}))
        .await;
    ws.frames_until(|f| is_state(f, "tool_executing")).await;
    ws.send(&json!({"type": "cancel"})).await;
    let frames = ws.frames_until(|f| is_state(f, "idle")).await;
    let result = frames
        .iter()
        .find(|f| f["type"] == "message" && f["message"]["message_type"] == "tool")
        .expect("the synthetic result");
    assert_eq!(result["message"]["content"]["output"], "cancelled by user");
    assert_eq!(result["message"]["content"]["cancelled"], true);
    app.cleanup(db).await;
}

/// Reads SSE events `(id, event, data)` from a response body.
struct SseReader {
    body: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buffer: String,
}

impl SseReader {
    async fn open(app: &TestApp, id: &str, last_event_id: Option<i64>) -> SseReader {
        let mut request = app
            .http
            .get(format!("{}/v1/conversations/{id}/stream", app.base))
            .bearer_auth(&app.key_a);
        if let Some(last) = last_event_id {
            request = request.header("Last-Event-ID", last.to_string());
        }
        let response = request.send().await.expect("the stream opens");
        assert_eq!(response.status(), 200);
        assert!(
            response.headers()["content-type"]
                .to_str()
                .unwrap_or_default()
                .starts_with("text/event-stream")
        );
        SseReader {
            body: response.bytes_stream().boxed(),
            buffer: String::new(),
        }
    }

    async fn event(&mut self) -> (Option<String>, String, Value) {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let (mut id, mut event, mut data) = (None, String::new(), String::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id:") {
                        id = Some(v.trim().to_owned());
                    } else if let Some(v) = line.strip_prefix("event:") {
                        event = v.trim().to_owned();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push_str(v.trim_start());
                    }
                }
                if data.is_empty() {
                    continue; // a keep-alive comment
                }
                return (id, event, serde_json::from_str(&data).expect("JSON data"));
            }
            let chunk = tokio::time::timeout(WAIT, self.body.next())
                .await
                .expect("an event in time")
                .expect("the stream goes on")
                .expect("bytes");
            self.buffer.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
}

#[tokio::test]
async fn sse_streams_and_resumes_with_last_event_id() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let mut sse = SseReader::open(&app, &id, None).await;
    let (_, event, snapshot) = sse.event().await;
    assert_eq!(
        (event.as_str(), snapshot["type"].as_str()),
        ("snapshot", Some("snapshot"))
    );
    app.llm.push([Llm::text("over sse")]);
    app.send(&id, "hi").await;
    let mut seen = Vec::new();
    loop {
        let (sse_id, event, data) = sse.event().await;
        if let Some(sse_id) = sse_id {
            assert_eq!(
                sse_id,
                data["event_id"].to_string(),
                "the SSE id is the event id"
            );
            assert_eq!(event, data["type"].as_str().unwrap_or_default());
            seen.push(data.clone());
        }
        if is_state(&data, "idle") {
            break;
        }
    }
    let ids = contiguous_ids(&seen, 1);
    let mut resumed = SseReader::open(&app, &id, Some(2)).await;
    assert_eq!(resumed.event().await.1, "snapshot");
    for expected in &seen[2..] {
        let (_, _, data) = resumed.event().await;
        assert_eq!(&data, expected);
    }
    assert_eq!(*ids.last().expect("ids"), seen.len() as i64);
    app.cleanup(db).await;
}

/// Replay after a restart of the server: the event ids are stored with the conversation.
#[tokio::test]
async fn replay_survives_a_restart() {
    for db in TestDb::each().await {
        let mut app = TestApp::spawn(&db).await;
        let id = app.conversation().await;
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.llm.push([Llm::text("before restart")]);
        ws.send(&json!({"type": "user_message", "text": "hi"}))
            .await;
        let before = durable(&ws.frames_until(|f| is_state(f, "idle")).await);
        drop(ws);
        app.stop().await;
        app.start().await;
        let mut ws = Ws::connect(&app.ws_url(&id, "&after_event_id=2")).await;
        let snapshot = ws.frame().await;
        assert_eq!(snapshot["event_id"], before.len() as i64);
        let mut replayed = Vec::new();
        for _ in 2..before.len() {
            replayed.push(ws.frame().await);
        }
        assert_eq!(replayed, before[2..].to_vec());
        // New frames continue the numbering.
        app.llm.push([Llm::text("after restart")]);
        ws.send(&json!({"type": "user_message", "text": "again"}))
            .await;
        let after = durable(&ws.frames_until(|f| is_state(f, "idle")).await);
        contiguous_ids(&after, before.len() as i64 + 1);
        app.cleanup(db).await;
    }
}

/// Clients that connect while a turn runs get every durable frame exactly once: nothing is
/// lost or duplicated at the seam between replay and live.
#[tokio::test]
async fn no_frame_is_lost_or_duplicated_at_the_seam() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let tools: Vec<(String, String, Value)> = (0..12)
        .map(|i| {
            (
                format!("c{i}"),
                "think".to_owned(),
                json!({"thoughts": format!("step {i}")}),
            )
        })
        .collect();
    app.llm.push([
        Llm::Tools {
            text: None,
            calls: tools,
        },
        Llm::text("finished"),
    ]);
    app.send(&id, "think a lot").await;
    // Connect repeatedly while the turn runs, each resuming after event 1.
    let mut clients = Vec::new();
    for _ in 0..6 {
        let mut ws = Ws::connect(&app.ws_url(&id, "&after_event_id=1")).await;
        ws.frame().await;
        clients.push(ws);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    app.wait_kind(&id, "idle").await;
    let last = app
        .get(&format!("/v1/conversations/{id}"))
        .await
        .expect(200);
    let _ = last;
    for mut ws in clients {
        let frames = durable(&ws.frames_until(|f| is_state(f, "idle")).await);
        contiguous_ids(&frames, 2);
    }
    app.cleanup(db).await;
}

/// A client that does not read is cut off; it never slows the conversation or other clients.
#[tokio::test]
async fn a_slow_client_is_disconnected_and_blocks_nobody() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(
        &db,
        &[
            ("BEDROCK_SERVER__CLIENT_LAG_FRAMES", "8"),
            ("BEDROCK_LLM__MAX_RESPONSE_BYTES", "20000000"),
        ],
    )
    .await;
    let id = app.conversation().await;
    let mut slow = Ws::connect(&app.ws_url(&id, "")).await;
    let mut fast = Ws::connect(&app.ws_url(&id, "")).await;
    fast.frame().await;
    app.llm.push([Llm::Huge { size: 6_000_000 }]);
    app.send(&id, "flood").await;
    let frames = fast.frames_until(|f| is_state(f, "idle")).await;
    let deltas: usize = frames
        .iter()
        .filter(|f| f["type"] == "delta")
        .map(|f| f["text"].as_str().map_or(0, str::len))
        .sum();
    let _ = deltas;
    assert!(
        frames
            .iter()
            .any(|f| f["type"] == "message" && f["message"]["message_type"] == "agent")
    );
    // The slow client, reading at last, finds itself cut off with the reconnect code.
    let mut closed = None;
    while let Some(next) = slow.next(WAIT).await {
        if let Next::Closed(code, reason) = next {
            closed = Some((code, reason));
            break;
        }
    }
    let (code, reason) = closed.expect("the slow client was closed");
    assert_eq!(code, Some(4008), "{reason}");
    assert!(reason.contains("after_event_id"), "{reason}");
    app.cleanup(db).await;
}

/// Frames older than `[events] retain` are removed; a client that resumes from before the
/// window gets the snapshot, a `gap` frame naming the removed event ids, and the messages
/// framed in them (with their own event ids, as it would have seen them live), then the
/// frames still kept: never a silent gap. A resume inside the window sees no gap. Over the
/// WebSocket and SSE alike, on both databases.
#[tokio::test]
async fn a_resume_from_before_the_retention_window_gets_the_messages() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &[("BEDROCK_EVENTS__RETAIN", "2s")]).await;
        let id = app.conversation().await;
        let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
        ws.frame().await;
        app.llm.push([Llm::text("first answer")]);
        app.send(&id, "first").await;
        let old = durable(&ws.frames_until(|f| is_state(f, "idle")).await);
        tokio::time::sleep(Duration::from_millis(2500)).await;
        app.llm.push([Llm::text("second answer")]);
        app.send(&id, "second").await;
        let kept = durable(&ws.frames_until(|f| is_state(f, "idle")).await);
        let last_old = old
            .last()
            .and_then(|f| f["event_id"].as_i64())
            .expect("ids");
        // Until the first turn's frames are gone (retention runs every 500 ms here); the
        // second turn's stay for two seconds.
        let resumed = crate::support::eventually("the old frames to go", WAIT, || async {
            let mut again = Ws::connect(&app.ws_url(&id, "&after_event_id=0")).await;
            let snapshot = again.frame().await;
            assert_eq!(snapshot["type"], "snapshot");
            let first = again.frame().await;
            if first["type"] != "gap" {
                return None;
            }
            let mut frames = vec![first];
            while let Some(Next::Frame(frame)) = again.next(Duration::from_millis(300)).await {
                frames.push(frame);
            }
            Some(frames)
        })
        .await;
        let gap = &resumed[0];
        assert_eq!(gap["from_event_id"], 1, "{gap}");
        let to = gap["to_event_id"].as_i64().expect("an id");
        assert!(to >= last_old, "the first turn's frames are gone: {gap}");
        let old_messages: Vec<Value> = old
            .iter()
            .filter(|f| f["type"] == "message")
            .cloned()
            .collect();
        let after_gap: Vec<Value> = resumed[1..].to_vec();
        let (messages, rest): (Vec<Value>, Vec<Value>) = after_gap
            .into_iter()
            .partition(|f| f["event_id"].as_i64().is_some_and(|e| e <= to));
        assert_eq!(
            messages, old_messages,
            "the messages stand for the removed frames"
        );
        let kept_after: Vec<Value> = kept
            .iter()
            .filter(|f| f["event_id"].as_i64().is_some_and(|e| e > to))
            .cloned()
            .collect();
        assert_eq!(
            rest, kept_after,
            "then every frame still kept, as sent live"
        );

        // SSE from the start: the same.
        let mut sse = SseReader::open(&app, &id, Some(0)).await;
        let (_, kind, _) = sse.event().await;
        assert_eq!(kind, "snapshot");
        let (_, kind, data) = sse.event().await;
        assert_eq!((kind.as_str(), &data), ("gap", gap));

        // Inside the window: no gap.
        let inside = kept_after
            .first()
            .and_then(|f| f["event_id"].as_i64())
            .expect("kept");
        let mut again = Ws::connect(&app.ws_url(&id, &format!("&after_event_id={inside}"))).await;
        again.frame().await;
        let next = again.frame().await;
        assert_ne!(next["type"], "gap", "{next}");
        assert_eq!(next["event_id"], inside + 1);
        app.cleanup(db).await;
    }
}
