//! The contract's error shape: `{"error": {"code", "message"}}`, one status per code, decided
//! here and nowhere else.

use axum::Json;
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use crate::wire::ErrorBody;
use crate::wire::ErrorDetail;

use crate::runtime::{AnswerError, SendError, StartError};
use crate::state_machine::Rejection;
use crate::store::StoreError;

/// Every non-2xx reply of the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// The base URL of the node that owns the conversation: the request goes there (see
    /// `api::cluster`); this error is the answer only when it cannot.
    pub forward: Option<std::sync::Arc<str>>,
    /// Sent as `Retry-After` (seconds).
    pub retry_after_secs: Option<u64>,
    /// With `quota_exceeded`: the quota and its limit.
    pub quota: Option<crate::wire::QuotaDetail>,
}

/// A response's note that its request belongs to another node (`api::cluster` carries it).
#[derive(Clone, Debug)]
pub struct Forward(pub std::sync::Arc<str>);

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            forward: None,
            retry_after_secs: None,
            quota: None,
        }
    }

    /// Over a key's request rate: 429 `rate_limited`, to be tried again in `secs`.
    pub fn rate_limited(secs: u64) -> Self {
        let mut error = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            format!("too many requests for this API key; try again in {secs} s"),
        );
        error.retry_after_secs = Some(secs);
        error
    }

    /// The conversation is owned by the node at `advertise`.
    pub fn elsewhere(node: &str, advertise: &str) -> Self {
        let mut error = Self::unavailable(format!(
            "the conversation runs on node {node:?}, which did not answer; try again shortly"
        ));
        error.forward = Some(advertise.into());
        error
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    /// A conditional write's answer as a route's: 204 when it found its row, else 404
    /// naming `what` (deletes of a tenant's resources).
    pub fn removed(
        outcome: crate::persistence::WriteOutcome,
        what: &str,
    ) -> Result<Response, ApiError> {
        if outcome == crate::persistence::WriteOutcome::Resolved(true) {
            Ok(IntoResponse::into_response(StatusCode::NO_CONTENT))
        } else {
            Err(ApiError::not_found(what))
        }
    }

    pub fn not_found(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{what} not found"),
        )
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }

    /// The body did not arrive within `server.body_read_timeout_ms`.
    pub fn request_timeout() -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "the request body did not arrive in time (server.body_read_timeout_ms)",
        )
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: &self.message,
                quota: self.quota,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = reply(self.status, &self.body());
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, secs.into());
        }
        if let Some(to) = self.forward {
            response.extensions_mut().insert(Forward(to));
        }
        response
    }
}

/// A JSON reply with this status.
pub fn reply(status: StatusCode, body: &impl Serialize) -> Response {
    (status, Json(body)).into_response()
}

/// Over a tenant's quota: 429 `quota_exceeded` naming it, with Retry-After where it frees up
/// by itself.
impl From<crate::quotas::Exceeded> for ApiError {
    fn from(exceeded: crate::quotas::Exceeded) -> Self {
        let mut error = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "quota_exceeded",
            exceeded.to_string(),
        );
        error.retry_after_secs = exceeded.retry_after_secs;
        error.quota = Some(crate::wire::QuotaDetail {
            name: exceeded.quota.name(),
            limit: exceeded.limit,
        });
        error
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Unavailable(why) => ApiError::unavailable(format!(
                "the database is unavailable; try again shortly ({why})"
            )),
            StoreError::NotFound => ApiError::not_found("resource"),
            StoreError::Conflict(why) => ApiError::new(StatusCode::CONFLICT, "conflict", why),
            StoreError::Corrupt(why) | StoreError::Other(why) => {
                tracing::error!(%why, "store error");
                ApiError::internal("the server failed to read or write its database")
            }
        }
    }
}

impl From<AnswerError> for ApiError {
    fn from(error: AnswerError) -> Self {
        match error {
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
        }
    }
}

impl From<StartError> for ApiError {
    fn from(error: StartError) -> Self {
        match error {
            StartError::NotFound => ApiError::not_found("conversation"),
            StartError::Elsewhere(owner) => ApiError::elsewhere(&owner.node, &owner.advertise),
            StartError::Store(store) => store.into(),
            StartError::Spawn(why) => ApiError::unavailable(why),
        }
    }
}

