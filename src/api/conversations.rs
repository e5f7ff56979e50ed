//! The conversation routes of the contract.

use crate::sandbox::Network;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use serde::Deserialize;
use serde_json::{Value, json};

use super::AppState;
use super::auth::Caller;
use super::error::{ApiError, Body, Query, rejection};
use super::images;
use crate::model::{ConversationRecord, MessageRecord, NewConversation};
use crate::persistence::WriteJob;
use crate::runtime::{CancelOutcome, ConvMsg, Live, SendError};
use crate::state_machine::ImageRef;
use crate::store::{NewAttachment, StoreError};
use crate::tools::resolve_in;
use crate::wire;

/// How long the API waits for a conversation to take a message or a cancel.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

impl AppState {
    fn window(&self, model: &str) -> u64 {
        self.settings.model(model).context_window
    }

    pub(super) fn conversation_json(&self, conv: &ConversationRecord) -> Value {
        wire::conversation(conv, self.window(&conv.model))
    }

    pub(super) fn message_json(&self, conv: &ConversationRecord, message: &MessageRecord) -> Value {
        wire::message(message, self.window(&conv.model))
    }

    /// A tenant's conversation by id or slug; another tenant's is a 404 like a missing one.
    pub(super) async fn find(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<ConversationRecord, ApiError> {
        if id.is_empty() || id.len() > 200 {
            return Err(ApiError::not_found("conversation"));
        }
        self.services
            .store
            .conversation(&caller.0.id, id)
            .await?
            .ok_or_else(|| ApiError::not_found("conversation"))
    }

    pub(super) async fn live(&self, id: &str) -> Result<Live, ApiError> {
        Ok(self
            .services
            .registry
            .get_or_start(&self.services, id)
            .await?)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    cwd: Option<String>,
    model: Option<String>,
    system_prompt: Option<String>,
    slug: Option<String>,
    require_approval: Option<Vec<String>>,
    /// Network for the tool processes, where `sandbox.network` allows the tenant to ask.
    network: Option<bool>,
}

fn valid_slug(slug: &str) -> bool {
    (1..=64).contains(&slug.len())
        && slug
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Body(body): Body<CreateBody>,
) -> Result<Response, ApiError> {
    let id = uuid::Uuid::now_v7().to_string();
    let tenant_root = app.workspace_root.join(&caller.0.id);
    std::fs::create_dir_all(&tenant_root)
        .map_err(|e| ApiError::internal(format!("cannot create the tenant's workspace: {e}")))?;
    let cwd = match body.cwd.as_deref() {
        None => tenant_root.join(&id),
        Some(cwd) => resolve_in(&tenant_root, cwd).map_err(|e| {
            ApiError::invalid(format!("cwd must lie under the workspace root ({e})"))
        })?,
    };
    std::fs::create_dir_all(&cwd)
        .map_err(|e| ApiError::invalid(format!("cwd {} cannot be created: {e}", cwd.display())))?;
    // A symlink created meanwhile must not lead out either.
    let real = cwd
        .canonicalize()
        .map_err(|e| ApiError::invalid(format!("cwd cannot be resolved: {e}")))?;
    let root = tenant_root
        .canonicalize()
        .map_err(|e| ApiError::internal(e.to_string()))?;
    if !real.starts_with(&root) {
        return Err(ApiError::invalid("cwd must lie under the workspace root"));
    }
    let model = body.model.unwrap_or_else(|| app.settings.llm.model.clone());
    if model.trim().is_empty() || model.len() > 200 {
        return Err(ApiError::invalid(
            "model must be a non-empty string of at most 200 characters",
        ));
    }
    if body
        .system_prompt
        .as_ref()
        .is_some_and(|p| p.len() > app.settings.server.max_text_bytes)
    {
        return Err(ApiError::too_large(format!(
            "system_prompt is longer than {} bytes",
            app.settings.server.max_text_bytes
        )));
    }
    let slug = match body.slug {
        Some(slug) if valid_slug(&slug) => slug,
        Some(_) => {
            return Err(ApiError::invalid(
                "slug must be 1 to 64 characters of a-z, 0-9, - and _",
            ));
        }
        None => format!("conv-{}", &id[id.len() - 12..]),
    };
    let require_approval = body.require_approval.unwrap_or_default();
    if require_approval
        .iter()
        .any(|name| name.is_empty() || name.len() > 64)
        || require_approval.len() > 32
    {
        return Err(ApiError::invalid(
            "require_approval must be a list of at most 32 tool names",
        ));
    }
    // Settled at creation and stored: what the conversation's tools get from now on.
    let requested = body.network.unwrap_or(false);
    let network = match &app.services.tool_limits.sandbox {
        Some(sandbox) => sandbox.network_for(&caller.0, requested) == Network::On,
        None => true,
    };
    if requested && !network {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "network_not_allowed",
            "this tenant's tools may not use the network (sandbox.network.per_conversation_tenants)",
        ));
    }
    if let Some(sandbox) = &app.services.tool_limits.sandbox {
        sandbox.adopt(&real).map_err(|e| {
            ApiError::internal(format!("cannot give the cwd to the tool user: {e}"))
        })?;
    }
    let new = NewConversation {
        id: id.clone(),
        tenant_id: caller.0.id.clone(),
        slug,
        cwd: real.display().to_string(),
        model,
        system_prompt: body.system_prompt,
        parent_id: None,
        user_initiated: true,
        require_approval,
        network,
        created_at: Utc::now(),
    };
    match app
        .services
        .persistence
        .write(WriteJob::CreateConversation(new))
        .await
    {
        Ok(_) => {}
        Err(StoreError::Conflict(_)) => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "slug_taken",
                "another conversation already has this slug",
            ));
        }
        Err(e) => return Err(e.into()),
    }
    let conv = app.find(&caller, &id).await?;
    Ok((StatusCode::CREATED, Json(app.conversation_json(&conv))).into_response())
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    limit: Option<u64>,
    cursor: Option<String>,
    archived: Option<bool>,
}

pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let limit = q.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(ApiError::invalid("limit must be between 1 and 200"));
    }
    let page = app
        .services
        .store
        .list_conversations(
            &caller.0.id,
            q.archived.unwrap_or(false),
            limit,
            q.cursor.as_deref(),
        )
        .await?;
    Ok(Json(json!({
        "conversations": page.items.iter().map(|c| app.conversation_json(c)).collect::<Vec<_>>(),
        "next_cursor": page.next_cursor,
    })))
}

pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let conv = app.find(&caller, &id).await?;
    Ok(Json(app.conversation_json(&conv)))
}

#[derive(Debug, Deserialize)]
pub struct MessagesQuery {
    after: Option<i64>,
    limit: Option<u64>,
}

pub async fn messages(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<MessagesQuery>,
) -> Result<Json<Value>, ApiError> {
    let conv = app.find(&caller, &id).await?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::invalid("limit must be between 1 and 1000"));
    }
    let messages = app
        .services
        .store
        .messages_after(&conv.id, q.after.unwrap_or(0), limit)
        .await?;
    Ok(Json(json!({
        "messages": messages.iter().map(|m| app.message_json(&conv, m)).collect::<Vec<_>>(),
    })))
}

pub async fn children(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let conv = app.find(&caller, &id).await?;
    let children = app.services.store.children(&conv.id).await?;
    Ok(Json(json!({
        "conversations": children.iter().map(|c| app.conversation_json(c)).collect::<Vec<_>>(),
    })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageIn {
    media_type: String,
    data: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendBody {
    text: String,
    images: Option<Vec<ImageIn>>,
    message_id: Option<String>,
}

/// A user message, validated; shared by REST and the WebSocket.
#[derive(Debug)]
pub struct Outgoing {
    pub text: String,
    pub images: Vec<(String, String)>,
    pub message_id: Option<String>,
}

impl From<SendBody> for Outgoing {
    fn from(body: SendBody) -> Self {
        Outgoing {
            text: body.text,
            images: body
                .images
                .unwrap_or_default()
                .into_iter()
                .map(|i| (i.media_type, i.data))
                .collect(),
            message_id: body.message_id,
        }
    }
}

/// What a send came to: a new message (202) or the one stored earlier under its message_id (200).
pub enum Sent {
    New(MessageRecord),
    Repeat(MessageRecord),
}

/// Validates, stores images, and hands the message to the conversation; atomic with its
/// busy check (the actor decides).
pub async fn deliver(
    app: &AppState,
    conv: &ConversationRecord,
    out: Outgoing,
) -> Result<Sent, ApiError> {
    let limits = &app.settings.server;
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
    if let Some(key) = &out.message_id {
        if key.is_empty() || key.len() > 200 {
            return Err(ApiError::invalid("message_id must be 1 to 200 characters"));
        }
        if let Some(original) = app
            .services
            .store
            .message_by_client_id(&conv.id, key)
            .await?
        {
            return Ok(Sent::Repeat(original));
        }
    }
    let mut refs = Vec::new();
    if !out.images.is_empty() {
        let max_px = app.settings.model(&conv.model).max_image_px;
        let raw = out.images;
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
                tenant_id: conv.tenant_id.clone(),
                conversation_id: conv.id.clone(),
                media_type: p.media_type,
                data: p.data,
                width: p.width,
                height: p.height,
                created_at: now,
            })
            .collect();
        refs = attachments
            .iter()
            .map(|a| ImageRef {
                id: a.id.clone(),
                media_type: a.media_type.clone(),
            })
            .collect();
        app.services
            .persistence
            .write(WriteJob::InsertAttachments(attachments))
            .await?;
    }
    // An actor that stopped just now (idle) is started again, once.
    for attempt in 0..2 {
        let live = app.live(&conv.id).await?;
        let (text, images, client_message_id) =
            (out.text.clone(), refs.clone(), out.message_id.clone());
        let answer = live
            .actor
            .call(
                |reply| ConvMsg::send(text, images, client_message_id, reply),
                Some(CALL_TIMEOUT),
            )
            .await;
        match answer {
            Ok(ractor::rpc::CallResult::Success(Ok(message))) => return Ok(Sent::New(message)),
            Ok(ractor::rpc::CallResult::Success(Err(SendError::Duplicate))) => {
                let key = out.message_id.as_deref().unwrap_or_default();
                return match app
                    .services
                    .store
                    .message_by_client_id(&conv.id, key)
                    .await?
                {
                    Some(original) => Ok(Sent::Repeat(original)),
                    None => Err(SendError::Duplicate.into()),
                };
            }
            Ok(ractor::rpc::CallResult::Success(Err(SendError::Rejected(r)))) => {
                return Err(rejection(r, &conv.id));
            }
            Ok(ractor::rpc::CallResult::Success(Err(e))) => return Err(e.into()),
            Ok(ractor::rpc::CallResult::Timeout) => {
                return Err(ApiError::unavailable(
                    "the conversation did not answer in time; try again",
                ));
            }
            Ok(ractor::rpc::CallResult::SenderError) | Err(_) if attempt == 0 => continue,
            Ok(ractor::rpc::CallResult::SenderError) | Err(_) => {
                return Err(ApiError::unavailable("the conversation stopped; try again"));
            }
        }
    }
    Err(ApiError::unavailable("the conversation stopped; try again"))
}

pub async fn send(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Body(body): Body<SendBody>,
) -> Result<Response, ApiError> {
    let conv = app.find(&caller, &id).await?;
    Ok(match deliver(&app, &conv, body.into()).await? {
        Sent::New(message) => (
            StatusCode::ACCEPTED,
            Json(json!({"message": app.message_json(&conv, &message)})),
        )
            .into_response(),
        Sent::Repeat(message) => (
            StatusCode::OK,
            Json(json!({"message": app.message_json(&conv, &message)})),
        )
            .into_response(),
    })
}

/// Cancels through the conversation's cancel path; shared by REST and the WebSocket.
pub async fn cancel_conversation(
    app: &AppState,
    conv: &ConversationRecord,
) -> Result<CancelOutcome, ApiError> {
    let started = Instant::now();
    let live = app.live(&conv.id).await?;
    let answer = live.cancel.request();
    let _ = live.actor.cast(ConvMsg::Cancel);
    let outcome = tokio::time::timeout(CALL_TIMEOUT, answer)
        .await
        .map_err(|_| ApiError::unavailable("the cancel was not confirmed in time; try again"))?
        .map_err(|_| {
            ApiError::unavailable("the conversation stopped while cancelling; try again")
        })?;
    app.services
        .metrics
        .cancel_latency(started.elapsed().as_secs_f64());
    Ok(outcome)
}

pub fn cancel_json(outcome: &CancelOutcome) -> Value {
    json!({
        "state": wire::state(&outcome.state),
        "stopped": {
            "tools": outcome.stopped_tools,
            "sub_agents": outcome.stopped_sub_agents,
            "llm_request": outcome.aborted_llm,
        },
    })
}

pub async fn cancel(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let conv = app.find(&caller, &id).await?;
    let outcome = cancel_conversation(&app, &conv).await?;
    Ok((StatusCode::ACCEPTED, Json(cancel_json(&outcome))).into_response())
}

async fn set_archived(
    app: &AppState,
    caller: &Caller,
    id: &str,
    archived: bool,
) -> Result<Json<Value>, ApiError> {
    let conv = app.find(caller, id).await?;
    app.services
        .persistence
        .write(WriteJob::SetArchived {
            id: conv.id.clone(),
            archived,
            at: Utc::now(),
        })
        .await?;
    let conv = app.find(caller, &conv.id).await?;
    Ok(Json(app.conversation_json(&conv)))
}

pub async fn archive(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    set_archived(&app, &caller, &id, true).await
}

pub async fn unarchive(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    set_archived(&app, &caller, &id, false).await
}

pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let conv = app.find(&caller, &id).await?;
    // Stop its work and its actors (sub-agents included) before the rows go.
    let mut ids = vec![conv.id.clone()];
    ids.extend(
        app.services
            .store
            .children(&conv.id)
            .await?
            .into_iter()
            .map(|c| c.id),
    );
    for id in &ids {
        app.services.background.cancel_all(id);
        if let Some(live) = app.services.registry.get(id) {
            live.cancel.stop_work();
            let _ = live
                .actor
                .stop_and_wait(Some("deleted".into()), Some(Duration::from_secs(5)))
                .await;
        }
    }
    app.services
        .persistence
        .write(WriteJob::DeleteConversation {
            id: conv.id.clone(),
        })
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventBody {
    event: Value,
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

pub async fn system_event(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Body(body): Body<EventBody>,
) -> Result<Response, ApiError> {
    let conv = app.find(&caller, &id).await?;
    let event_type = check_client_event(&body.event)?;
    super::stream::post_event(&app, &conv, body.event).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"queued": true, "event_type": event_type})),
    )
        .into_response())
}

