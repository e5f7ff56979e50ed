//! The conversation routes of the contract.

use crate::sandbox::Network;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse as _, Response};
use chrono::{SubsecRound as _, Utc};

use super::AppState;
use super::auth::Caller;
use super::delivery::{
    Delivered, Outgoing, Target, answer_request, cancel_conversation, check_client_event, deliver,
    post_event,
};
use super::error::{ApiError, Body, ErrorBody, Path, Query, reply};
use crate::model::{
    AgentRef, AgentVersion, ConversationRecord, MessageRecord, NewConversation, TaskStatus,
};
use crate::persistence::WriteJob;
use crate::quotas::{Held, Quota};
use crate::runtime::Live;
use crate::state_machine::PermissionRule;
use crate::store::StoreError;
use crate::wire::{
    self, Answered, CancelQuery, Cancelled, Conversation, ConversationList, ConversationPage,
    CreateConversation, ListQuery, MessageList, MessagesQuery, PostEvent, Queued, Respond,
    SendMessage, SendQuery, SendReply, Sent, Stopped, TaskList, TaskReply,
};
use crate::workspace::WorkspaceError;

impl AppState {
    pub(super) fn window(&self, model: &str) -> u64 {
        self.settings.model(model).context_window
    }

    /// 201 with a conversation just written (created, forked, continued). It is about to be
    /// used: its actor starts from that row, so the first connection and message find it
    /// running.
    pub(super) async fn created(&self, conv: ConversationRecord) -> Response {
        let created = reply(StatusCode::CREATED, &self.conversation_json(&conv));
        if let Err(e) = self.conversations.start_created(conv).await {
            tracing::warn!(error = %e, "a new conversation's actor did not start; it starts on first use");
        }
        created
    }

    /// Room for one more conversation of the tenant: its `conversations` quota, and its
    /// `workspace_bytes` (a new conversation writes there). The room is held until the
    /// returned value is dropped: drop it once the conversation is written.
    pub(super) async fn admit_conversation(&self, tenant_id: &str) -> Result<Held, ApiError> {
        let quotas = &self.quotas;
        let store = &self.store;
        let creating = quotas
            .conversation(tenant_id, || store.conversation_count(tenant_id))
            .await??;
        if let Some(bytes) = self.quotas.workspace_bytes(tenant_id).await {
            quotas
                .check(tenant_id, Quota::WorkspaceBytes, bytes)
                .await?;
        }
        Ok(creating)
    }

    /// Room for one more running turn of the tenant on this node (`concurrent_turns`): the
    /// top-level conversations other than `id` that run a turn now, and the turns admitted
    /// and not yet taken by their conversation. Held until the returned value is dropped:
    /// drop it once the conversation answered the message.
    pub(super) async fn admit_turn(&self, tenant_id: &str, id: &str) -> Result<Held, ApiError> {
        let registry = &self.conversations;
        Ok(self
            .quotas
            .turn(
                tenant_id,
                || registry.count() as u64,
                || registry.running_turns(tenant_id, Some(id)),
            )
            .await?)
    }

