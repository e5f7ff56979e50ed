//! `POST /v1/conversations/{id}/continue` (docs/api.md, "Context continuation"): a new
//! conversation that starts from another's summary. An exhausted conversation has its
//! summary already. One at rest is asked for it first, and the request waits for it.

use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{SubsecRound as _, Utc};

use super::AppState;
use super::auth::Caller;
use super::error::{ApiError, ErrorBody, Path, rejection};
use crate::model::NewConversation;
use crate::persistence::WriteJob;
use crate::runtime::SendError;
use crate::state_machine::{ConvState, MessageContent};
use crate::store::StoreError;
use crate::wire::Conversation;

/// The system message a continuation starts with.
pub fn seed(from: &str, summary: &str) -> MessageContent {
    MessageContent::System {
        text: format!(
            "[[SYSTEM: This conversation continues conversation {from}, whose context filled up. Its summary follows; carry on from it.]]\n\n{summary}"
        ),
    }
}

/// Continues a conversation in a new one seeded with its summary. *Extension.*
#[utoipa::path(post, path = "/conversations/{id}/continue", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug")),
    responses(
        (status = 201, description = "The new conversation, its first message the summary", body = Conversation),
        (status = 400, description = "A sub-agent: its parent goes on, not it", body = ErrorBody),
        (status = 404, description = "No such conversation", body = ErrorBody),
        (status = 409, description = "Busy (agent_busy, cancelling), or the summary failed (summary_failed)", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: over one of the tenant's quotas (`error.quota` names it)", body = ErrorBody),
        (status = 503, description = "The database, or the summary, did not answer in time", body = ErrorBody),
    ))]
pub async fn continue_conversation(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let source = app.find(&caller, &id).await?;
    if !source.user_initiated {
        return Err(ApiError::invalid(
            "a sub-agent is not continued: its parent conversation goes on",
        ));
    }
    let creating = app.admit_conversation(&caller.0.id).await?;
    let summary = match &source.state {
        ConvState::ContextExhausted { summary } => summary.clone(),
        ConvState::Idle
        | ConvState::Error { .. }
        | ConvState::AwaitingLlm { .. }
        | ConvState::LlmRequesting { .. }
        | ConvState::ToolExecuting { .. }
        | ConvState::Cancelling { .. }
        | ConvState::AwaitingSubAgents { .. }
        | ConvState::Completed => summarize(&app, &source.id).await?,
    };
    let new_id = uuid::Uuid::now_v7().to_string();
    let new = NewConversation {
        id: new_id.clone(),
        tenant_id: caller.0.id.clone(),
        slug: format!("conv-{}", &new_id[new_id.len() - 12..]),
        // The work goes on where it was.
        cwd: source.cwd.clone(),
        model: source.model.clone(),
        system_prompt: source.system_prompt.clone(),
        parent_id: None,
        user_initiated: true,
        require_approval: source.require_approval.clone(),
        network: source.network,
        budget_tokens: source.budget_tokens,
        mcp_tools: source.mcp_tools.as_ref().clone(),
        agent: source.agent.clone(),
        tools: source.tools.clone(),
        permissions: source.permissions.clone(),
        client_tools: source.client_tools.to_vec(),
        pre_tool_use: source.pre_tool_use.as_deref().cloned(),
        bounds: source.bounds,
        created_at: Utc::now().trunc_subsecs(6),
    };
    let mut record = new.record();
    record.next_sequence_id = 2;
    record.continued_from = Some(source.id.clone());
    let written = app
        .persistence
        .write(WriteJob::Seeded {
            new,
            continued_from: Some(source.id.clone()),
            message_id: uuid::Uuid::now_v7().to_string(),
            message: seed(&source.id, &summary),
        })
        .await;
    drop(creating);
    written.map_err(|error| match error {
        StoreError::NotFound => ApiError::not_found("conversation"),
        other @ (StoreError::Unavailable(_)
        | StoreError::Conflict(_)
        | StoreError::Corrupt(_)
        | StoreError::Other(_)) => other.into(),
    })?;
    Ok(app.created(record).await)
}

/// Asks the conversation (at rest) for its summary and waits for it.
async fn summarize(app: &AppState, id: &str) -> Result<String, ApiError> {
    let live = app.conversations.get_or_start(id).await?;
    // Subscribed before asking: its state frames say when to look again.
    let mut frames = app.hub.subscribe(id);
    let summary = ask_and_wait(app, &live, id, &mut frames).await;
    drop(frames);
    app.hub.release(id);
    summary
}

async fn ask_and_wait(
    app: &AppState,
    live: &crate::runtime::Live,
    id: &str,
    frames: &mut crate::hub::Subscription,
) -> Result<String, ApiError> {
    match live.summarize(Duration::from_secs(30)).await {
        Ok(Ok(())) => {}
        // Summarised meanwhile: read it below.
        Ok(Err(SendError::Rejected(crate::state_machine::Rejection::ContextExhausted))) => {}
        Ok(Err(SendError::Rejected(r))) => {
            return Err(rejection(r, id));
        }
        Ok(Err(other)) => return Err(other.into()),
        Err(_) => {
            return Err(ApiError::unavailable(
                "the conversation did not answer; try again shortly",
            ));
        }
    }
    // The summary is one LLM step: its retries included, within three total timeouts.
    let llm = &app.settings.llm;
    let deadline = Instant::now() + Duration::from_millis(llm.total_timeout_ms.saturating_mul(3));
    loop {
        let Some(record) = live.record().await else {
            return Err(ApiError::unavailable(
                "the conversation stopped while summarising; try again",
            ));
        };
        match record.state {
            ConvState::ContextExhausted { summary } => return Ok(summary),
            ConvState::Error { message, .. } => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "summary_failed",
                    format!("the summary could not be made: {message}"),
                ));
            }
            ConvState::Idle | ConvState::Completed => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "summary_failed",
                    "the summary was not made (the turn was cancelled or interrupted)",
                ));
            }
            ConvState::AwaitingLlm { .. }
            | ConvState::LlmRequesting { .. }
            | ConvState::ToolExecuting { .. }
            | ConvState::Cancelling { .. }
            | ConvState::AwaitingSubAgents { .. } => {}
        }
        if Instant::now() > deadline {
            return Err(ApiError::unavailable(
                "the summary did not come in time; the conversation is still asking for it, so try again later",
            ));
        }
        // Looked at again when its state changes, or after a second should a frame be lost.
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            loop {
                match frames.recv().await {
                    Ok(frame) if frame.kind == "state" => return,
                    Ok(_) => {}
                    Err(_) => std::future::pending::<()>().await,
                }
            }
        })
        .await;
    }
}