/// The type of a client's system event, or why it is refused.
pub fn check_client_event(event: &Value) -> Result<String, ApiError> {
    let Some(event_type) = event.get("type").and_then(Value::as_str) else {
        return Err(ApiError::invalid(
            "event must be an object with a string `type`",
        ));
    };
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
    Ok(event_type.to_owned())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RespondBody {
    payload: Value,
}

pub async fn respond(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, request_id)): Path<(String, String)>,
    Body(body): Body<RespondBody>,
) -> Result<Json<Value>, ApiError> {
    let conv = app.find(&caller, &id).await?;
    super::stream::answer_request(&app, &conv, &request_id, body.payload).await?;
    Ok(Json(json!({"answered": true, "request_id": request_id})))
}

pub async fn tasks(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let conv = app.find(&caller, &id).await?;
    let tasks = app.services.store.background_tasks(&conv.id).await?;
    Ok(Json(
        json!({"tasks": tasks.iter().map(wire::background_task).collect::<Vec<_>>()}),
    ))
}

/// Kills a running background task; for a finished one it answers with how it ended.
pub async fn cancel_task(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, task_id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let conv = app.find(&caller, &id).await?;
    let find = || async {
        Ok::<_, ApiError>(
            app.services
                .store
                .background_tasks(&conv.id)
                .await?
                .into_iter()
                .find(|t| t.id == task_id),
        )
    };
    let Some(mut task) = find().await? else {
        return Err(ApiError::not_found("task"));
    };
    if task.status == "running" && app.services.background.cancel(&conv.id, &task_id) {
        // The kill is immediate; its record follows within moments.
        let deadline = Instant::now() + Duration::from_secs(5);
        while task.status == "running" && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if let Some(latest) = find().await? {
                task = latest;
            }
        }
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"task": wire::background_task(&task)})),
    )
        .into_response())
}
