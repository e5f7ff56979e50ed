//! Live streams (REQ-BED-011): WebSocket (read-write) and SSE (read-only), same frames.
//!
//! On connect: subscribe to the hub first, then send the snapshot, then replay the durable
//! frames after `after_event_id` from the database, then the live frames. A durable frame at
//! or below the last event id sent is a duplicate from the seam and is dropped; a gap is
//! filled from the database. A client that falls too far behind is cut off with close code
//! 4008 and must reconnect with its last event id; it never slows the conversation down.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::http::{HeaderMap, HeaderValue, Method, Uri, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use tokio::sync::mpsc;

use super::AppState;
use super::auth::{Caller, Credential};
use super::delivery::{
    Delivered, Outgoing, Target, answer_request, cancel_conversation, check_client_event, deliver,
    post_event,
};
use super::error::{ApiError, ErrorBody, Path, Query};
use crate::hub::{Frame, RecvError, Subscription, TryRecvError};
use crate::model::ConversationRecord;
use crate::state_machine::ConvState;
use crate::wire::{self, ClientFrame, ServerFrame, StreamQuery};

/// Close code: you fell behind; reconnect with `after_event_id` = your last event id.
pub const CLOSE_LAGGED: u16 = 4008;
/// Close code: the server is going away.
const CLOSE_GOING_AWAY: u16 = 1001;
/// The stream's key was revoked (policy violation).
const CLOSE_REVOKED: u16 = 1008;
const REVOKED: &str = "the API key was revoked";
/// A client whose socket takes no data for this long is dropped.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// What the pump hands to a transport.
enum Out {
    Frame(Arc<Frame>),
    Close(u16, String),
}

fn frame(frame: &ServerFrame<'_>) -> Arc<Frame> {
    Arc::new(wire::frame(frame))
}

/// A frame's text as a WebSocket payload, sharing the hub's copy (checked as UTF-8 again,
/// which it always is: it was made from a `str`).
fn ws_text(frame: &Frame) -> Utf8Bytes {
    struct Shared(Arc<str>);
    impl AsRef<[u8]> for Shared {
        fn as_ref(&self) -> &[u8] {
            self.0.as_bytes()
        }
    }
    Utf8Bytes::try_from(Bytes::from_owner(Shared(Arc::clone(&frame.json))))
        .unwrap_or_else(|_| Utf8Bytes::from(&*frame.json))
}

/// The snapshot frame: state, the last 50 messages, pending client requests.
async fn snapshot(app: &AppState, conv: &ConversationRecord) -> Result<Arc<Frame>, ApiError> {
    let store = &app.store;
    let messages = if conv.next_sequence_id > 1 {
        store.recent_messages(&conv.id, 50).await?
    } else {
        Vec::new()
    };
    // A request is pending only while the tool that asked runs: it is resolved (answered,
    // expired, cancelled) before the tool's result is stored, and expired at a restart. A
    // client tool's call waits while it is the tool that runs (a restart keeps it).
    let (pending, calls) = if let ConvState::ToolExecuting { current, .. } = &conv.state {
        let client_tool = conv.client_tools.iter().any(|t| t.name == current.name);
        (
            store.pending_requests(&conv.id).await?,
            if client_tool {
                store.client_tool_calls(&conv.id, true).await?
            } else {
                Vec::new()
            },
        )
    } else {
        (Vec::new(), Vec::new())
    };
    Ok(frame(&ServerFrame::Snapshot {
        conversation: app.conversation_json(conv),
        messages: messages.iter().map(|m| app.message_json(conv, m)).collect(),
        pending_requests: pending.iter().map(wire::pending_request).collect(),
        pending_client_tool_calls: calls.iter().map(wire::client_tool_call).collect(),
        event_id: conv.last_event_id(),
    }))
}

/// Where a stream's frames go: a WebSocket or an SSE response. Frames are queued with
/// `frame` and go out together at the next `flush_frames`: a burst of frames is one write.
trait FrameSink {
    /// Queues one frame; false when the client is gone.
    async fn frame(&mut self, frame: Arc<Frame>) -> bool;
    /// Sends what is queued; false when the client is gone.
    async fn flush_frames(&mut self) -> bool;
}

type WsSink = futures::stream::SplitSink<WebSocket, Message>;

