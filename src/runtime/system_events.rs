//! System events that clients post (system-bus-plan.md): user_request, user_response and
//! approval_response. Each is stored as a durable `system_event` frame; a user_request is
//! answered by a handler with a `user_response`, idempotent on its request_id.

use std::sync::Arc;

use serde_json::{Value, json};

use super::Handles;
use super::registry::Live;
use super::requests::emit;
use crate::notice::{Keyed, SystemEvent};

/// What the user_request handlers know.
pub const HANDLERS: [&str; 2] = ["usage", "tasks"];

/// The answer to a user_request of `kind`: the payload, or the error.
async fn handle(handles: &Handles, live: &Live, kind: &str) -> Result<Value, String> {
    // The conversation as its actor holds it now.
    let conv = &live
        .record()
        .await
        .ok_or("the conversation did not answer")?;
    match kind {
        "usage" => {
            let window = handles.settings.model(&conv.model).context_window;
            Ok(json!({
                "input_tokens": conv.usage.input_tokens,
                "output_tokens": conv.usage.output_tokens,
                "context_tokens": conv.usage.context_tokens,
                "context_window": window,
                "ratio": if window == 0 { 0.0 } else { conv.usage.context_tokens as f64 / window as f64 },
            }))
        }
        "tasks" => {
            let tasks = handles
                .store
                .background_tasks(&conv.id)
                .await
                .map_err(|e| e.to_string())?;
            Ok(handles.format.tasks(&tasks))
        }
        other => Err(format!(
            "unknown request kind {other:?}; known kinds: {}",
            HANDLERS.join(", ")
        )),
    }
}

/// Posts a client's event. Returns false when it repeats an earlier request_id (nothing new
/// is stored).
pub async fn post(
    handles: &Arc<Handles>,
    conversation_id: &str,
    event: SystemEvent,
) -> Result<bool, String> {
    let live = handles
        .registry
        .get_or_start(handles, conversation_id)
        .await
        .map_err(|e| e.to_string())?;
    let request_id = event.get("request_id").as_str().map(str::to_owned);
    let dedup = request_id
        .as_ref()
        .map(|id| format!("{}:{id}", event.event_type));
    let mut answers = Vec::new();
    if event.event_type == "user_request" {
        let kind = event.get("kind").as_str().unwrap_or_default();
        let (payload, error) = match handle(handles, &live, kind).await {
            Ok(payload) => (payload, Value::Null),
            Err(error) => (Value::Null, Value::String(error)),
        };
        answers.push(Keyed::system_event(
            SystemEvent::new(
                "user_response",
                json!({
                    "request_id": request_id,
                    "kind": kind,
                    "payload": payload,
                    "error": error,
                }),
            ),
            None,
        ));
    }
    if event.event_type == "approval_response"
        && let (Some(id), Some(approved)) = (&request_id, event.get("approved").as_bool())
    {
        // An approval answered as a system event resolves its confirm request.
        if let Err(e) = super::requests::answer_request(
            handles,
            conversation_id,
            id,
            json!({"confirmed": approved}),
        )
        .await
        {
            tracing::debug!(request = %id, error = ?e, "approval_response did not resolve a request");
        }
    }
    let mut frames = vec![Keyed::system_event(event, dedup)];
    frames.extend(answers);
    emit(&live.actor, frames).await
}
