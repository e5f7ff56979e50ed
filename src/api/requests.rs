//! Answers to server→client requests, over REST and the WebSocket.

use axum::http::StatusCode;
use serde_json::Value;

use super::AppState;
use super::error::ApiError;
use crate::runtime::AnswerError;

pub async fn answer(
    app: &AppState,
    conversation_id: &str,
    request_id: &str,
    payload: Value,
) -> Result<(), ApiError> {
    app.conversations
        .answer_request(conversation_id, request_id, payload)
        .await
        .map_err(|error| match error {
            AnswerError::NotFound => ApiError::not_found("request"),
            AnswerError::AlreadyAnswered => {
                ApiError::new(StatusCode::CONFLICT, "already_answered", error.to_string())
            }
            AnswerError::Expired => {
                ApiError::new(StatusCode::CONFLICT, "expired", error.to_string())
            }
            AnswerError::WrongKind(why) => {
                ApiError::invalid(format!("the reply does not fit the request: {why}"))
            }
            AnswerError::Store(store) => store.into(),
        })
}