impl FrameSink for WsSink {
    async fn frame(&mut self, frame: Arc<Frame>) -> bool {
        let feed = self.feed(Message::Text(ws_text(&frame)));
        matches!(tokio::time::timeout(SEND_TIMEOUT, feed).await, Ok(Ok(())))
    }

    async fn flush_frames(&mut self) -> bool {
        let flush = SinkExt::flush(self);
        matches!(tokio::time::timeout(SEND_TIMEOUT, flush).await, Ok(Ok(())))
    }
}

impl FrameSink for mpsc::Sender<Out> {
    async fn frame(&mut self, frame: Arc<Frame>) -> bool {
        self.send(Out::Frame(frame)).await.is_ok()
    }

    async fn flush_frames(&mut self) -> bool {
        !self.is_closed()
    }
}

/// The conversation a stream follows.
#[derive(Clone, Copy)]
struct Followed<'a> {
    app: &'a AppState,
    id: &'a str,
    /// Its model's context window (message frames carry it).
    window: u64,
}

/// One stored frame's item: a message's sequence id, a state, or the whole frame.
#[derive(Deserialize)]
enum Item<'a> {
    #[serde(rename = "m")]
    Message(i64),
    #[serde(rename = "s", borrow)]
    State(&'a RawValue),
    #[serde(rename = "f", borrow)]
    Whole(&'a RawValue),
}

/// A state frame made again from its stored state.
#[derive(Serialize)]
struct StateFrame<'a> {
    r#type: &'static str,
    state: &'a RawValue,
    event_id: i64,
}

/// Sends the durable frames in `(after, until]` from the database; returns the last id sent.
/// Frames that are no longer stored (retention) are announced with a `gap` frame and stood
/// for by the messages framed in them.
async fn replay(
    followed: Followed<'_>,
    mut after: i64,
    until: i64,
    sink: &mut impl FrameSink,
) -> Option<i64> {
    let store = &followed.app.store;
    while after < until {
        let before = after;
        let rows = store.frames_after(followed.id, after, 100).await.ok()?;
        let first_stored = rows.first().map_or(until + 1, |row| row.first_event_id);
        if first_stored > after + 1 {
            after = gap(followed, after, (first_stored - 1).min(until), sink).await?;
            continue;
        }
        let mut items = Vec::with_capacity(rows.len());
        for row in &rows {
            let parsed: Vec<Item<'_>> = serde_json::from_str(&row.frames).ok()?;
            items.extend(
                parsed
                    .into_iter()
                    .enumerate()
                    .map(|(i, item)| (row.first_event_id + i as i64, item))
                    .filter(|(event_id, _)| *event_id > after && *event_id <= until),
            );
        }
        let sequence = items.iter().filter_map(|(_, item)| match item {
            Item::Message(seq) => Some(*seq),
            Item::State(_) | Item::Whole(_) => None,
        });
        let (low, high) = sequence.fold((i64::MAX, i64::MIN), |(l, h), s| (l.min(s), h.max(s)));
        let messages = if low <= high {
            store.messages_between(followed.id, low, high).await.ok()?
        } else {
            Vec::new()
        };
        for (event_id, item) in items {
            let frame = match item {
                Item::Message(seq) => {
                    let message = messages.iter().find(|m| m.sequence_id == seq)?;
                    wire::frame(&ServerFrame::Message {
                        message: wire::message(message, followed.window),
                        event_id,
                    })
                }
                Item::State(state) => Frame::new(
                    "state",
                    Some(event_id),
                    wire::to_json(&StateFrame {
                        r#type: "state",
                        state,
                        event_id,
                    })
                    .into(),
                ),
                Item::Whole(frame) => {
                    let kind = serde_json::from_str::<FrameKind<'_>>(frame.get())
                        .map_or("system_event", |k| k.kind);
                    Frame::new(kind, Some(event_id), frame.get().into())
                }
            };
            after = event_id;
            if !sink.frame(Arc::new(frame)).await {
                return None;
            }
        }
        if after == before {
            break; // nothing stored beyond `after` (or rows that say less than they span)
        }
    }
    Some(after)
}

/// The `type` of a stored frame.
#[derive(Deserialize)]
struct FrameKind<'a> {
    #[serde(rename = "type", borrow)]
    kind: &'a str,
}

