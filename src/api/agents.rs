//! A tenant's agents (docs/api.md, "Agents"; issue 38): `POST/GET /v1/agents`,
//! `GET/PUT/DELETE /v1/agents/{name}`, `GET /v1/agents/{name}/versions[/{n}]`. Each change
//! is a new, immutable version; a conversation created from an agent (`agent` in
//! `POST /v1/conversations`) keeps the version it was created from, and so do its
//! sub-agents, forks and continuations.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse as _, Response};
use chrono::Utc;

use super::AppState;
use super::auth::Caller;
use super::error::{ApiError, Body, ErrorBody, Path, Query, reply};
use crate::model::{
    AgentDefinition, AgentVersion, HookFailure, Hooks, PreToolUseHook, SubAgentBounds, TurnBounds,
};
use crate::persistence::{WriteJob, WriteOutcome};
use crate::state_machine::PermissionRule;
use crate::store::{Making, StoreError};
use crate::wire::{
    self, AgentBody, AgentDocument, AgentDocumentVersion, AgentList, AgentView, ExportQuery,
    HooksBody, ImportQuery, PermissionRuleBody, SubAgentBoundsBody, TurnBoundsBody,
};

/// Versions one agent may hold: past it, a change is refused (delete it and create it again:
/// its versions go with it, its numbering goes on).
pub const MAX_VERSIONS: u32 = 1000;

/// The most an agent's permission rules may hold in patterns: each pattern 256 bytes, all
/// of them 8 KiB (matching is linear in pattern and value, once per call).
const MAX_PATTERN_BYTES: usize = 256;
const MAX_RULES_PATTERN_BYTES: usize = 8 * 1024;

/// The most `metadata` may hold, as JSON.
const MAX_METADATA_BYTES: usize = 16 * 1024;

