//! Requests from the server to the client while a tool runs (bidirectional-streaming.md):
//! confirm, prompt, select and custom, each with a timeout.
//!
//! The row in `client_requests` is the truth: a request is resolved once, by a conditional
//! update from `pending`, whether by an answer, its timeout, a cancel or a restart. The
//! broker only wakes the tool that waits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use ractor::ActorRef;
use serde_json::Value;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::Handles;
use super::messages::ConvMsg;
use crate::model::{ClientRequest, RequestStatus};
use crate::notice::{Durable, Keyed, RequestType};
use crate::persistence::{WriteJob, WriteOutcome};

/// How a request ended for the tool that asked.
#[derive(Clone, Debug, PartialEq)]
pub enum Asked {
    /// The client's reply payload.
    Answered(Value),
    TimedOut,
    Cancelled,
    /// The request could not be made (the database is down, say).
    Failed(String),
}

/// The kinds of request, by the key of their `request_type` object.
pub const KINDS: [&str; 4] = ["confirm", "prompt", "select", "custom"];

/// The kind of a `request_type` object, if it is one.
pub fn kind_of(request_type: &Value) -> Option<&'static str> {
    let object = request_type.as_object()?;
    if object.len() != 1 {
        return None;
    }
    KINDS.iter().copied().find(|k| object.contains_key(*k))
}

/// Whether `payload` is a reply of the right kind for `request_type`.
pub fn check_reply(request_type: &Value, payload: &Value) -> Result<(), String> {
    let kind = kind_of(request_type).ok_or("the request is malformed")?;
    let object = payload
        .as_object()
        .filter(|o| o.len() == 1)
        .ok_or("the payload must be one of {\"confirmed\": bool}, {\"text\": s}, {\"selected\": [values]}, {\"custom\": any}, {\"cancelled\": true}")?;
    if object.get("cancelled") == Some(&Value::Bool(true)) {
        return Ok(());
    }
    match kind {
        "confirm" => payload
            .get("confirmed")
            .and_then(Value::as_bool)
            .map(|_| ())
            .ok_or_else(|| "a confirm request takes {\"confirmed\": true|false}".to_owned()),
        "prompt" => payload
            .get("text")
            .and_then(Value::as_str)
            .map(|_| ())
            .ok_or_else(|| "a prompt request takes {\"text\": \"...\"}".to_owned()),
        "select" => {
            let selected = payload
                .get("selected")
                .and_then(Value::as_array)
                .ok_or("a select request takes {\"selected\": [values]}")?;
            let select = &request_type["select"];
            let options: Vec<&str> = select["options"]
                .as_array()
                .map(|o| o.iter().filter_map(|o| o["value"].as_str()).collect())
                .unwrap_or_default();
            if selected.is_empty() {
                return Err("select at least one option".into());
            }
            if selected.len() > 1 && select["multi_select"] != Value::Bool(true) {
                return Err("this select takes one option".into());
            }
            for value in selected {
                match value.as_str() {
                    Some(v) if options.contains(&v) => {}
                    _ => return Err(format!("{value} is not one of the options {options:?}")),
                }
            }
            Ok(())
        }
        "custom" => payload
            .get("custom")
            .map(|_| ())
            .ok_or_else(|| "a custom request takes {\"custom\": ...}".to_owned()),
        _ => Err("unknown request kind".into()),
    }
}

#[derive(Debug, Default)]
pub struct RequestBroker {
    /// Each waiter with the number of its wait: a wait that ends removes only its own.
    waiting: Mutex<HashMap<String, (u64, oneshot::Sender<Value>)>>,
    waits: std::sync::atomic::AtomicU64,
}

/// Removes a waiter when the asking future ends, however it ends (and not one that took
/// its place since).
pub(crate) struct Waiter<'a> {
    broker: &'a RequestBroker,
    id: String,
    wait: u64,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        let mut map = self.broker.map();
        if map
            .get(&self.id)
            .is_some_and(|(wait, _)| *wait == self.wait)
        {
            map.remove(&self.id);
        }
    }
}