/// Announces that the frames `(after, to]` are no longer stored, and sends the messages
/// framed in them; returns `to`.
async fn gap(
    followed: Followed<'_>,
    after: i64,
    to: i64,
    sink: &mut impl FrameSink,
) -> Option<i64> {
    let gap = wire::frame(&ServerFrame::Gap {
        from_event_id: after + 1,
        to_event_id: to,
    });
    if !sink.frame(Arc::new(gap)).await {
        return None;
    }
    let messages = followed
        .app
        .store
        .messages_framed_between(followed.id, after + 1, to)
        .await
        .ok()?;
    for (event_id, message) in &messages {
        let frame = wire::frame(&ServerFrame::Message {
            message: wire::message(message, followed.window),
            event_id: *event_id,
        });
        if !sink.frame(Arc::new(frame)).await {
            return None;
        }
    }
    Some(to)
}

/// Subscribes, then sends the snapshot and the replay after `after`. Returns the live
/// receiver and the last event id sent, or `None` when the client went away.
async fn open(
    followed: Followed<'_>,
    after: Option<i64>,
    sink: &mut impl FrameSink,
) -> Option<(Subscription, i64)> {
    let app = followed.app;
    let live = app.hub.subscribe(followed.id);
    // Read the conversation after subscribing, so nothing committed in between is missed.
    let conv = app.current(followed.id).await.ok()??;
    let first = snapshot(app, &conv).await.ok()?;
    if !sink.frame(first).await {
        return None;
    }
    let mut last = conv.last_event_id();
    if let Some(after) = after.filter(|a| *a < conv.last_event_id()) {
        last = replay(followed, after.max(0), last, sink).await?.max(last);
    }
    sink.flush_frames().await.then_some((live, last))
}

/// Forwards one item from the hub: a durable frame at or below `last` is a duplicate from the
/// seam and dropped; a gap is filled from the database. `Err` carries the close to send.
async fn forward(
    followed: Followed<'_>,
    received: Result<Arc<Frame>, RecvError>,
    last: &mut i64,
    sink: &mut impl FrameSink,
) -> Result<(), Option<(u16, String)>> {
    let frame = match received {
        Ok(frame) => frame,
        Err(RecvError::Lagged) => {
            return Err(Some((
                CLOSE_LAGGED,
                format!("lagged: reconnect with after_event_id={last}"),
            )));
        }
        Err(RecvError::Closed) => return Err(None),
    };
    if frame.is_wake() {
        // Another node committed up to here: send what is stored beyond what was sent.
        if let Some(until) = frame.event_id.filter(|until| *until > *last) {
            let sent = Box::pin(replay(followed, *last, until, sink)).await;
            *last = sent.ok_or(None)?.max(*last);
        }
        return Ok(());
    }
    if let Some(event_id) = frame.event_id {
        if event_id <= *last {
            return Ok(());
        }
        if event_id > *last + 1 {
            // Rare, and its future is large: boxed, so the connection's own stays small.
            Box::pin(replay(followed, *last, event_id - 1, sink))
                .await
                .ok_or(None)?;
        }
        *last = event_id;
    }
    if sink.frame(frame).await {
        Ok(())
    } else {
        Err(None)
    }
}

/// Forwards `first` and every frame already waiting behind it, then sends them in one write.
async fn forward_ready(
    followed: Followed<'_>,
    first: Result<Arc<Frame>, RecvError>,
    live: &mut Subscription,
    last: &mut i64,
    sink: &mut impl FrameSink,
) -> Result<(), Option<(u16, String)>> {
    let mut received = first;
    loop {
        forward(followed, received, last, sink).await?;
        received = match live.try_recv() {
            Ok(frame) => Ok(frame),
            Err(TryRecvError::Empty) => break,
            Err(TryRecvError::Ended(ended)) => Err(ended),
        };
    }
    if sink.flush_frames().await {
        Ok(())
    } else {
        Err(None)
    }
}

/// Bytes read from a WebSocket at a time.
const WS_READ_BUFFER: usize = 4096;

const GOING_AWAY: &str = "the server is shutting down; reconnect with after_event_id";