/// A name an agent may have: `import` is the import's route.
fn valid_name(name: &str) -> bool {
    name != "import"
        && (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// The built-in tools an agent may name in `tools` (a sub-agent's submit_result is always
/// its own).
fn built_in_tools() -> Vec<&'static str> {
    crate::tools::all_names()
        .iter()
        .copied()
        .filter(|name| *name != crate::state_machine::SUBMIT_RESULT)
        .collect()
}

/// A list of at most 32 names, each passing `valid`, without repeats.
fn names(
    field: &str,
    given: Option<Vec<String>>,
    valid: impl Fn(&str) -> bool,
) -> Result<Option<Vec<String>>, ApiError> {
    let Some(mut given) = given else {
        return Ok(None);
    };
    if given.len() > 32 {
        return Err(ApiError::invalid(format!(
            "{field} may name at most 32 entries"
        )));
    }
    if let Some(bad) = given.iter().find(|name| !valid(name)) {
        return Err(ApiError::invalid(format!(
            "{field}: {bad:?} is not a valid entry"
        )));
    }
    given.sort();
    given.dedup();
    Ok(Some(given))
}

/// The definition a body gives, checked (the API's routes and `bedrock agent import`).
pub(crate) fn check_definition(
    settings: &crate::config::Settings,
    body: AgentBody,
) -> Result<AgentDefinition, ApiError> {
    if body.description.as_ref().is_some_and(|d| d.len() > 2000) {
        return Err(ApiError::invalid("description is longer than 2000 bytes"));
    }
    if body.model.trim().is_empty() || body.model.len() > 200 {
        return Err(ApiError::invalid(
            "model must be a non-empty string of at most 200 characters",
        ));
    }
    let max_text = settings.server.max_text_bytes;
    if body
        .system_prompt
        .as_ref()
        .is_some_and(|p| p.len() > max_text)
    {
        return Err(ApiError::too_large(format!(
            "system_prompt is longer than {max_text} bytes"
        )));
    }
    let known = built_in_tools();
    let tools = names("tools", body.tools, |name| known.contains(&name)).map_err(|_| {
        ApiError::invalid(format!(
            "tools must name at most 32 of the built-in tools: {}",
            known.join(", ")
        ))
    })?;
    let mcp_servers = names("mcp_servers", body.mcp_servers, |name| {
        (1..=32).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    })?;
    let require_approval = names("require_approval", body.require_approval, |name| {
        (1..=64).contains(&name.len())
    })?
    .unwrap_or_default();
    if let Some(budget) = body.budget_tokens
        && !(1..=i64::MAX as u64).contains(&budget)
    {
        return Err(ApiError::invalid(format!(
            "budget_tokens must be a positive number of tokens, not {budget}"
        )));
    }
    if let Some(metadata) = &body.metadata
        && serde_json::to_string(metadata).map_or(usize::MAX, |json| json.len())
            > MAX_METADATA_BYTES
    {
        return Err(ApiError::invalid(format!(
            "metadata is larger than {MAX_METADATA_BYTES} bytes as JSON"
        )));
    }
    let permissions = permissions(body.permissions)?;
    let client_tools = super::client_tools::check(settings, body.client_tools)?;
    let hooks = hooks(body.hooks)?;
    let (limits, sub_agents) = bounds(settings, body.limits, body.sub_agents)?;
    Ok(AgentDefinition {
        permissions,
        client_tools,
        hooks,
        limits,
        sub_agents,
        description: body.description,
        model: body.model,
        system_prompt: body.system_prompt,
        tools,
        mcp_servers,
        require_approval,
        network: body.network.unwrap_or(false),
        budget_tokens: body.budget_tokens,
        metadata: body.metadata,
    })
}

/// The most a pre-tool-use hook may take to answer.
const MAX_HOOK_TIMEOUT_MS: u64 = 30_000;
/// A hook's default time to answer.
const HOOK_TIMEOUT_MS: u64 = 5_000;

/// The hooks a body gives, checked: a URL of `http` or `https` of at most 2048 bytes (the
/// egress policy is applied when it is called, as for MCP servers), a secret of 16 to 512
/// bytes (a `whsec_` one must hold base64), a timeout of 1 to 30000 ms.
fn hooks(given: Option<HooksBody>) -> Result<Option<Hooks>, ApiError> {
    let Some(given) = given else {
        return Ok(None);
    };
    let Some(hook) = given.pre_tool_use else {
        return Ok(None);
    };
    let bad = |why: &str| ApiError::invalid(format!("hooks.pre_tool_use: {why}"));
    let url = url::Url::parse(&hook.url).map_err(|_| bad("url is not a URL"))?;
    if hook.url.len() > 2048 || !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err(bad(
            "url must be an http or https URL of at most 2048 bytes",
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad(
            "url may not hold credentials; the hook's requests are signed",
        ));
    }
    let Some(secret) = hook.secret else {
        return Err(bad(
            "secret is missing (an exported agent has none: secrets are never exported; give it again)",
        ));
    };
    if !(16..=512).contains(&secret.len()) || crate::webhooks::hook_key(&secret).is_none() {
        return Err(bad(
            "secret must be 16 to 512 bytes (a whsec_ secret must hold base64)",
        ));
    }
    let timeout_ms = hook.timeout_ms.unwrap_or(HOOK_TIMEOUT_MS);
    if !(1..=MAX_HOOK_TIMEOUT_MS).contains(&timeout_ms) {
        return Err(bad("timeout_ms must be 1 to 30000"));
    }
    Ok(Some(Hooks {
        pre_tool_use: Some(PreToolUseHook {
            url: url.to_string(),
            secret,
            timeout_ms,
            on_failure: hook.on_failure.unwrap_or(HookFailure::Deny),
        }),
    }))
}

/// The bounds a body gives, checked: each at least 1 and at most the node's.
fn bounds(
    settings: &crate::config::Settings,
    limits: Option<TurnBoundsBody>,
    sub_agents: Option<SubAgentBoundsBody>,
) -> Result<(Option<TurnBounds>, Option<SubAgentBounds>), ApiError> {
    let node = settings.turn_limits();
    let within = |field: &str, value: Option<u64>, most: u64| match value {
        Some(value) if !(1..=most).contains(&value) => Err(ApiError::invalid(format!(
            "{field} must be 1 to {most} (the node's bound)"
        ))),
        Some(_) | None => Ok(()),
    };
    if let Some(limits) = &limits {
        within(
            "limits.max_llm_steps",
            limits.max_llm_steps.map(u64::from),
            u64::from(node.max_llm_steps),
        )?;
        within(
            "limits.max_tool_calls",
            limits.max_tool_calls.map(u64::from),
            u64::from(node.max_tool_calls),
        )?;
    }
    if let Some(sub) = &sub_agents {
        within(
            "sub_agents.max_tasks",
            sub.max_tasks.map(u64::from),
            u64::from(node.max_sub_agents),
        )?;
        within(
            "sub_agents.max_steps",
            sub.max_steps.map(u64::from),
            u64::from(node.sub_agent_max_steps),
        )?;
        within(
            "sub_agents.timeout_ms",
            sub.timeout_ms,
            node.sub_agent_timeout_ms,
        )?;
    }
    Ok((
        limits.map(|l| TurnBounds {
            max_llm_steps: l.max_llm_steps,
            max_tool_calls: l.max_tool_calls,
        }),
        sub_agents.map(|s| SubAgentBounds {
            max_tasks: s.max_tasks,
            max_steps: s.max_steps,
            timeout_ms: s.timeout_ms,
        }),
    ))
}

/// The rules a body gives, checked: at most 64, each with a tool pattern of 1 to 256
/// bytes, at most 16 input fields (names of 1 to 64 characters, patterns of at most
/// 256 bytes) and a message of at most 1000 bytes.
fn permissions(given: Option<Vec<PermissionRuleBody>>) -> Result<Vec<PermissionRule>, ApiError> {
    let given = given.unwrap_or_default();
    if given.len() > 64 {
        return Err(ApiError::invalid("permissions may hold at most 64 rules"));
    }
    let total: usize = given
        .iter()
        .map(|rule| {
            rule.tool.len()
                + rule
                    .input
                    .as_ref()
                    .map_or(0, |input| input.values().map(String::len).sum())
        })
        .sum();
    if total > MAX_RULES_PATTERN_BYTES {
        return Err(ApiError::invalid(format!(
            "permissions' patterns hold {total} bytes in all; at most {MAX_RULES_PATTERN_BYTES}"
        )));
    }
    given
        .into_iter()
        .enumerate()
        .map(|(i, rule)| {
            let input = rule.input.unwrap_or_default();
            let fits = (1..=MAX_PATTERN_BYTES).contains(&rule.tool.len())
                && input.len() <= 16
                && input.iter().all(|(field, pattern)| {
                    (1..=64).contains(&field.len()) && pattern.len() <= MAX_PATTERN_BYTES
                })
                && rule.message.as_ref().is_none_or(|m| m.len() <= 1000);
            if !fits {
                return Err(ApiError::invalid(format!(
                    "permissions[{i}]: a tool pattern of 1 to {MAX_PATTERN_BYTES} bytes, at most 16 input fields (names of 1 to 64 characters, patterns of at most {MAX_PATTERN_BYTES} bytes) and a message of at most 1000 bytes"
                )));
            }
            Ok(PermissionRule {
                tool: rule.tool,
                input,
                action: rule.action,
                message: rule.message,
            })
        })
        .collect()
}

/// 409 `agent_exists`.
fn exists(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "agent_exists",
        format!(
            "the tenant has an agent named {name:?}; PUT /v1/agents/{name} makes its next version"
        ),
    )
}