/// The refusal of a user message, as the contract names it.
pub fn rejection(rejection: Rejection, conversation_id: &str) -> ApiError {
    match rejection {
        Rejection::AgentBusy => ApiError::new(
            StatusCode::CONFLICT,
            "agent_busy",
            format!(
                "the agent is busy with the current turn; cancel it with POST /v1/conversations/{conversation_id}/cancel to send a new message, or send it with ?if_busy=interrupt"
            ),
        ),
        Rejection::Cancelling => ApiError::new(
            StatusCode::CONFLICT,
            "cancelling",
            "a cancellation is in progress; send again once the conversation is idle",
        ),
        Rejection::Completed => ApiError::new(
            StatusCode::CONFLICT,
            "conversation_completed",
            "this sub-agent has completed and takes no more messages",
        ),
        Rejection::ContextExhausted => ApiError::new(
            StatusCode::CONFLICT,
            "context_exhausted",
            format!(
                "this conversation's context is full and it has been summarised; continue it with POST /v1/conversations/{conversation_id}/continue, which starts a new conversation from the summary"
            ),
        ),
        Rejection::QueueFull => ApiError::new(
            StatusCode::CONFLICT,
            "queue_full",
            "as many messages wait in this conversation as may (turn.max_queued); send again once one has started, or take one back (DELETE /v1/conversations/{id}/queue/{queued_id})",
        ),
    }
}

impl From<SendError> for ApiError {
    fn from(error: SendError) -> Self {
        match error {
            SendError::Rejected(r) => rejection(r, "{id}"),
            SendError::Unavailable(why) => ApiError::unavailable(why),
            SendError::ShuttingDown => {
                ApiError::unavailable("the server is shutting down; try again shortly")
            }
            SendError::Duplicate => ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                "a message with this message_id is already stored",
            ),
        }
    }
}

/// A JSON body: malformed JSON or a missing field is a 400 `invalid_request` naming the
/// problem, an oversized body a 413, a body that does not arrive within
/// `server.body_read_timeout_ms` a 408. A body needs a JSON content type (`application/json`
/// or `application/*+json`, else 415), so that a web page cannot send one as a cross-site
/// "simple" request; an empty body (every field optional) needs none.
#[derive(Debug, Clone)]
pub struct Body<T>(pub T);

/// Whether a `Content-Type` is JSON: `application/json` or `application/<x>+json`, with any
/// parameters.
pub fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|sub| sub.ends_with("+json"))
}

fn not_json() -> ApiError {
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
        "the request body must be JSON, sent with Content-Type: application/json",
    )
}

/// The answer to a body that could not be read.
pub fn unreadable(error: &BytesRejection) -> ApiError {
    if error.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::too_large("the request body is larger than the server accepts");
    }
    if crate::server::timed_out(error) {
        return ApiError::request_timeout();
    }
    ApiError::invalid(format!("the request body could not be read: {error}"))
}

impl<S, T> FromRequest<S> for Body<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let headers = req.headers();
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_json);
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        if !json && declared.is_some_and(|length| length > 0) {
            return Err(not_json());
        }
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e: BytesRejection| unreadable(&e))?;
        if bytes.is_empty() {
            return serde_json::from_slice(b"{}")
                .map(Body)
                .map_err(|e| ApiError::invalid(format!("a JSON body is required: {e}")));
        }
        if !json {
            return Err(not_json());
        }
        // Every body of the API is an object; serde would also read a struct from an array
        // of its fields in order (found by schemathesis: `[null, null]` made a fork).
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ApiError::invalid("the body must be a JSON object"));
        }
        serde_json::from_slice(&bytes).map(Body).map_err(|e| {
            ApiError::invalid(format!("the body is not valid JSON for this route: {e}"))
        })
    }
}

/// Path parameters; one that cannot be read (bytes that are not UTF-8, say) is a 400
/// `invalid_request`.
#[derive(Debug, Clone)]
pub struct Path<T>(pub T);

impl<S, T> FromRequestParts<S> for Path<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Send,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Path(p.0))
            .map_err(|e: PathRejection| {
                ApiError::invalid(format!("invalid path: {}", e.body_text()))
            })
    }
}

/// Query parameters; a malformed one is a 400 `invalid_request`.
#[derive(Debug, Clone)]
pub struct Query<T>(pub T);

impl<S, T> FromRequestParts<S> for Query<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| Query(q.0))
            .map_err(|e: QueryRejection| {
                ApiError::invalid(format!("invalid query parameters: {}", e.body_text()))
            })
    }
}