/// The live stream, read-write: a `snapshot`, the durable frames after `after_event_id`,
/// then live frames (ServerFrame); the client sends ClientFrame. Close code 4008: you fell
/// behind, reconnect with your last event id.
#[utoipa::path(get, path = "/conversations/{id}/ws", tag = "live stream",
    params(("id" = String, Path, description = "The conversation's id or slug"), StreamQuery),
    responses(
        (status = 101, description = "Switching to the WebSocket protocol; frames are ServerFrame (server to client) and ClientFrame (client to server)"),
        (status = 400, description = "`invalid_request`: not a WebSocket upgrade", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: the tenant has its quota of open streams", body = ErrorBody),
    ))]
pub async fn websocket(
    State(app): State<AppState>,
    caller: Caller,
    credential: Credential,
    Path(id): Path<String>,
    Query(q): Query<StreamQuery>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let conv = app.target(&caller, &id).await?;
    let upgrade = upgrade
        .map_err(|e| ApiError::invalid(format!("this route needs a WebSocket upgrade: {e}")))?;
    // Counted against the tenant's `streams` quota until the socket closes.
    let held = app.quotas.stream(&caller.0.id).await?;
    let limit = app.settings.server.max_ws_frame_bytes;
    Ok(upgrade
        // tungstenite zero-fills this much before every read of the socket; at its default
        // (128 KiB) that was a fifth of the server's CPU with many quiet clients. Larger
        // frames simply take more reads.
        .read_buffer_size(WS_READ_BUFFER)
        // A browser that sent its key as the subprotocol `bearer.<key>` beside `bedrock` is
        // answered `bedrock` (never the key).
        .protocols([super::auth::SUBPROTOCOL])
        .max_message_size(limit.saturating_mul(4))
        .max_frame_size(limit.saturating_mul(4))
        .on_upgrade(move |socket| async move {
            serve_socket(app, conv, credential, q.after_event_id, socket).await;
            drop(held);
        })
        .into_response())
}

/// A WebSocket's channel of answers to its client's own frames.
type Replies = (mpsc::Sender<Arc<Frame>>, mpsc::Receiver<Arc<Frame>>);