/// Stores the next version of `name` and answers it as the API shows it.
async fn put(
    app: &AppState,
    caller: &Caller,
    name: String,
    definition: AgentDefinition,
    making: Making,
) -> Result<AgentVersion, ApiError> {
    put_all(app, caller, name, vec![definition], making)
        .await?
        .pop()
        .ok_or_else(|| ApiError::internal("no agent version was made"))
}

/// Stores versions of `name` in order, all or none, and answers them.
async fn put_all(
    app: &AppState,
    caller: &Caller,
    name: String,
    definitions: Vec<AgentDefinition>,
    making: Making,
) -> Result<Vec<AgentVersion>, ApiError> {
    let at = Utc::now();
    let written =
        app.persistence
            .write(WriteJob::PutAgent {
                tenant_id: caller.0.id.clone(),
                name: name.clone(),
                definitions: definitions.clone(),
                making,
                at,
            })
            .await
            .map_err(|e| match e {
                StoreError::Conflict(_) => exists(&name),
                StoreError::NotFound => ApiError::not_found("agent"),
                other @ (StoreError::Unavailable(_)
                | StoreError::Corrupt(_)
                | StoreError::Other(_)) => other.into(),
            })?;
    let WriteOutcome::Version(first) = written else {
        return Err(ApiError::internal("the agent's version was not reported"));
    };
    Ok(definitions
        .into_iter()
        .zip(first..)
        .map(|(definition, version)| AgentVersion {
            name: name.clone(),
            version,
            definition,
            created_at: at.to_rfc3339(),
        })
        .collect())
}