    pub(super) fn conversation_json<'a>(&self, conv: &'a ConversationRecord) -> Conversation<'a> {
        wire::conversation(conv, self.window(&conv.model))
    }

    pub(super) fn message_json<'a>(
        &self,
        conv: &ConversationRecord,
        message: &'a MessageRecord,
    ) -> wire::Message<'a> {
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
        self.store
            .conversation(&caller.0.id, id)
            .await?
            .ok_or_else(|| ApiError::not_found("conversation"))
    }

    /// A conversation to act on: from its running actor when it runs (no database read on
    /// the hot path), else from its row.
    pub(super) async fn target(&self, caller: &Caller, id: &str) -> Result<Target, ApiError> {
        match self.running_target(caller, id) {
            Some(target) => Ok(target),
            None => Ok(Target::from(&self.find(caller, id).await?)),
        }
    }

    /// The caller's conversation `id`, when its actor runs.
    fn running_target(&self, caller: &Caller, id: &str) -> Option<Target> {
        let live = self.conversations.get(id)?;
        (live.fixed.tenant_id == caller.0.id).then(|| Target {
            id: id.to_owned(),
            fixed: live.fixed.clone(),
        })
    }

    /// A conversation to send to: [`target`](Self::target), and its actor started from the
    /// row just read when it was not running.
    pub(super) async fn sending_target(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<Target, ApiError> {
        if let Some(target) = self.running_target(caller, id) {
            return Ok(target);
        }
        let conv = self.find(caller, id).await?;
        let target = Target::from(&conv);
        self.conversations.start_from(conv).await?;
        Ok(target)
    }

    /// The conversation as stored now: its actor's record when it runs, else its row.
    pub(super) async fn current(&self, id: &str) -> Result<Option<ConversationRecord>, ApiError> {
        if let Some(live) = self.conversations.get(id)
            && let Some(record) = live.record().await
        {
            return Ok(Some(record));
        }
        Ok(self.store.conversation_by_id(id).await?)
    }

    /// On a cluster, refuses (to be carried to its owner) a command for a conversation that
    /// another live node holds.
    pub(super) async fn owned_here(&self, id: &str) -> Result<(), ApiError> {
        let Some(cluster) = &self.cluster else {
            return Ok(());
        };
        if self.conversations.contains(id) {
            return Ok(());
        }
        match self.store.live_owner(id, cluster.node()).await? {
            Some(owner) => Err(ApiError::elsewhere(&owner.node, &owner.advertise)),
            None => Ok(()),
        }
    }

    pub(super) async fn live(&self, id: &str) -> Result<Live, ApiError> {
        Ok(self.conversations.get_or_start(id).await?)
    }
}

