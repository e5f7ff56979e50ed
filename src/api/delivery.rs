//! Delivery into a conversation, shared by REST, the WebSocket, SSE and MCP: a user message
//! validated and handed over (`deliver`), a cancel, a client's system event, an answer to a
//! server-to-client request. Each goes through the runtime's one door into a conversation
//! ([`Live`]), so the routes share it here rather than reach into one another.

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use chrono::Utc;
use serde_json::Value;

use super::AppState;
use super::error::{ApiError, rejection};
use super::images;
use crate::model::{ConversationRecord, MessageRecord};
use crate::persistence::WriteJob;
use crate::runtime::{Accepted, CancelOutcome, Fixed, SendError, Unanswered, UserMessage};
use crate::state_machine::{IfBusy, ImageRef, TurnId};
use crate::store::NewAttachment;
use crate::wire::{self, SendMessage, SystemEvent};

/// How long the API waits for a conversation to take a message or a cancel.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A conversation a message goes to: its id and what never changes of it.
#[derive(Clone, Debug)]
pub struct Target {
    pub id: String,
    pub fixed: std::sync::Arc<Fixed>,
}

impl From<&ConversationRecord> for Target {
    fn from(conv: &ConversationRecord) -> Self {
        Target {
            id: conv.id.clone(),
            fixed: std::sync::Arc::new(Fixed::from(conv)),
        }
    }
}

/// A user message, validated; shared by REST and the WebSocket.
#[derive(Debug)]
pub struct Outgoing {
    pub text: String,
    pub images: Vec<(String, String)>,
    pub message_id: Option<String>,
    pub if_busy: wire::IfBusy,
    /// The turn that ran when the request arrived, when it was read then (`None`: read it
    /// when the message is handed over).
    pub arrived_during: Option<Option<TurnId>>,
}

impl Outgoing {
    /// With `if_busy`, and the turn running now (as the request arrives) when `id` runs.
    pub fn arriving(mut self, app: &AppState, id: &str, if_busy: wire::IfBusy) -> Outgoing {
        self.if_busy = if_busy;
        if if_busy == wire::IfBusy::Interrupt {
            self.arrived_during = app
                .conversations
                .get(id)
                .map(|live| live.cancel.running_turn());
        }
        self
    }
}

impl From<SendMessage> for Outgoing {
    fn from(body: SendMessage) -> Self {
        Outgoing {
            text: body.text,
            images: body
                .images
                .unwrap_or_default()
                .into_iter()
                .map(|i| (i.media_type, i.data))
                .collect(),
            message_id: body.message_id,
            if_busy: wire::IfBusy::Reject,
            arrived_during: None,
        }
    }
}

/// What a send came to: a new message (202) or the one stored earlier under its message_id (200).
pub enum Delivered {
    New(MessageRecord),
    Repeat(MessageRecord),
    /// It waits in the running turn (`enqueue`, `steer`): its id and place.
    Waiting {
        id: String,
        position: usize,
        steering: bool,
    },
}

/// Validates, stores images, and hands the message to the conversation; atomic with its
/// busy check (the actor decides).
pub async fn deliver(
    app: &AppState,
    conv: &Target,
    mut out: Outgoing,
) -> Result<Delivered, ApiError> {
    check_message(&app.settings.server, &out)?;
    if let Some(key) = &out.message_id {
        if key.is_empty() || key.len() > 200 {
            return Err(ApiError::invalid("message_id must be 1 to 200 characters"));
        }
        if let Some(original) = app.store.message_by_client_id(&conv.id, key).await? {
            return Ok(Delivered::Repeat(original));
        }
    }
    // Held until the conversation answered: then a started turn is counted as running.
    let _starting = app.admit_turn(&conv.fixed.tenant_id, &conv.id).await?;
    let refs = if out.images.is_empty() {
        Vec::new()
    } else {
        store_images(app, conv, std::mem::take(&mut out.images)).await?
    };
    hand_over(app, conv, &out, refs).await
}

/// What a message may not be: too long, empty, or with too many images.
fn check_message(limits: &crate::config::ServerSettings, out: &Outgoing) -> Result<(), ApiError> {
    if out.text.len() > limits.max_text_bytes {
        return Err(ApiError::too_large(format!(
            "text is {} bytes; the limit is {} bytes",
            out.text.len(),
            limits.max_text_bytes
        )));
    }
    if out.text.trim().is_empty() && out.images.is_empty() {
        return Err(ApiError::invalid("a message needs text or images"));
    }
    if out.images.len() > limits.max_images_per_message {
        return Err(ApiError::invalid(format!(
            "{} images given; at most {} per message",
            out.images.len(),
            limits.max_images_per_message
        )));
    }
    Ok(())
}