/// Creates an agent: its version 1 (or, for a name deleted before, the next number).
/// *Extension.*
#[utoipa::path(post, path = "/agents", tag = "agents",
    request_body = AgentBody,
    responses(
        (status = 201, description = "The agent's first version", body = AgentView),
        (status = 400, description = "`invalid_request`: a bad name, model, tool, server or field", body = ErrorBody),
        (status = 409, description = "`agent_exists`: the tenant has an agent of that name", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: over the tenant's `agents` quota", body = ErrorBody),
    ))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Body(body): Body<AgentBody>,
) -> Result<Response, ApiError> {
    let name = match &body.name {
        Some(name) if valid_name(name) => name.clone(),
        Some(_) | None => {
            return Err(ApiError::invalid(
                "name must be 1 to 64 characters of a-z, 0-9, - and _",
            ));
        }
    };
    let definition = check_definition(&app.settings, body)?;
    let store = &app.store;
    let _making = app
        .quotas
        .agent(&caller.0.id, || store.agent_count(&caller.0.id))
        .await??;
    let made = put(&app, &caller, name, definition, Making::Create).await?;
    Ok(reply(StatusCode::CREATED, &wire::agent(&made)))
}

/// Changes an agent: its next version. Conversations created from earlier versions keep
/// theirs. *Extension.*
#[utoipa::path(put, path = "/agents/{name}", tag = "agents",
    params(("name" = String, Path, description = "The agent's name")),
    request_body = AgentBody,
    responses(
        (status = 200, description = "The agent's new version", body = AgentView),
        (status = 400, description = "`invalid_request`: a bad field, or a `name` other than the path's", body = ErrorBody),
        (status = 404, description = "No such agent", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: the agent has its most versions (`agent_versions`, 1000)", body = ErrorBody),
    ))]
pub async fn change(
    State(app): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    Body(body): Body<AgentBody>,
) -> Result<Response, ApiError> {
    if body.name.as_ref().is_some_and(|given| *given != name) {
        return Err(ApiError::invalid(
            "name, when given, must be the agent's name in the path (an agent is not renamed)",
        ));
    }
    let definition = check_definition(&app.settings, body)?;
    let held = app.store.agent_version_count(&caller.0.id, &name).await?;
    if held >= u64::from(MAX_VERSIONS) {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "quota_exceeded",
            format!(
                "agent {name:?} holds {MAX_VERSIONS} versions, the most one may hold; delete it and create it again"
            ),
        ));
    }
    let made = put(&app, &caller, name, definition, Making::Change).await?;
    Ok(reply(StatusCode::OK, &wire::agent(&made)))
}

/// The tenant's agents, each at its latest version, by name. *Extension.*
#[utoipa::path(get, path = "/agents", tag = "agents",
    responses((status = 200, description = "The tenant's agents", body = AgentList)))]
pub async fn list(State(app): State<AppState>, caller: Caller) -> Result<Response, ApiError> {
    let agents = app.store.agents(&caller.0.id).await?;
    Ok(reply(
        StatusCode::OK,
        &AgentList {
            agents: agents.iter().map(wire::agent).collect(),
        },
    ))
}

/// An agent's latest version. *Extension.*
#[utoipa::path(get, path = "/agents/{name}", tag = "agents",
    params(("name" = String, Path, description = "The agent's name")),
    responses(
        (status = 200, description = "Its latest version", body = AgentView),
        (status = 404, description = "No such agent", body = ErrorBody),
    ))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let found = app
        .store
        .agent(&caller.0.id, &name, None)
        .await?
        .ok_or_else(|| ApiError::not_found("agent"))?;
    Ok(reply(StatusCode::OK, &wire::agent(&found)))
}