fn valid_slug(slug: &str) -> bool {
    (1..=64).contains(&slug.len())
        && slug
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// Creates a conversation.
#[utoipa::path(post, path = "/conversations", tag = "conversations",
    request_body = CreateConversation,
    responses(
        (status = 201, description = "The new conversation", body = Conversation),
        (status = 403, description = "`network_not_allowed`: the tenant's tools may not use the network", body = ErrorBody),
        (status = 409, description = "`slug_taken`: another conversation of the tenant has this slug", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: over one of the tenant's quotas (`error.quota` names it)", body = ErrorBody),
    ))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Body(body): Body<CreateConversation>,
) -> Result<Response, ApiError> {
    let id = uuid::Uuid::now_v7().to_string();
    let checked = match body.agent.as_deref() {
        Some(spec) => {
            let agent = super::agents::resolve(&app, &caller, spec).await?;
            check_create_from(&body, &id, agent)?
        }
        None => check_create(&app, &body, &id)?,
    };
    let network = network_for(&app, &caller, checked.network)?;
    let creating = app.admit_conversation(&caller.0.id).await?;
    let cwd = working_directory(&app, &caller.0.id, body.cwd.clone(), &id).await?;
    // The tenant's MCP servers' tools, fixed for the conversation from now on; a server that
    // does not answer is left out, and the conversation says so in a system message.
    let (mcp_tools, notices) =
        super::mcp_servers::tools_of(&app, &caller.0.id, checked.mcp_servers.as_deref()).await?;
    let new = NewConversation {
        id: id.clone(),
        tenant_id: caller.0.id.clone(),
        slug: checked.slug,
        cwd,
        model: checked.model,
        system_prompt: checked.system_prompt,
        parent_id: None,
        user_initiated: true,
        require_approval: checked.require_approval,
        network,
        budget_tokens: checked.budget_tokens,
        agent: checked.agent,
        tools: checked.tools,
        permissions: checked.permissions,
        client_tools: checked.client_tools,
        pre_tool_use: checked.pre_tool_use,
        bounds: checked.bounds,
        mcp_tools,
        // As stored: the databases keep microseconds.
        created_at: Utc::now().trunc_subsecs(6),
    };
    let mut conv = new.record();
    let job = if notices.is_empty() {
        WriteJob::CreateConversation(new)
    } else {
        conv.next_sequence_id = 2;
        WriteJob::Seeded {
            new,
            continued_from: None,
            message_id: uuid::Uuid::now_v7().to_string(),
            message: crate::state_machine::MessageContent::System {
                text: notices.join("\n"),
            },
        }
    };
    let written = app.persistence.write(job).await;
    drop(creating);
    match written {
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
    Ok(app.created(conv).await)
}

/// What a create request may get wrong, checked before anything is admitted or made, and
/// what the conversation is given (from the request, or from its agent).
struct CreateChecked {
    model: String,
    slug: String,
    system_prompt: Option<String>,
    require_approval: Vec<String>,
    budget_tokens: Option<u64>,
    /// Network access asked for.
    network: bool,
    /// The tenant's MCP servers it gets (`None`: all).
    mcp_servers: Option<Vec<String>>,
    agent: Option<AgentRef>,
    tools: Option<Vec<String>>,
    permissions: Vec<PermissionRule>,
    client_tools: Vec<crate::model::ClientTool>,
    pre_tool_use: Option<crate::model::PreToolUseHook>,
    bounds: crate::model::Bounds,
}

/// The slug asked for, checked, or one made from the id.
fn slug_of(body: &CreateConversation, id: &str) -> Result<String, ApiError> {
    match &body.slug {
        Some(slug) if valid_slug(slug) => Ok(slug.clone()),
        Some(_) => Err(ApiError::invalid(
            "slug must be 1 to 64 characters of a-z, 0-9, - and _",
        )),
        None => Ok(format!("conv-{}", &id[id.len() - 12..])),
    }
}

/// A conversation from an agent's version: the agent's settings, and only `cwd` and
/// `slug` of the request's (anything else it gives is refused, not ignored).
fn check_create_from(
    body: &CreateConversation,
    id: &str,
    agent: AgentVersion,
) -> Result<CreateChecked, ApiError> {
    check_cwd(body.cwd.as_deref())?;
    let given = [
        ("model", body.model.is_some()),
        ("system_prompt", body.system_prompt.is_some()),
        ("require_approval", body.require_approval.is_some()),
        ("network", body.network.is_some()),
        ("budget_tokens", body.budget_tokens.is_some()),
        ("client_tools", body.client_tools.is_some()),
    ];
    if let Some((field, _)) = given.iter().find(|(_, given)| *given) {
        return Err(ApiError::invalid(format!(
            "{field} is the agent's: with `agent`, only cwd and slug may be given"
        )));
    }
    let definition = agent.definition;
    Ok(CreateChecked {
        model: definition.model,
        slug: slug_of(body, id)?,
        system_prompt: definition.system_prompt,
        require_approval: definition.require_approval,
        budget_tokens: definition.budget_tokens,
        network: definition.network,
        mcp_servers: definition.mcp_servers,
        agent: Some(AgentRef {
            name: agent.name,
            version: agent.version,
        }),
        tools: definition.tools,
        permissions: definition.permissions,
        client_tools: definition.client_tools,
        pre_tool_use: definition.hooks.and_then(|hooks| hooks.pre_tool_use),
        bounds: crate::model::Bounds {
            limits: definition.limits,
            sub_agents: definition.sub_agents,
        },
    })
}

fn check_cwd(cwd: Option<&str>) -> Result<(), ApiError> {
    match cwd {
        Some(cwd) if cwd.len() > 4096 => Err(ApiError::invalid("cwd is longer than 4096 bytes")),
        Some(cwd) if cwd.trim().is_empty() => Err(ApiError::invalid(
            "cwd is empty: leave it out for a directory of the conversation's own, or give \".\" for the tenant's root",
        )),
        Some(_) | None => Ok(()),
    }
}

fn check_create(
    app: &AppState,
    body: &CreateConversation,
    id: &str,
) -> Result<CreateChecked, ApiError> {
    check_cwd(body.cwd.as_deref())?;
    let model = body
        .model
        .clone()
        .unwrap_or_else(|| app.settings.llm.model.clone());
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
    let slug = slug_of(body, id)?;
    let require_approval = body.require_approval.clone().unwrap_or_default();
    if require_approval
        .iter()
        .any(|name| name.is_empty() || name.len() > 64)
        || require_approval.len() > 32
    {
        return Err(ApiError::invalid(
            "require_approval must be a list of at most 32 tool names",
        ));
    }
    if let Some(budget) = body.budget_tokens
        && !(1..=i64::MAX as u64).contains(&budget)
    {
        return Err(ApiError::invalid(format!(
            "budget_tokens must be a positive number of tokens, not {budget}"
        )));
    }
    Ok(CreateChecked {
        model,
        slug,
        system_prompt: body.system_prompt.clone(),
        require_approval,
        budget_tokens: body.budget_tokens,
        network: body.network.unwrap_or(false),
        mcp_servers: None,
        agent: None,
        tools: None,
        permissions: Vec::new(),
        client_tools: super::client_tools::check(&app.settings, body.client_tools.clone())?,
        pre_tool_use: None,
        bounds: crate::model::Bounds::default(),
    })
}

/// Whether the new conversation's tools get the network, settled at creation and stored:
/// asking for it where the tenant may not have it is refused.
fn network_for(app: &AppState, caller: &Caller, requested: bool) -> Result<bool, ApiError> {
    let network = match &app.sandbox {
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
    Ok(network)
}

/// The new conversation's directory, made (or opened) one directory at a time by
/// descriptor under the tenant's root, through no link: the tenant's tools may have made
/// any part of the path a link.
async fn working_directory(
    app: &AppState,
    tenant: &str,
    given: Option<String>,
    id: &str,
) -> Result<String, ApiError> {
    let workspaces = app.workspaces.clone();
    let (tenant, default) = (tenant.to_owned(), id.to_owned());
    let made =
        tokio::task::spawn_blocking(move || workspaces.make(&tenant, given.as_deref(), &default))
            .await
            .map_err(|e| ApiError::internal(format!("cannot make the working directory: {e}")))?;
    match made {
        Ok(pinned) => Ok(pinned.path().display().to_string()),
        Err(e @ (WorkspaceError::Outside(_) | WorkspaceError::Replaced(_))) => {
            Err(ApiError::invalid(format!(
                "cwd must lie under the tenant's workspace and may not pass through a link: {e}"
            )))
        }
        Err(e @ WorkspaceError::Missing(_)) => Err(ApiError::invalid(e.to_string())),
        Err(WorkspaceError::Io { path, source }) => Err(ApiError::invalid(format!(
            "cwd {path} cannot be made: {source}"
        ))),
    }
}

/// Lists the tenant's user-initiated conversations, newest first.
#[utoipa::path(get, path = "/conversations", tag = "conversations",
    params(ListQuery),
    responses((status = 200, description = "A page of conversations", body = ConversationPage)))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Query(q): Query<ListQuery>,
) -> Result<Response, ApiError> {
    let limit = q.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(ApiError::invalid("limit must be between 1 and 200"));
    }
    let page = app
        .store
        .list_conversations(
            &caller.0.id,
            q.archived.unwrap_or(false),
            limit,
            q.cursor.as_deref(),
        )
        .await?;
    Ok(reply(
        StatusCode::OK,
        &ConversationPage {
            conversations: page
                .items
                .iter()
                .map(|c| app.conversation_json(c))
                .collect(),
            next_cursor: page.next_cursor.as_deref(),
        },
    ))
}

