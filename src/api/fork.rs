//! `POST /v1/conversations/{id}/fork`: a new conversation from another's history.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{SubsecRound as _, Utc};

use super::AppState;
use super::auth::Caller;
use super::error::{ApiError, Body, ErrorBody, Path};
use crate::model::{ForkPoint, NewConversation};
use crate::persistence::WriteJob;
use crate::sandbox::Network;
use crate::state_machine::{MessageContent, is_fork_point, last_fork_point};
use crate::store::StoreError;
use crate::wire::{Conversation, ForkConversation, ForkCwd};
use crate::workspace::{CopyError, WorkspaceError, copy_tree};

/// Forks a conversation: a new user-initiated conversation whose history is a copy of the
/// source's messages up to a point where no tool call is open. A busy source may be forked:
/// what is stored is copied, the running turn is not continued.
#[utoipa::path(post, path = "/conversations/{id}/fork", tag = "conversations",
    params(("id" = String, Path, description = "The source conversation's id or slug")),
    request_body = ForkConversation,
    responses(
        (status = 201, description = "The fork, with `forked_from`", body = Conversation),
        (status = 409, description = "`invalid_fork_point`: a tool call is open at `at_sequence_id`, or there is no such message", body = ErrorBody),
        (status = 409, description = "`workspace_missing`: the source's workspace directory is gone; `workspace_replaced`: a tool replaced it (or a directory above it) by a link, which is not followed (`cwd: \"copy\"`)", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: over one of the tenant's quotas (`error.quota` names it)", body = ErrorBody),
        (status = 413, description = "`payload_too_large`: the workspace is larger than `workspace.fork_max_bytes`", body = ErrorBody),
    ))]
pub async fn fork(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Body(body): Body<ForkConversation>,
) -> Result<Response, ApiError> {
    let source = app.find(&caller, &id).await?;
    let creating = app.admit_conversation(&caller.0.id).await?;
    // What is stored now; a running turn's later messages are not part of the fork.
    let stored = app.store.messages_between(&source.id, 1, i64::MAX).await?;
    let history: Vec<MessageContent> = stored.iter().map(|m| m.content.clone()).collect();
    let at = match body.at_sequence_id {
        None => last_fork_point(&history),
        Some(n) => {
            let n = usize::try_from(n).map_err(|_| {
                ApiError::invalid("at_sequence_id must be 0 or a message's sequence id")
            })?;
            if n > history.len() {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "invalid_fork_point",
                    format!(
                        "there is no message {n}: the conversation has {} (fork at 0 to {0})",
                        history.len()
                    ),
                ));
            }
            if !is_fork_point(&history, n) {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "invalid_fork_point",
                    format!(
                        "message {n} is inside an open tool call (its results follow it); fork at {} or after the results",
                        last_fork_point(&history[..n])
                    ),
                ));
            }
            n
        }
    };
    // The copy and the write run to the end even if the client goes away meanwhile: no
    // copied directory is left without its conversation.
    let mode = body.cwd.unwrap_or_default();
    tokio::spawn(async move { create(app, caller, source, at, mode, creating).await })
        .await
        .map_err(|e| ApiError::internal(format!("the fork failed: {e}")))?
}