/// Deletes an agent: no new conversation may use it; those created from it keep their
/// version. Created again, its versions go on from the last. *Extension.*
#[utoipa::path(delete, path = "/agents/{name}", tag = "agents",
    params(("name" = String, Path, description = "The agent's name")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such agent", body = ErrorBody),
    ))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let deleted = app
        .persistence
        .write(WriteJob::DeleteAgent {
            tenant_id: caller.0.id.clone(),
            name,
            at: Utc::now(),
        })
        .await?;
    if deleted == WriteOutcome::Resolved(true) {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::not_found("agent"))
    }
}

/// Every version of an agent, oldest first. *Extension.*
#[utoipa::path(get, path = "/agents/{name}/versions", tag = "agents",
    params(("name" = String, Path, description = "The agent's name")),
    responses(
        (status = 200, description = "Its versions, oldest first", body = AgentList),
        (status = 404, description = "No such agent", body = ErrorBody),
    ))]
pub async fn versions(
    State(app): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let versions = app.store.agent_versions(&caller.0.id, &name).await?;
    if versions.is_empty() {
        return Err(ApiError::not_found("agent"));
    }
    Ok(reply(
        StatusCode::OK,
        &AgentList {
            agents: versions.iter().map(wire::agent).collect(),
        },
    ))
}

/// One version of an agent. *Extension.*
#[utoipa::path(get, path = "/agents/{name}/versions/{version}", tag = "agents",
    params(
        ("name" = String, Path, description = "The agent's name"),
        ("version" = u32, Path, description = "The version's number, from 1"),
    ),
    responses(
        (status = 200, description = "That version", body = AgentView),
        (status = 404, description = "No such agent or version", body = ErrorBody),
    ))]
pub async fn version(
    State(app): State<AppState>,
    caller: Caller,
    Path((name, version)): Path<(String, u32)>,
) -> Result<Response, ApiError> {
    let found = app
        .store
        .agent(&caller.0.id, &name, Some(version))
        .await?
        .ok_or_else(|| ApiError::not_found("agent version"))?;
    Ok(reply(StatusCode::OK, &wire::agent(&found)))
}

/// The agent version `spec` names (`name` or `name@N`) for a new conversation of the
/// caller's: another tenant's, a deleted one's, or a missing one is not found.
pub(super) async fn resolve(
    app: &AppState,
    caller: &Caller,
    spec: &str,
) -> Result<AgentVersion, ApiError> {
    let (name, version) = match spec.rsplit_once('@') {
        Some((name, number)) => match number.parse::<u32>() {
            Ok(version) if version >= 1 => (name, Some(version)),
            Ok(_) | Err(_) => {
                return Err(ApiError::invalid(
                    "agent must be `name` or `name@N` with N a version from 1",
                ));
            }
        },
        None => (spec, None),
    };
    if !valid_name(name) {
        return Err(ApiError::invalid(
            "agent must be `name` or `name@N`: a name is 1 to 64 characters of a-z, 0-9, - and _",
        ));
    }
    app.store
        .agent(&caller.0.id, name, version)
        .await?
        .ok_or_else(|| ApiError::not_found("agent"))
}

/// An agent as one document: its versions (or its latest), oldest first.
pub(crate) fn document(name: &str, versions: &[AgentVersion]) -> AgentDocument {
    AgentDocument {
        format: DOCUMENT_FORMAT.to_owned(),
        name: name.to_owned(),
        versions: versions
            .iter()
            .map(|version| AgentDocumentVersion {
                version: version.version,
                created_at: version.created_at.clone(),
                definition: serde_json::to_value(without_secrets(&version.definition))
                    .unwrap_or_default(),
            })
            .collect(),
    }
}

/// A definition as a document carries it: its hook without its secret.
fn without_secrets(definition: &AgentDefinition) -> AgentDefinition {
    let mut definition = definition.clone();
    if let Some(hook) = definition
        .hooks
        .as_mut()
        .and_then(|hooks| hooks.pre_tool_use.as_mut())
    {
        hook.secret.clear();
    }
    definition
}

