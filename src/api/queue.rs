//! Messages that wait in a busy conversation (docs/api.md, "Queued and steering messages";
//! issue 39): listed, and taken back one by one or all at once. They are sent with
//! `if_busy=enqueue` or `steer` (src/api/delivery.rs); the core keeps them in the running
//! turn's state, so they are stored with it and survive a restart.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse as _, Response};

use super::AppState;
use super::auth::Caller;
use super::error::{ApiError, ErrorBody, Path, reply};
use crate::wire::{QueueList, QueuedView};

const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The messages that wait in a conversation, in the order they go in. *Extension.*
#[utoipa::path(get, path = "/conversations/{id}/queue", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug")),
    responses((status = 200, description = "Its waiting messages: steering ones, then queued ones", body = QueueList)))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let conv = app.target(&caller, &id).await?;
    let record = app
        .current(&conv.id)
        .await?
        .ok_or_else(|| ApiError::not_found("conversation"))?;
    let queued = record
        .state
        .turn()
        .map(|turn| {
            let steering = turn.steering.iter().map(|m| (m, "steer"));
            let queued = turn.queued.iter().map(|m| (m, "enqueue"));
            steering
                .chain(queued)
                .map(|(message, kind)| QueuedView {
                    queued_id: &message.id.0,
                    kind,
                    text: &message.text,
                    images: message.images.len(),
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(reply(StatusCode::OK, &QueueList { queued }))
}

/// Takes back a waiting message of the caller's conversation `id` (`None`: every one).
pub(super) async fn take_back(
    app: &AppState,
    caller: &Caller,
    id: &str,
    queued: Option<String>,
) -> Result<bool, ApiError> {
    let conv = app.target(caller, id).await?;
    app.owned_here(&conv.id).await?;
    // A conversation where nothing waits is not started to say so.
    let waiting = app
        .current(&conv.id)
        .await?
        .and_then(|record| record.state.turn().map(|turn| turn.waiting()))
        .unwrap_or(0);
    if waiting == 0 {
        return Ok(false);
    }
    let live = app.live(&conv.id).await?;
    live.dequeue(queued, CALL_TIMEOUT)
        .await
        .map_err(|_| ApiError::unavailable("the conversation did not answer; try again"))
}

/// Takes back one waiting message. *Extension.*
#[utoipa::path(delete, path = "/conversations/{id}/queue/{queued_id}", tag = "conversations",
    params(
        ("id" = String, Path, description = "The conversation's id or slug"),
        ("queued_id" = String, Path, description = "The message's `queued_id`"),
    ),
    responses(
        (status = 204, description = "Taken back: it will not be stored"),
        (status = 404, description = "No such message waits (it started, or was taken back)", body = ErrorBody),
    ))]
pub async fn take_one(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, queued_id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    if queued_id.is_empty() || queued_id.len() > 64 {
        return Err(ApiError::not_found("waiting message"));
    }
    if take_back(&app, &caller, &id, Some(queued_id)).await? {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::not_found("waiting message"))
    }
}

/// Takes back every waiting message. *Extension.*
#[utoipa::path(delete, path = "/conversations/{id}/queue", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug")),
    responses((status = 204, description = "None waits now")))]
pub async fn take_all(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    take_back(&app, &caller, &id, None).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