async fn serve_socket(
    app: AppState,
    conv: Target,
    credential: Credential,
    after: Option<i64>,
    socket: WebSocket,
) {
    let metrics = app.metrics.clone();
    metrics.websocket(true);
    let (mut sink, mut incoming) = socket.split();
    let followed = Followed {
        app: &app,
        id: &conv.id,
        window: app.window(&conv.fixed.model),
    };
    // Boxed: the snapshot and replay's future is large and needed once, and a connection's
    // task keeps room for its largest state as long as it lives.
    if let Some((mut live, mut last)) = Box::pin(open(followed, after, &mut sink)).await {
        // Answers to the client's own frames (rejections, pongs), made with the first of
        // them: most clients only listen.
        let mut replies: Option<Replies> = None;
        let limit = app.settings.server.max_ws_frame_bytes;
        // An idle socket is pinged, and closed when it answers nothing: a dead or silent
        // client does not keep its connection (and its place under the cap) for ever.
        let ping_after = Duration::from_millis(app.settings.server.ws_ping_interval_ms);
        let idle_after = Duration::from_millis(app.settings.server.ws_idle_timeout_ms);
        let mut heard = tokio::time::Instant::now();
        let mut pinged = false;
        let mut recheck = tokio::time::interval(app.key_recheck());
        recheck.reset();
        // One timer for the socket's life, moved only when it fires: a frame heard moves
        // `heard`, and the timer, firing early, is set again from it.
        let tick = tokio::time::sleep_until(heard + ping_after);
        tokio::pin!(tick);
        let close = loop {
            let reply = async {
                match replies.as_mut() {
                    Some((_, rx)) => rx.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = app.shutdown.cancelled() => break Some((CLOSE_GOING_AWAY, GOING_AWAY.to_owned())),
                _ = recheck.tick() => {
                    if !app.key_still_valid(&credential).await {
                        break Some((CLOSE_REVOKED, REVOKED.to_owned()));
                    }
                }
                () = &mut tick => {
                    let due = heard + if pinged { idle_after } else { ping_after };
                    if due > tokio::time::Instant::now() {
                        tick.as_mut().reset(due);
                        continue;
                    }
                    if pinged {
                        break Some((CLOSE_GOING_AWAY, format!("idle: nothing received for {} s", idle_after.as_secs())));
                    }
                    pinged = true;
                    tick.as_mut().reset(heard + idle_after);
                    let ping = sink.send(Message::Ping(Bytes::from_static(b"bedrock")));
                    if !matches!(tokio::time::timeout(SEND_TIMEOUT, ping).await, Ok(Ok(()))) {
                        break None;
                    }
                }
                received = live.recv() => {
                    if let Err(close) = forward_ready(followed, received, &mut live, &mut last, &mut sink).await {
                        break close;
                    }
                }
                reply = reply => {
                    if let Some(reply) = reply && !(sink.frame(reply).await && sink.flush_frames().await) {
                        break None;
                    }
                }
                message = incoming.next() => {
                    heard = tokio::time::Instant::now();
                    pinged = false;
                    match message {
                    Some(Ok(Message::Text(text))) => {
                        let reply_tx = &replies.get_or_insert_with(|| mpsc::channel(64)).0;
                        if text.len() > limit {
                            let _ = reply_tx.try_send(rejected("payload_too_large", &format!("frames are limited to {limit} bytes")));
                            continue;
                        }
                        client_frame(&app, &conv, &credential, text.as_str(), reply_tx);
                    }
                    Some(Ok(Message::Binary(_))) => {
                        let reply_tx = &replies.get_or_insert_with(|| mpsc::channel(64)).0;
                        let _ = reply_tx.try_send(rejected("invalid_request", "binary frames are not accepted; send JSON text"));
                    }
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    Some(Ok(Message::Close(_)) | Err(_)) | None => break None,
                    }
                }
            }
        };
        drop(live);
        if let Some((code, reason)) = close {
            let close = sink.send(Message::Close(Some(CloseFrame {
                code,
                reason: reason.into(),
            })));
            let _ = tokio::time::timeout(SEND_TIMEOUT, close).await;
        }
    }
    // Our receiver is gone (dropped with the loop above); drop the channel if it was the last.
    app.hub.release(&conv.id);
    metrics.websocket(false);
}

fn rejected(code: &str, message: &str) -> Arc<Frame> {
    frame(&ServerFrame::Rejected { code, message })
}

fn rejected_by(error: &ApiError) -> Arc<Frame> {
    rejected(error.code, &error.message)
}

/// Handles one client frame; slow work runs in a task, and any refusal comes back as a
/// `rejected` frame on `replies` while the connection stays open.
fn client_frame(
    app: &AppState,
    conv: &Target,
    credential: &Credential,
    text: &str,
    replies: &mpsc::Sender<Arc<Frame>>,
) {
    // Client frames count against the key's rate, as requests do.
    if let Err(secs) = app
        .rate
        .admit_known(&app.metrics, &super::auth::key_id(credential))
    {
        let _ = replies.try_send(rejected(
            "rate_limited",
            &format!("too many frames for this API key; try again in {secs} s"),
        ));
        return;
    }
    let parsed: Result<ClientFrame, _> = serde_json::from_str(text);
    let frame = match parsed {
        Ok(frame) => frame,
        Err(e) => {
            let _ = replies.try_send(rejected(
                "invalid_request",
                &format!(
                    "not a client frame (user_message, cancel, respond, system_event, ping): {e}"
                ),
            ));
            return;
        }
    };
    let (app, conv, replies) = (app.clone(), conv.clone(), replies.clone());
    let credential = credential.clone();
    tokio::spawn(async move {
        // A command for a conversation another node runs is that node's to carry out.
        if !matches!(frame, ClientFrame::Ping)
            && let Err(error) = app.owned_here(&conv.id).await
        {
            let reply = match error.forward.as_deref() {
                Some(owner) => carry_command(&app, owner, &credential, &conv.id, &frame).await,
                None => Some(rejected_by(&error)),
            };
            if let Some(reply) = reply {
                let _ = replies.send(reply).await;
            }
            return;
        }
        let outcome: Result<Option<Arc<Frame>>, ApiError> = match frame {
            ClientFrame::Ping => Ok(Some(self::frame(&ServerFrame::Pong))),
            ClientFrame::UserMessage {
                text,
                images,
                message_id,
                if_busy,
            } => {
                let out = Outgoing {
                    text,
                    images: images.into_iter().map(|i| (i.media_type, i.data)).collect(),
                    message_id,
                    if_busy: wire::IfBusy::Reject,
                    arrived_during: None,
                }
                .arriving(&app, &conv.id, if_busy);
                deliver(&app, &conv, out)
                    .await
                    .map(|delivered| match delivered {
                        Delivered::Waiting {
                            id,
                            position,
                            steering,
                        } => Some(self::frame(&ServerFrame::Queued {
                            queued_id: &id,
                            position,
                            kind: if steering { "steer" } else { "enqueue" },
                        })),
                        Delivered::New(_) | Delivered::Repeat(_) => None,
                    })
            }
            ClientFrame::Cancel => cancel_conversation(&app, &conv.id).await.map(|_| None),
            ClientFrame::Respond {
                request_id,
                payload,
            } => answer_request(&app, &conv.id, &request_id, payload)
                .await
                .map(|()| None),
            ClientFrame::ClientToolResult {
                call_id,
                output,
                is_error,
            } => super::client_tools::answer(&app, &conv.id, &call_id, output, is_error)
                .await
                .map(|()| None),
            ClientFrame::SystemEvent { event } => match check_client_event(&event) {
                Ok(()) => post_event(&app, &conv.id, event).await.map(|()| None),
                Err(e) => Err(e),
            },
        };
        let reply = match outcome {
            Ok(reply) => reply,
            Err(error) => Some(rejected_by(&error)),
        };
        if let Some(reply) = reply {
            let _ = replies.send(reply).await;
        }
    });
}

/// A client frame for a conversation another node owns, carried to that node as the REST
/// request that does the same, with the client's key: `None` when the owner took it, else a
/// `rejected` frame with the owner's refusal.
async fn carry_command(
    app: &AppState,
    owner: &str,
    credential: &Credential,
    id: &str,
    frame: &ClientFrame,
) -> Option<Arc<Frame>> {
    let refused = |message: &str| Some(rejected("unavailable", message));
    let Some(cluster) = app.cluster.as_deref() else {
        return refused("the conversation runs on another node");
    };
    if owner.is_empty() {
        return refused("the conversation is changing nodes; try again shortly");
    }
    let mut query = None;
    let (segments, body): (&[&str], Value) = match frame {
        ClientFrame::UserMessage {
            text,
            images,
            message_id,
            if_busy,
        } => {
            query = match if_busy {
                wire::IfBusy::Reject => None,
                wire::IfBusy::Interrupt => Some("if_busy=interrupt"),
                wire::IfBusy::Enqueue => Some("if_busy=enqueue"),
                wire::IfBusy::Steer => Some("if_busy=steer"),
            };
            let images: Vec<Value> = images
                .iter()
                .map(|i| serde_json::json!({"media_type": i.media_type, "data": i.data}))
                .collect();
            let mut body = serde_json::json!({"text": text, "images": images});
            if let Some(message_id) = message_id {
                body["message_id"] = Value::from(message_id.as_str());
            }
            (&["messages"], body)
        }
        ClientFrame::Cancel => (&["cancel"], serde_json::json!({})),
        ClientFrame::SystemEvent { event } => (&["events"], serde_json::json!({"event": event})),
        ClientFrame::Respond {
            request_id,
            payload,
        } => (
            &["requests", request_id.as_str()],
            serde_json::json!({"payload": payload}),
        ),
        ClientFrame::ClientToolResult {
            call_id,
            output,
            is_error,
        } => (
            &["tool_results", call_id.as_str()],
            serde_json::json!({"output": output, "is_error": is_error}),
        ),
        ClientFrame::Ping => return None,
    };
    let Some(uri) = route(id, segments, query) else {
        return refused("the frame could not be carried to the conversation's node");
    };
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(key) = &credential.0
        && let Ok(value) = HeaderValue::from_str(&format!("Bearer {key}"))
    {
        headers.insert(header::AUTHORIZATION, value);
    }
    let body = Bytes::from(wire::to_json(&body));
    let answer = match super::cluster::carry(cluster, owner, Method::POST, &uri, headers, body)
        .await
    {
        Ok(answer) => answer,
        Err(error) => {
            tracing::warn!(%owner, %error, "the owner of a conversation did not answer a carried frame");
            return refused("the conversation's node did not answer; try again shortly");
        }
    };
    if answer.status().is_success() {
        return None;
    }
    let body = axum::body::to_bytes(answer.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    let error: Value = serde_json::from_slice(&body).unwrap_or_default();
    let detail = |field: &str| {
        error["error"][field]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let (code, message) = (detail("code"), detail("message"));
    Some(rejected(
        if code.is_empty() {
            "unavailable"
        } else {
            &code
        },
        &message,
    ))
}

/// The path of a conversation's REST command, `segments` after its id, each encoded.
fn route(id: &str, segments: &[&str], query: Option<&str>) -> Option<Uri> {
    let mut url = url::Url::parse("http://node/").ok()?;
    url.path_segments_mut()
        .ok()?
        .extend(["v1", "conversations", id])
        .extend(segments);
    url.set_query(query);
    url[url::Position::BeforePath..].parse().ok()
}

/// The live stream, read-only, as Server-Sent Events: the same frames as the WebSocket, with
/// `id:` the event id and `event:` the type; resumable with `Last-Event-ID`.
#[utoipa::path(get, path = "/conversations/{id}/stream", tag = "live stream",
    params(
        ("id" = String, Path, description = "The conversation's id or slug"),
        StreamQuery,
        ("Last-Event-ID" = Option<i64>, Header, description = "Resume after this event id (wins over after_event_id)"),
    ),
    responses(
        (status = 200, description = "An event stream: each event's `data` is a ServerFrame as JSON", content_type = "text/event-stream", body = wire::SseEvent),
        (status = 429, description = "`quota_exceeded`: the tenant has its quota of open streams", body = ErrorBody),
    ))]
pub async fn sse(
    State(app): State<AppState>,
    caller: Caller,
    credential: Credential,
    Path(id): Path<String>,
    headers: HeaderMap,
    Query(q): Query<StreamQuery>,
) -> Result<Response, ApiError> {
    let conv = app.target(&caller, &id).await?;
    let after =
        match headers.get("last-event-id").and_then(|v| v.to_str().ok()) {
            Some(value) => Some(value.trim().parse::<i64>().map_err(|_| {
                ApiError::invalid("Last-Event-ID must be an event id (an integer)")
            })?),
            None => q.after_event_id,
        };
    // Counted against the tenant's `streams` quota until the stream ends.
    let held = app.quotas.stream(&caller.0.id).await?;
    let (tx, rx) = mpsc::channel::<Out>(64);
    tokio::spawn(async move {
        let _held = held;
        let mut sink = tx;
        let followed = Followed {
            app: &app,
            id: &conv.id,
            window: app.window(&conv.fixed.model),
        };
        let Some((mut live, mut last)) = Box::pin(open(followed, after, &mut sink)).await else {
            app.hub.release(&conv.id);
            return;
        };
        let mut recheck = tokio::time::interval(app.key_recheck());
        recheck.reset();
        let close = loop {
            tokio::select! {
                () = app.shutdown.cancelled() => break Some((CLOSE_GOING_AWAY, GOING_AWAY.to_owned())),
                () = sink.closed() => break None,
                _ = recheck.tick() => {
                    if !app.key_still_valid(&credential).await {
                        break Some((CLOSE_REVOKED, REVOKED.to_owned()));
                    }
                }
                received = live.recv() => {
                    if let Err(close) = forward_ready(followed, received, &mut live, &mut last, &mut sink).await {
                        break close;
                    }
                }
            }
        };
        drop(live);
        app.hub.release(&conv.id);
        if let Some((code, reason)) = close {
            let _ = sink.send(Out::Close(code, reason)).await;
        }
    });
    let events = tokio_stream::wrappers::ReceiverStream::new(rx).map(|out| {
        let event =
            match out {
                Out::Frame(frame) => {
                    let mut event = SseEvent::default()
                        .event(frame.kind.clone())
                        .data(&*frame.json);
                    if let Some(id) = frame.event_id {
                        event = event.id(id.to_string());
                    }
                    event
                }
                Out::Close(code, reason) => SseEvent::default().event("closing").data(
                    wire::to_json(&ServerFrame::Closing {
                        code,
                        reason: &reason,
                    }),
                ),
            };
        Ok::<_, std::convert::Infallible>(event)
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}