/// What a document to import makes: its name (or `as`) and its definitions, checked as
/// `POST /v1/agents` checks one.
pub(crate) fn importable(
    settings: &crate::config::Settings,
    document: AgentDocument,
    as_name: Option<String>,
) -> Result<(String, Vec<AgentDefinition>), ApiError> {
    if document.format != DOCUMENT_FORMAT {
        return Err(ApiError::invalid(format!(
            "format must be {DOCUMENT_FORMAT:?}"
        )));
    }
    let name = as_name.unwrap_or(document.name);
    if !valid_name(&name) {
        return Err(ApiError::invalid(
            "the agent's name must be 1 to 64 characters of a-z, 0-9, - and _",
        ));
    }
    if document.versions.is_empty() || document.versions.len() > MAX_VERSIONS as usize {
        return Err(ApiError::invalid(format!(
            "versions must hold 1 to {MAX_VERSIONS} versions"
        )));
    }
    let definitions = document
        .versions
        .into_iter()
        .map(|version| {
            let body: AgentBody = serde_json::from_value(version.definition)
                .map_err(|e| ApiError::invalid(format!("version {}: {e}", version.version)))?;
            if body.name.is_some() {
                return Err(ApiError::invalid(format!(
                    "version {}: a definition has no name (the document's is the agent's)",
                    version.version
                )));
            }
            check_definition(settings, body)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((name, definitions))
}

/// The format of an agent's document.
pub(crate) const DOCUMENT_FORMAT: &str = "bedrock.agent/1";

/// An agent as one document, to keep or to import elsewhere: every version, or with
/// `?latest=true` the latest alone. Nothing secret is in it (an agent names MCP servers; their
/// headers are the tenant's, not the agent's). *Extension.*
#[utoipa::path(get, path = "/agents/{name}/export", tag = "agents",
    params(("name" = String, Path, description = "The agent's name"), ExportQuery),
    responses(
        (status = 200, description = "The agent's document", body = AgentDocument),
        (status = 404, description = "No such agent", body = ErrorBody),
    ))]
pub async fn export(
    State(app): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    Query(query): Query<ExportQuery>,
) -> Result<Response, ApiError> {
    let mut versions = app.store.agent_versions(&caller.0.id, &name).await?;
    if versions.is_empty() {
        return Err(ApiError::not_found("agent"));
    }
    if query.latest.unwrap_or(false) {
        versions = versions.split_off(versions.len() - 1);
    }
    Ok(reply(StatusCode::OK, &document(&name, &versions)))
}

/// Makes an agent from a document (`GET /v1/agents/{name}/export`'s): its versions in
/// order, all or none, under the document's name or `?as=`. A name the tenant uses is 409.
/// *Extension.*
#[utoipa::path(post, path = "/agents/import", tag = "agents",
    params(ImportQuery),
    request_body = AgentDocument,
    responses(
        (status = 201, description = "The versions made, oldest first (numbered as the importing tenant numbers them)", body = AgentList),
        (status = 400, description = "`invalid_request`: not an agent document, or a version that `POST /v1/agents` would refuse", body = ErrorBody),
        (status = 409, description = "`agent_exists`: the tenant has an agent of that name (import it `?as=` another)", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: over the tenant's `agents` quota", body = ErrorBody),
    ))]
pub async fn import(
    State(app): State<AppState>,
    caller: Caller,
    Query(query): Query<ImportQuery>,
    Body(document): Body<AgentDocument>,
) -> Result<Response, ApiError> {
    let (name, definitions) = importable(&app.settings, document, query.as_name)?;
    let store = &app.store;
    // A taken name is the answer before the quota (the write refuses it either way).
    if store.agent(&caller.0.id, &name, None).await?.is_some() {
        return Err(exists(&name));
    }
    let _making = app
        .quotas
        .agent(&caller.0.id, || store.agent_count(&caller.0.id))
        .await??;
    let made = put_all(&app, &caller, name, definitions, Making::Create).await?;
    Ok(reply(
        StatusCode::CREATED,
        &AgentList {
            agents: made.iter().map(wire::agent).collect(),
        },
    ))
}