impl RequestBroker {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u64, oneshot::Sender<Value>)>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for `id`'s answer from now on: the receiver gets what [`deliver`](Self::deliver)
    /// hands over; dropping the guard stops the wait.
    pub(crate) fn wait_for(&self, id: &str) -> (oneshot::Receiver<Value>, Waiter<'_>) {
        let (tx, rx) = oneshot::channel();
        let wait = self
            .waits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.map().insert(id.to_owned(), (wait, tx));
        (
            rx,
            Waiter {
                broker: self,
                id: id.to_owned(),
                wait,
            },
        )
    }

    /// Wakes the tool waiting for `id` with the client's reply.
    pub fn deliver(&self, id: &str, payload: Value) {
        if let Some((_, waiter)) = self.map().remove(id) {
            let _ = waiter.send(payload);
        }
    }

    /// Asks the conversation's clients and waits for the answer, the timeout or a cancel.
    /// `extra_frames` builds, from the request's id, frames stored with the request's own (an
    /// approval's system event, say).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn ask(
        &self,
        handles: &Arc<Handles>,
        tenant_id: &str,
        conversation_id: &str,
        conversation: &ActorRef<ConvMsg>,
        tool_use_id: Option<String>,
        request_type: RequestType,
        timeout: Duration,
        cancel: &CancellationToken,
        extra_frames: impl FnOnce(&str) -> Vec<Keyed>,
    ) -> (String, Asked) {
        let id = uuid::Uuid::now_v7().to_string();
        let now = Utc::now();
        // Whoever chose it (a model may ask for any), a request waits at most this long.
        let timeout = timeout.min(handles.settings.requests.max_timeout());
        let (timeout_ms, expires_at) = expiry(now, timeout);
        // The tenant's webhooks are told in the request's own transaction.
        let deliveries = if handles.webhooks.has(tenant_id) {
            let kind = match &request_type {
                RequestType::Confirm { .. } => "confirm",
                RequestType::Prompt { .. } => "prompt",
                RequestType::Select { .. } => "select",
                RequestType::Custom { .. } => "custom",
            };
            handles
                .webhooks
                .deliveries(vec![crate::webhooks::request_created(
                    tenant_id,
                    conversation_id,
                    &id,
                    kind,
                    tool_use_id.as_deref().unwrap_or_default(),
                    now,
                )])
        } else {
            Vec::new()
        };
        let request = ClientRequest {
            id: id.clone(),
            conversation_id: conversation_id.to_owned(),
            tool_use_id: tool_use_id.clone(),
            request_type: serde_json::to_value(&request_type).unwrap_or(Value::Null),
            status: RequestStatus::Pending,
            response: None,
            timeout_ms,
            expires_at,
            created_at: now,
        };
        if let Err(e) = handles
            .persistence
            .write(WriteJob::CreateClientRequest(request, deliveries.clone()))
            .await
        {
            handles.webhooks.not_stored(&deliveries);
            return (
                id,
                Asked::Failed(format!("the request could not be stored: {e}")),
            );
        }
        handles.webhooks.stored(&deliveries);
        let (rx, _waiter) = self.wait_for(&id);
        let mut frames = vec![Keyed::from(Durable::ClientRequest {
            request_id: id.clone(),
            request_type,
            timeout_ms,
            tool_use_id,
        })];
        frames.extend(extra_frames(&id));
        if let Err(e) = emit(conversation, frames).await {
            self.resolve(handles, &id, RequestStatus::Expired).await;
            return (id, Asked::Failed(e));
        }
        let asked = tokio::select! {
            answer = rx => match answer {
                Ok(payload) => Asked::Answered(payload),
                Err(_) => Asked::Failed("the request was dropped".into()),
            },
            () = tokio::time::sleep(timeout) => {
                // An answer may have won the race: only the first resolution counts.
                if self.resolve(handles, &id, RequestStatus::Expired).await {
                    Asked::TimedOut
                } else {
                    self.stored_answer(handles, conversation_id, &id).await
                }
            }
            () = cancel.cancelled() => {
                if self.resolve(handles, &id, RequestStatus::Cancelled).await {
                    Asked::Cancelled
                } else {
                    self.stored_answer(handles, conversation_id, &id).await
                }
            }
        };
        if matches!(asked, Asked::TimedOut | Asked::Cancelled) {
            let status = if matches!(asked, Asked::TimedOut) {
                RequestStatus::Expired
            } else {
                RequestStatus::Cancelled
            };
            let _ = emit(
                conversation,
                vec![Keyed::from(Durable::ClientRequestResolved {
                    request_id: id.clone(),
                    status,
                })],
            )
            .await;
        }
        (id, asked)
    }

    async fn resolve(&self, handles: &Handles, id: &str, status: RequestStatus) -> bool {
        matches!(
            handles
                .persistence
                .write(WriteJob::ResolveClientRequest {
                    id: id.to_owned(),
                    status,
                    response: None,
                    at: Utc::now(),
                })
                .await,
            Ok(WriteOutcome::Resolved(true))
        )
    }

    async fn stored_answer(&self, handles: &Handles, conversation_id: &str, id: &str) -> Asked {
        match handles.store.client_request(conversation_id, id).await {
            Ok(Some(row)) if row.status == RequestStatus::Answered => {
                row.response.map_or(Asked::Cancelled, Asked::Answered)
            }
            Ok(Some(row)) if row.status == RequestStatus::Expired => Asked::TimedOut,
            _ => Asked::Cancelled,
        }
    }
}

/// A request's `timeout_ms` and when it expires, asked at `now` with `timeout`. Callers cut a
/// timeout to `requests.max_timeout_ms`; this never panics whatever it is given (chrono's
/// `Duration::milliseconds` does past some 292 million years): the time is saturated at
/// the latest date chrono has.
pub fn expiry(now: chrono::DateTime<Utc>, timeout: Duration) -> (i64, chrono::DateTime<Utc>) {
    let timeout_ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
    let expires_at = chrono::TimeDelta::try_milliseconds(timeout_ms)
        .and_then(|delta| now.checked_add_signed(delta))
        .unwrap_or(chrono::DateTime::<Utc>::MAX_UTC);
    (timeout_ms, expires_at)
}