/// Decodes, checks and resizes a message's images, and stores them (through the
/// persistence actor) as the conversation's attachments.
async fn store_images(
    app: &AppState,
    conv: &Target,
    raw: Vec<(String, String)>,
) -> Result<Vec<ImageRef>, ApiError> {
    let max_px = app.settings.model(&conv.fixed.model).max_image_px;
    // At most a few images are decoded at once, whatever the number of clients: each
    // may take 128 MB and a core for a while.
    static DECODING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(4);
    let _permit = DECODING
        .acquire()
        .await
        .map_err(|e| ApiError::internal(format!("image processing failed: {e}")))?;
    let prepared = tokio::task::spawn_blocking(move || {
        raw.iter()
            .enumerate()
            .map(|(i, (media_type, data))| images::prepare(i, media_type, data, max_px))
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(|e| ApiError::internal(format!("image processing failed: {e}")))??;
    let now = Utc::now();
    let attachments: Vec<NewAttachment> = prepared
        .into_iter()
        .map(|p| NewAttachment {
            id: uuid::Uuid::now_v7().to_string(),
            tenant_id: conv.fixed.tenant_id.clone(),
            conversation_id: conv.id.clone(),
            media_type: p.media_type,
            data: p.data,
            width: p.width,
            height: p.height,
            created_at: now,
        })
        .collect();
    let refs = attachments
        .iter()
        .map(|a| ImageRef {
            id: a.id.clone(),
            media_type: a.media_type.clone(),
        })
        .collect();
    app.persistence
        .write(WriteJob::InsertAttachments(attachments))
        .await?;
    Ok(refs)
}

/// Hands a checked message to its conversation, and reads what it answered.
async fn hand_over(
    app: &AppState,
    conv: &Target,
    out: &Outgoing,
    refs: Vec<ImageRef>,
) -> Result<Delivered, ApiError> {
    // An actor that stopped just now (idle) is started again, once.
    for attempt in 0..2 {
        let live = app.live(&conv.id).await?;
        let (text, images, client_message_id) =
            (out.text.clone(), refs.clone(), out.message_id.clone());
        // The turn that ran when the request arrived: of interrupts that arrived during the
        // same turn, only the first finds it still running when the conversation takes them
        // one by one.
        let if_busy = match out.if_busy {
            wire::IfBusy::Reject => IfBusy::Reject,
            wire::IfBusy::Interrupt => IfBusy::Interrupt {
                running: out
                    .arrived_during
                    .clone()
                    .unwrap_or_else(|| live.cancel.running_turn()),
            },
            wire::IfBusy::Enqueue => IfBusy::Enqueue,
            wire::IfBusy::Steer => IfBusy::Steer,
        };
        let message = UserMessage {
            text,
            images,
            client_message_id,
            if_busy,
        };
        match live.send(message, CALL_TIMEOUT).await {
            Ok(Ok(Accepted::Stored(message))) => {
                return Ok(Delivered::New(message));
            }
            Ok(Ok(Accepted::Waiting {
                id,
                position,
                steering,
            })) => {
                return Ok(Delivered::Waiting {
                    id,
                    position,
                    steering,
                });
            }
            Ok(Err(SendError::Duplicate)) => {
                let key = out.message_id.as_deref().unwrap_or_default();
                return match app.store.message_by_client_id(&conv.id, key).await? {
                    Some(original) => Ok(Delivered::Repeat(original)),
                    None => Err(SendError::Duplicate.into()),
                };
            }
            Ok(Err(SendError::Rejected(r))) => {
                // A concurrent repeat of the same message_id, refused because its twin
                // started a turn: the twin is the answer.
                if let Some(key) = &out.message_id
                    && let Some(original) = app.store.message_by_client_id(&conv.id, key).await?
                {
                    return Ok(Delivered::Repeat(original));
                }
                return Err(rejection(r, &conv.id));
            }
            Ok(Err(e)) => return Err(e.into()),
            Err(Unanswered::Timeout) => {
                return Err(ApiError::unavailable(
                    "the conversation did not answer in time; try again",
                ));
            }
            Err(Unanswered::Stopped) if attempt == 0 => continue,
            Err(Unanswered::Stopped) => {
                return Err(ApiError::unavailable("the conversation stopped; try again"));
            }
        }
    }
    Err(ApiError::unavailable("the conversation stopped; try again"))
}

/// Cancels through the conversation's cancel path; shared by REST and the WebSocket.
pub async fn cancel_conversation(app: &AppState, id: &str) -> Result<CancelOutcome, ApiError> {
    let started = Instant::now();
    let live = app.live(id).await?;
    let answer = live.cancel_turn();
    let outcome = tokio::time::timeout(CALL_TIMEOUT, answer)
        .await
        .map_err(|_| ApiError::unavailable("the cancel was not confirmed in time; try again"))?
        .map_err(|_| {
            ApiError::unavailable("the conversation stopped while cancelling; try again")
        })?;
    app.metrics.cancel_latency(started.elapsed().as_secs_f64());
    Ok(outcome)
}

/// Event types a client may post; the others are the server's.
const CLIENT_EVENTS: [&str; 3] = ["user_request", "user_response", "approval_response"];
const SERVER_EVENTS: [&str; 5] = [
    "system_notice",
    "system_error",
    "tool_progress",
    "tool_result",
    "approval_request",
];

/// Refuses a client's system event of a type clients may not post.
pub fn check_client_event(event: &SystemEvent) -> Result<(), ApiError> {
    let event_type = event.event_type.as_str();
    if SERVER_EVENTS.contains(&event_type) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "forbidden_event_type",
            format!(
                "{event_type} events are sent by the server only; clients may post {}",
                CLIENT_EVENTS.join(", ")
            ),
        ));
    }
    if !CLIENT_EVENTS.contains(&event_type) {
        return Err(ApiError::invalid(format!(
            "unknown event type {event_type:?}; clients may post {}",
            CLIENT_EVENTS.join(", ")
        )));
    }
    Ok(())
}

/// Posts a client's system event to the conversation (system-bus-plan.md).
pub async fn post_event(app: &AppState, id: &str, event: SystemEvent) -> Result<(), ApiError> {
    app.conversations
        .post_event(id, event)
        .await
        .map(|_| ())
        .map_err(ApiError::unavailable)
}

/// Answers a pending client request.
pub async fn answer_request(
    app: &AppState,
    id: &str,
    request_id: &str,
    payload: Value,
) -> Result<(), ApiError> {
    Ok(app
        .conversations
        .answer_request(id, request_id, payload)
        .await?)
}
