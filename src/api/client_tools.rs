//! Client tools (docs/api.md, "Client tools"; issue 38): their definitions, checked where an
//! agent or a create request declares them; the answers to their calls; the calls listed.

use std::collections::HashSet;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;

use super::AppState;
use super::auth::Caller;
use super::error::{ApiError, Body, ErrorBody, Path, Query, reply};
use crate::model::ClientTool;
use crate::runtime::ToolResultError;
use crate::wire::{
    self, ClientToolBody, ClientToolCallList, ClientToolCallQuery, ToolResultBody, ToolResultTaken,
};

/// The most client tools a conversation or an agent declares.
const MAX_TOOLS: usize = 32;
/// The most one tool's `input_schema` holds, as JSON.
const MAX_SCHEMA_BYTES: usize = 16 * 1024;

/// The client tools a body declares, checked: at most 32, each with a name of 1 to 64 of
/// `A-Za-z0-9_-` without `__` (the MCP tools' separator, so it is never an MCP tool's) that
/// is no built-in tool's and no other client tool's, a description of at most 2000 bytes, an object schema of at most
/// 16 KiB and a timeout within `requests.max_timeout_ms`.
pub(crate) fn check(
    settings: &crate::config::Settings,
    given: Option<Vec<ClientToolBody>>,
) -> Result<Vec<ClientTool>, ApiError> {
    let given = given.unwrap_or_default();
    if given.len() > MAX_TOOLS {
        return Err(ApiError::invalid(format!(
            "client_tools may declare at most {MAX_TOOLS} tools"
        )));
    }
    let built_in = crate::tools::all_names();
    let max_timeout = settings.requests.max_timeout_ms;
    let mut seen = HashSet::new();
    given
        .into_iter()
        .enumerate()
        .map(|(i, tool)| {
            let bad = |why: String| ApiError::invalid(format!("client_tools[{i}]: {why}"));
            let name_ok = (1..=64).contains(&tool.name.len())
                && tool
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                && !tool.name.contains("__");
            if !name_ok {
                return Err(bad(
                    "name must be 1 to 64 of A-Z, a-z, 0-9, - and _, without \"__\"".into(),
                ));
            }
            if built_in.contains(&tool.name.as_str()) {
                return Err(bad(format!(
                    "{:?} is a built-in tool's name; a client tool may not shadow it",
                    tool.name
                )));
            }
            if !seen.insert(tool.name.clone()) {
                return Err(bad(format!("{:?} is declared twice", tool.name)));
            }
            if tool.description.as_ref().is_some_and(|d| d.len() > 2000) {
                return Err(bad("description is longer than 2000 bytes".into()));
            }
            let schema_ok =
                tool.input_schema.get("type").and_then(|t| t.as_str()) == Some("object");
            if !schema_ok {
                return Err(bad(
                    "input_schema must be a JSON Schema object with \"type\": \"object\"".into(),
                ));
            }
            if tool.input_schema.to_string().len() > MAX_SCHEMA_BYTES {
                return Err(bad(format!(
                    "input_schema is larger than {MAX_SCHEMA_BYTES} bytes as JSON"
                )));
            }
            if let Some(ms) = tool.timeout_ms
                && !(1..=max_timeout).contains(&ms)
            {
                return Err(bad(format!(
                    "timeout_ms must be 1 to {max_timeout} (requests.max_timeout_ms)"
                )));
            }
            Ok(ClientTool {
                name: tool.name,
                description: tool.description.unwrap_or_default(),
                input_schema: tool.input_schema,
                timeout_ms: tool.timeout_ms,
            })
        })
        .collect()
}

/// Answers a client tool call once (REST, the WebSocket, MCP).
pub(crate) async fn answer(
    app: &AppState,
    id: &str,
    call_id: &str,
    output: String,
    is_error: bool,
) -> Result<(), ApiError> {
    if call_id.is_empty() || call_id.len() > 64 {
        return Err(ApiError::not_found("client tool call"));
    }
    Ok(app
        .conversations
        .answer_tool_call(id, call_id, output, is_error)
        .await?)
}

impl From<ToolResultError> for ApiError {
    fn from(error: ToolResultError) -> Self {
        match error {
            ToolResultError::NotFound => ApiError::not_found("client tool call"),
            ToolResultError::AlreadyAnswered(_) => {
                ApiError::new(StatusCode::CONFLICT, "already_answered", error.to_string())
            }
            ToolResultError::Expired => {
                ApiError::new(StatusCode::CONFLICT, "expired", error.to_string())
            }
            ToolResultError::Store(store) => store.into(),
        }
    }
}

/// Answers a call of a client tool with its result. *Extension.*
#[utoipa::path(post, path = "/conversations/{id}/tool_results/{call_id}", tag = "conversations",
    params(
        ("id" = String, Path, description = "The conversation's id or slug"),
        ("call_id" = String, Path, description = "The call's id (`client_tool_call`'s `call_id`)"),
    ),
    request_body = ToolResultBody,
    responses(
        (status = 200, description = "Taken: it is the call's result", body = ToolResultTaken),
        (status = 404, description = "No such call of this conversation", body = ErrorBody),
        (status = 409, description = "`already_answered` (the message gives the first answer's time), or `expired` (timed out, or cancelled)", body = ErrorBody),
    ))]
pub async fn tool_result(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, call_id)): Path<(String, String)>,
    Body(body): Body<ToolResultBody>,
) -> Result<Response, ApiError> {
    let conv = app.target(&caller, &id).await?;
    app.owned_here(&conv.id).await?;
    answer(&app, &conv.id, &call_id, body.output, body.is_error).await?;
    Ok(reply(
        StatusCode::OK,
        &ToolResultTaken {
            answered: true,
            call_id: &call_id,
        },
    ))
}

/// A conversation's calls of its client tools, newest first. *Extension.*
#[utoipa::path(get, path = "/conversations/{id}/client_tool_calls", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug"), ClientToolCallQuery),
    responses((status = 200, description = "Its calls, newest first (at most 100)", body = ClientToolCallList)))]
pub async fn calls(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<ClientToolCallQuery>,
) -> Result<Response, ApiError> {
    let conv = app.find(&caller, &id).await?;
    let calls = app
        .store
        .client_tool_calls(&conv.id, query.pending.unwrap_or(false))
        .await?;
    Ok(reply(
        StatusCode::OK,
        &ClientToolCallList {
            calls: calls.iter().map(wire::client_tool_call).collect(),
        },
    ))
}