/// A conversation, by id or slug.
#[utoipa::path(get, path = "/conversations/{id}", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug")),
    responses((status = 200, description = "The conversation", body = Conversation)))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let conv = app.find(&caller, &id).await?;
    Ok(reply(StatusCode::OK, &app.conversation_json(&conv)))
}

/// A conversation's messages, ascending.
#[utoipa::path(get, path = "/conversations/{id}/messages", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug"), MessagesQuery),
    responses((status = 200, description = "Messages after `after`", body = MessageList)))]
pub async fn messages(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(q): Query<MessagesQuery>,
) -> Result<Response, ApiError> {
    let conv = app.find(&caller, &id).await?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::invalid("limit must be between 1 and 1000"));
    }
    let messages = app
        .store
        .messages_after(&conv.id, q.after.unwrap_or(0), limit)
        .await?;
    Ok(reply(
        StatusCode::OK,
        &MessageList {
            messages: messages
                .iter()
                .map(|m| app.message_json(&conv, m))
                .collect(),
        },
    ))
}

/// A conversation's sub-agents.
#[utoipa::path(get, path = "/conversations/{id}/children", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug")),
    responses((status = 200, description = "Its sub-agents", body = ConversationList)))]
pub async fn children(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let conv = app.find(&caller, &id).await?;
    let children = app.store.children(&conv.id).await?;
    Ok(reply(
        StatusCode::OK,
        &ConversationList {
            conversations: children.iter().map(|c| app.conversation_json(c)).collect(),
        },
    ))
}