/// Makes the fork of `source` at message `at`: its workspace, its row and copied history,
/// and its actor.
async fn create(
    app: AppState,
    caller: Caller,
    source: crate::model::ConversationRecord,
    at: usize,
    mode: ForkCwd,
    creating: crate::quotas::Held,
) -> Result<Response, ApiError> {
    let new_id = uuid::Uuid::now_v7().to_string();
    let cwd = match mode {
        ForkCwd::Share => source.cwd.clone(),
        ForkCwd::Copy => copy_workspace(&app, &caller, &source.cwd, &new_id).await?,
    };
    // Settled again as at creation: the operator may have taken the tenant's network away.
    let network = match &app.sandbox {
        Some(sandbox) => sandbox.network_for(&caller.0, source.network) == Network::On,
        None => true,
    };
    let new = NewConversation {
        id: new_id.clone(),
        tenant_id: caller.0.id.clone(),
        slug: format!("conv-{}", &new_id[new_id.len() - 12..]),
        cwd: cwd.clone(),
        model: source.model.clone(),
        system_prompt: source.system_prompt.clone(),
        parent_id: None,
        user_initiated: true,
        require_approval: source.require_approval.clone(),
        network,
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
    let from = ForkPoint {
        conversation_id: source.id.clone(),
        sequence_id: i64::try_from(at).unwrap_or(i64::MAX),
    };
    let mut record = new.record();
    record.next_sequence_id = from.sequence_id + 1;
    record.forked_from = Some(from.clone());
    let written = app
        .persistence
        .write(WriteJob::Fork {
            new,
            from,
            message_ids: (0..at).map(|_| uuid::Uuid::now_v7().to_string()).collect(),
        })
        .await;
    drop(creating);
    if let Err(error) = written {
        if cwd != source.cwd {
            let workspaces = app.workspaces.clone();
            let copy = std::path::PathBuf::from(&cwd);
            let _ = tokio::task::spawn_blocking(move || workspaces.remove(&copy)).await;
        }
        return Err(match error {
            // The source was deleted meanwhile.
            StoreError::NotFound => ApiError::not_found("conversation"),
            other @ (StoreError::Unavailable(_)
            | StoreError::Conflict(_)
            | StoreError::Corrupt(_)
            | StoreError::Other(_)) => other.into(),
        });
    }
    Ok(app.created(record).await)
}

/// Copies the source's workspace to the fork's own directory under the tenant's root.
async fn copy_workspace(
    app: &AppState,
    caller: &Caller,
    source: &str,
    new_id: &str,
) -> Result<String, ApiError> {
    let workspaces = app.workspaces.clone();
    let (source, tenant, new_id) = (
        std::path::PathBuf::from(source),
        caller.0.id.clone(),
        new_id.to_owned(),
    );
    let limit = app.settings.workspace.fork_max_bytes;
    let copied = tokio::task::spawn_blocking(move || {
        // The source is opened as a tool run opens it: through no link. One that a tool
        // replaced by a link is not followed (the copy would read another tree with the
        // server's rights).
        let from = match workspaces.pin(&source) {
            Ok(from) => from,
            Err(WorkspaceError::Missing(_)) => return Err(CopyError::SourceMissing(source)),
            Err(e @ (WorkspaceError::Replaced(_) | WorkspaceError::Outside(_))) => {
                return Err(CopyError::Refused(e.to_string()));
            }
            Err(WorkspaceError::Io { path, source }) => {
                return Err(CopyError::Io {
                    path: path.into(),
                    source,
                });
            }
        };
        let to = workspaces
            .make(&tenant, None, &new_id)
            .map_err(|e| CopyError::Io {
                path: workspaces.root().join(&tenant).join(&new_id),
                source: std::io::Error::other(e.to_string()),
            })?;
        // The tool user owns its copy, as it owns a new conversation's cwd.
        match copy_tree(&from, &to, limit, workspaces.owner()) {
            Ok(_) => Ok(to.path().to_owned()),
            Err(error) => {
                // What was made is removed, by descriptor.
                let _ = workspaces.remove(to.path());
                Err(error)
            }
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("the workspace copy failed: {e}")))?;
    match copied {
        Ok(real) => Ok(real.display().to_string()),
        Err(error @ CopyError::TooLarge { .. }) => Err(ApiError::too_large(format!(
            "{error} (workspace.fork_max_bytes); fork with cwd \"share\" to work in the same directory"
        ))),
        Err(error @ (CopyError::TooManyEntries | CopyError::TooDeep)) => Err(ApiError::too_large(
            format!("{error}; fork with cwd \"share\" to work in the same directory"),
        )),
        Err(error @ CopyError::SourceMissing(_)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "workspace_missing",
            format!("{error}: there is nothing to copy; fork with cwd \"share\""),
        )),
        Err(error @ CopyError::Refused(_)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "workspace_replaced",
            format!("{error}; fork with cwd \"share\" to keep working there"),
        )),
        Err(error) => Err(ApiError::internal(format!(
            "the workspace could not be copied: {error}"
        ))),
    }
}