/// Stores durable frames through the conversation actor, which owns the event ids.
pub async fn emit(conversation: &ActorRef<ConvMsg>, frames: Vec<Keyed>) -> Result<bool, String> {
    let (reply, stored) = oneshot::channel();
    conversation
        .cast(ConvMsg::emit(frames, reply))
        .map_err(|e| format!("the conversation did not take the frames: {e}"))?;
    match tokio::time::timeout(Duration::from_secs(30), stored).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => Err("the conversation stopped before storing the frames".to_owned()),
        Err(_) => Err("the conversation did not store the frames in time".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn replies_must_match_their_request() {
        let confirm = json!({"confirm": {"message": "ok?", "default": false}});
        assert!(check_reply(&confirm, &json!({"confirmed": true})).is_ok());
        assert!(check_reply(&confirm, &json!({"cancelled": true})).is_ok());
        assert!(check_reply(&confirm, &json!({"text": "yes"})).is_err());
        let select = json!({"select": {"message": "pick", "options": [{"value": "a", "label": "A"}, {"value": "b", "label": "B"}], "multi_select": false}});
        assert!(check_reply(&select, &json!({"selected": ["a"]})).is_ok());
        assert!(check_reply(&select, &json!({"selected": ["a", "b"]})).is_err());
        assert!(check_reply(&select, &json!({"selected": ["z"]})).is_err());
        let prompt = json!({"prompt": {"message": "name?"}});
        assert!(check_reply(&prompt, &json!({"text": "x"})).is_ok());
        assert!(check_reply(&prompt, &json!({"text": 3})).is_err());
        assert!(
            check_reply(
                &json!({"custom": {"type_name": "t"}}),
                &json!({"custom": {"any": 1}})
            )
            .is_ok()
        );
        assert_eq!(kind_of(&json!({"nope": {}})), None);
    }

    /// A timeout no caller should pass (a model's `ask_user` timeout_ms of 9e15 ms crashed
    /// chrono) gives the latest date rather than a panic; a sane one is exact.
    #[test]
    fn a_huge_timeout_does_not_panic() {
        let now = Utc::now();
        for ms in [9_000_000_000_000_000_u64, u64::MAX] {
            let (timeout_ms, at) = expiry(now, Duration::from_millis(ms));
            assert!(timeout_ms > 0);
            assert!(at > now);
        }
        let (_, at) = expiry(now, Duration::MAX);
        assert_eq!(at, chrono::DateTime::<Utc>::MAX_UTC);
        let (timeout_ms, at) = expiry(now, Duration::from_millis(1500));
        assert_eq!(timeout_ms, 1500);
        assert_eq!(at - now, chrono::TimeDelta::milliseconds(1500));
    }
}

/// Why an answer was refused.
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    #[error("no such request")]
    NotFound,
    #[error("the request was already answered")]
    AlreadyAnswered,
    #[error("the request expired (or was cancelled) before this answer")]
    Expired,
    #[error("{0}")]
    WrongKind(String),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

/// Answers a pending request once; a second answer, or one after the timeout, is refused.
pub async fn answer_request(
    handles: &Handles,
    conversation_id: &str,
    request_id: &str,
    payload: Value,
) -> Result<(), AnswerError> {
    let row = handles
        .store
        .client_request(conversation_id, request_id)
        .await?
        .ok_or(AnswerError::NotFound)?;
    match row.status {
        RequestStatus::Pending => {}
        RequestStatus::Answered => return Err(AnswerError::AlreadyAnswered),
        RequestStatus::Expired | RequestStatus::Cancelled => return Err(AnswerError::Expired),
    }
    if row.expires_at <= Utc::now() {
        handles
            .requests
            .resolve(handles, request_id, RequestStatus::Expired)
            .await;
        return Err(AnswerError::Expired);
    }
    check_reply(&row.request_type, &payload).map_err(AnswerError::WrongKind)?;
    let outcome = handles
        .persistence
        .write(WriteJob::ResolveClientRequest {
            id: request_id.to_owned(),
            status: RequestStatus::Answered,
            response: Some(payload.clone()),
            at: Utc::now(),
        })
        .await?;
    if outcome != WriteOutcome::Resolved(true) {
        // Someone else resolved it first.
        return match handles
            .store
            .client_request(conversation_id, request_id)
            .await?
        {
            Some(row) if row.status == RequestStatus::Answered => Err(AnswerError::AlreadyAnswered),
            _ => Err(AnswerError::Expired),
        };
    }
    handles.requests.deliver(request_id, payload);
    if let Some(live) = handles.registry.get(conversation_id) {
        let frame = Keyed::from(Durable::ClientRequestResolved {
            request_id: request_id.to_owned(),
            status: RequestStatus::Answered,
        });
        let _ = emit(&live.actor, vec![frame]).await;
    }
    Ok(())
}