/// An image of a user message, as stored (resized when it was sent): what a client shows
/// as a thumbnail. Found through the conversation, so another tenant's is 404 too; a fork
/// finds the images it shares with its source. *Extension.*
#[utoipa::path(get, path = "/conversations/{id}/images/{image_id}", tag = "conversations",
    params(
        ("id" = String, Path, description = "The conversation's id or slug"),
        ("image_id" = String, Path, description = "The image's id, from a user message's `images`"),
    ),
    responses(
        (status = 200, description = "The image's bytes, with its media type",
            content(("image/png"), ("image/jpeg"), ("image/gif"), ("image/webp"))),
        (status = 404, description = "No such conversation or image", body = ErrorBody),
    ))]
pub async fn image(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, image_id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let conv = app.find(&caller, &id).await?;
    let image = app
        .store
        .attachment(&conv.id, &image_id)
        .await?
        .ok_or_else(|| ApiError::not_found("image"))?;
    let media_type = HeaderValue::from_str(&image.media_type)
        .unwrap_or(HeaderValue::from_static("application/octet-stream"));
    Ok((
        [
            (header::CONTENT_TYPE, media_type),
            (
                header::CACHE_CONTROL,
                HeaderValue::from_static("private, max-age=86400, immutable"),
            ),
        ],
        image.data,
    )
        .into_response())
}

/// Sends a user message; it is stored before the reply.
#[utoipa::path(post, path = "/conversations/{id}/messages", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug"), SendQuery),
    request_body = SendMessage,
    responses(
        (status = 202, description = "Accepted and stored; the turn starts (with `if_busy=interrupt`, after the running turn was cancelled). With `if_busy=enqueue` or `steer` while a turn runs: `{queued}`, where it waits", body = SendReply),
        (status = 200, description = "A repeat of an earlier `message_id`: the original, nothing stored", body = Sent),
        (status = 409, description = "`agent_busy` (a turn runs; cancel it first, or send with `if_busy=interrupt`; of concurrent interrupting sends all but one get it), `cancelling`, `conversation_completed` (a sub-agent that submitted its result), or `queue_full` (`turn.max_queued` messages wait)", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: over one of the tenant's quotas (`error.quota` names it)", body = ErrorBody),
    ))]
pub async fn send(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<SendQuery>,
    Body(body): Body<SendMessage>,
) -> Result<Response, ApiError> {
    let out = Outgoing::from(body).arriving(&app, &id, query.if_busy.unwrap_or_default());
    let conv = app.sending_target(&caller, &id).await?;
    let (status, message) = match deliver(&app, &conv, out).await? {
        Delivered::New(message) => (StatusCode::ACCEPTED, message),
        Delivered::Repeat(message) => (StatusCode::OK, message),
        Delivered::Waiting {
            id,
            position,
            steering,
        } => {
            return Ok(reply(
                StatusCode::ACCEPTED,
                &wire::Waiting {
                    queued: wire::WaitingMessage {
                        queued_id: &id,
                        position,
                        kind: if steering { "steer" } else { "enqueue" },
                    },
                },
            ));
        }
    };
    let window = app.window(&conv.fixed.model);
    Ok(reply(
        status,
        &Sent {
            message: wire::message(&message, window),
        },
    ))
}

/// Cancels the running turn (idempotent: also when idle).
#[utoipa::path(post, path = "/conversations/{id}/cancel", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug"), CancelQuery),
    responses((status = 202, description = "The state after the cancel, and what it stopped", body = Cancelled)))]
pub async fn cancel(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<CancelQuery>,
) -> Result<Response, ApiError> {
    if query.clear_queue == Some(true) {
        super::queue::take_back(&app, &caller, &id, None).await?;
    }
    let conv = app.target(&caller, &id).await?;
    let outcome = cancel_conversation(&app, &conv.id).await?;
    Ok(reply(
        StatusCode::ACCEPTED,
        &Cancelled {
            state: wire::state(&outcome.state),
            stopped: Stopped {
                tools: &outcome.stopped_tools,
                sub_agents: &outcome.stopped_sub_agents,
                llm_request: outcome.aborted_llm,
            },
        },
    ))
}

async fn set_archived(
    app: &AppState,
    caller: &Caller,
    id: &str,
    archived: bool,
) -> Result<Response, ApiError> {
    let conv = app.find(caller, id).await?;
    app.owned_here(&conv.id).await?;
    app.persistence
        .write(WriteJob::SetArchived {
            id: conv.id.clone(),
            archived,
            at: Utc::now(),
        })
        .await?;
    let conv = app.find(caller, &conv.id).await?;
    Ok(reply(StatusCode::OK, &app.conversation_json(&conv)))
}

/// Archives a conversation (it leaves the default listing).
#[utoipa::path(post, path = "/conversations/{id}/archive", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug")),
    responses((status = 200, description = "The conversation", body = Conversation)))]
pub async fn archive(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    set_archived(&app, &caller, &id, true).await
}

/// Unarchives a conversation.
#[utoipa::path(post, path = "/conversations/{id}/unarchive", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug")),
    responses((status = 200, description = "The conversation", body = Conversation)))]
pub async fn unarchive(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    set_archived(&app, &caller, &id, false).await
}

/// Deletes a conversation: stops its work, kills its background tasks, removes its
/// messages and sub-agents.
#[utoipa::path(delete, path = "/conversations/{id}", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug")),
    responses((status = 204, description = "Deleted")))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let conv = app.find(&caller, &id).await?;
    app.owned_here(&conv.id).await?;
    // Stop its work and its actors (sub-agents included) before the rows go.
    let mut ids = vec![conv.id.clone()];
    ids.extend(
        app.store
            .children(&conv.id)
            .await?
            .into_iter()
            .map(|c| c.id),
    );
    for id in &ids {
        app.background.cancel_all(id);
        if let Some(live) = app.conversations.get(id) {
            live.stop("deleted", Duration::from_secs(5)).await;
        }
    }
    app.persistence
        .write(WriteJob::DeleteConversation {
            id: conv.id.clone(),
        })
        .await?;
    // Its directory goes too, unless another conversation of the tenant works in it, above
    // it or below it (a `share` fork, a conversation at the tenant's root, one made inside).
    let others = app.store.conversation_cwds(&caller.0.id).await?;
    let cwd = std::path::PathBuf::from(&conv.cwd);
    let shared = others
        .iter()
        .map(std::path::Path::new)
        .any(|other| other.starts_with(&cwd) || cwd.starts_with(other));
    if !shared {
        let workspaces = app.workspaces.clone();
        let removed = tokio::task::spawn_blocking(move || workspaces.remove(&cwd)).await;
        if let Ok(Err(error)) = removed {
            tracing::warn!(conversation = %conv.id, %error, "the deleted conversation's directory was not removed");
        }
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Posts a client's system event (`user_request`, `user_response`, `approval_response`).
#[utoipa::path(post, path = "/conversations/{id}/events", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug")),
    request_body = PostEvent,
    responses(
        (status = 202, description = "Stored and handled", body = Queued),
        (status = 400, description = "`forbidden_event_type`: a server-only type; `invalid_request`", body = ErrorBody),
    ))]
pub async fn system_event(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Body(body): Body<PostEvent>,
) -> Result<Response, ApiError> {
    let conv = app.target(&caller, &id).await?;
    app.owned_here(&conv.id).await?;
    check_client_event(&body.event)?;
    let event_type = body.event.event_type.clone();
    post_event(&app, &conv.id, body.event).await?;
    Ok(reply(
        StatusCode::ACCEPTED,
        &Queued {
            queued: true,
            event_type: &event_type,
        },
    ))
}

/// Answers a pending server-to-client request.
#[utoipa::path(post, path = "/conversations/{id}/requests/{request_id}", tag = "conversations",
    params(
        ("id" = String, Path, description = "The conversation's id or slug"),
        ("request_id" = String, Path, description = "The request's id"),
    ),
    request_body = Respond,
    responses(
        (status = 200, description = "Answered", body = Answered),
        (status = 409, description = "`already_answered`, or `expired` (timed out, cancelled, or the server restarted)", body = ErrorBody),
    ))]
pub async fn respond(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, request_id)): Path<(String, String)>,
    Body(body): Body<Respond>,
) -> Result<Response, ApiError> {
    let conv = app.target(&caller, &id).await?;
    app.owned_here(&conv.id).await?;
    answer_request(&app, &conv.id, &request_id, body.payload).await?;
    Ok(reply(
        StatusCode::OK,
        &Answered {
            answered: true,
            request_id: &request_id,
        },
    ))
}

/// A conversation's background tasks. *Extension.*
#[utoipa::path(get, path = "/conversations/{id}/tasks", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug")),
    responses((status = 200, description = "Its background tasks, oldest first", body = TaskList)))]
pub async fn tasks(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let conv = app.find(&caller, &id).await?;
    let tasks = app.store.background_tasks(&conv.id).await?;
    Ok(reply(
        StatusCode::OK,
        &TaskList {
            tasks: tasks.iter().map(wire::background_task).collect(),
        },
    ))
}

/// Kills a running background task; for a finished one it answers with how it ended.
/// *Extension.*
#[utoipa::path(post, path = "/conversations/{id}/tasks/{task_id}/cancel", tag = "conversations",
    params(
        ("id" = String, Path, description = "The conversation's id or slug"),
        ("task_id" = String, Path, description = "The task's id"),
    ),
    responses((status = 202, description = "The task as it is after the kill", body = TaskReply)))]
pub async fn cancel_task(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, task_id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let conv = app.find(&caller, &id).await?;
    app.owned_here(&conv.id).await?;
    let find = || async {
        Ok::<_, ApiError>(
            app.store
                .background_tasks(&conv.id)
                .await?
                .into_iter()
                .find(|t| t.id == task_id),
        )
    };
    let Some(mut task) = find().await? else {
        return Err(ApiError::not_found("task"));
    };
    if task.status == TaskStatus::Running && app.background.cancel(&conv.id, &task_id) {
        // The kill is immediate; its record follows within moments.
        let deadline = Instant::now() + Duration::from_secs(5);
        while task.status == TaskStatus::Running && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if let Some(latest) = find().await? {
                task = latest;
            }
        }
    }
    Ok(reply(
        StatusCode::ACCEPTED,
        &TaskReply {
            task: wire::background_task(&task),
        },
    ))
}
