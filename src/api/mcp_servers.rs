//! Tenants' own MCP tool servers (docs/api.md, "MCP"): `POST/GET /v1/mcp_servers`,
//! `DELETE /v1/mcp_servers/{name}`. Their tools join each new conversation of the tenant as
//! `name__tool` (src/mcp_client.rs). Headers are stored to be sent to the server and are
//! never shown again: listings name them only.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::Utc;

use super::AppState;
use super::auth::Caller;
use super::error::{ApiError, Body, ErrorBody, Path, reply};
use crate::model::McpTool;
use crate::persistence::WriteJob;
use crate::quotas::Quota;
use crate::store::{McpServer, StoreError};
use crate::wire::{McpServerList, McpServerView, NewMcpServer};

/// How long a server may take to list its tools when a conversation is created.
const LIST_TIMEOUT: Duration = Duration::from_secs(5);

fn view(server: &McpServer) -> McpServerView<'_> {
    McpServerView {
        name: &server.name,
        url: &server.url,
        header_names: server.headers.keys().map(String::as_str).collect(),
        created_at: &server.created_at,
    }
}

fn valid_name(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && !name.contains(crate::tools::MCP_SEPARATOR)
}

/// Registers an MCP server of the tenant. *Extension.*
#[utoipa::path(post, path = "/mcp_servers", tag = "mcp",
    request_body = NewMcpServer,
    responses(
        (status = 201, description = "Registered; its tools join the tenant's new conversations", body = McpServerView),
        (status = 400, description = "A bad name, URL or header (`invalid_request`), or a URL the egress policy refuses (`egress_refused`): an internal address, a name that resolves only to internal addresses, a user name or password in it", body = ErrorBody),
        (status = 409, description = "`mcp_server_exists`: the tenant has a server of that name", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: over one of the tenant's quotas (`error.quota` names it)", body = ErrorBody),
    ))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Body(body): Body<NewMcpServer>,
) -> Result<Response, ApiError> {
    if !valid_name(&body.name) {
        return Err(ApiError::invalid(
            "name must be 1 to 32 characters of a-z, 0-9, `-` and `_`, without `__`",
        ));
    }
    let url = url::Url::parse(&body.url)
        .ok()
        .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
        .ok_or_else(|| ApiError::invalid("url must be an http:// or https:// URL"))?;
    // The egress policy (docs/security.md, "Server-side requests (SSRF)"): checked here, and
    // again at every connection.
    app.egress.check_url(&url).await.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "egress_refused",
            format!("url: {e}"),
        )
    })?;
    let registered = app.store.mcp_server_count(&caller.0.id).await?;
    app.quotas
        .check(&caller.0.id, Quota::McpServers, registered)
        .await?;
    let headers = body.headers.unwrap_or_default();
    if headers.len() > 20
        || headers.iter().any(|(name, value)| {
            http::HeaderName::from_bytes(name.as_bytes()).is_err()
                || http::HeaderValue::from_str(value).is_err()
                || value.len() > 8192
        })
    {
        return Err(ApiError::invalid(
            "headers must be at most 20 valid HTTP header names and values",
        ));
    }
    let server = McpServer {
        name: body.name,
        url: url.to_string(),
        headers: headers.into_iter().collect::<BTreeMap<_, _>>(),
        created_at: String::new(),
    };
    let at = Utc::now();
    let stored = McpServer {
        created_at: at.to_rfc3339(),
        ..server.clone()
    };
    app.persistence
        .write(WriteJob::AddMcpServer {
            tenant_id: caller.0.id.clone(),
            server,
            at,
        })
        .await
        .map_err(|e| match e {
            StoreError::Conflict(_) => ApiError::new(
                StatusCode::CONFLICT,
                "mcp_server_exists",
                format!("the tenant has an MCP server named {:?}", stored.name),
            ),
            other @ (StoreError::Unavailable(_)
            | StoreError::NotFound
            | StoreError::Corrupt(_)
            | StoreError::Other(_)) => other.into(),
        })?;
    Ok(reply(StatusCode::CREATED, &view(&stored)))
}

/// The tenant's MCP servers (header names only). *Extension.*
#[utoipa::path(get, path = "/mcp_servers", tag = "mcp",
    responses((status = 200, description = "The tenant's MCP servers, by name", body = McpServerList)))]
pub async fn list(State(app): State<AppState>, caller: Caller) -> Result<Response, ApiError> {
    let servers = app.store.mcp_servers(&caller.0.id).await?;
    Ok(reply(
        StatusCode::OK,
        &McpServerList {
            servers: servers.iter().map(view).collect(),
        },
    ))
}

/// Removes an MCP server: conversations that have its tools get a failed result when they
/// call one. *Extension.*
#[utoipa::path(delete, path = "/mcp_servers/{name}", tag = "mcp",
    params(("name" = String, Path, description = "The server's name")),
    responses(
        (status = 204, description = "Removed"),
        (status = 404, description = "No such server", body = ErrorBody),
    ))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let removed = app
        .persistence
        .write(WriteJob::DeleteMcpServer {
            tenant_id: caller.0.id.clone(),
            name,
        })
        .await?;
    ApiError::removed(removed, "MCP server")
}

/// The tools of the tenant's servers (`only` those named, when given: an agent's
/// `mcp_servers`), listed concurrently, and a notice for each server that did not answer.
pub async fn tools_of(
    app: &AppState,
    tenant_id: &str,
    only: Option<&[String]>,
) -> Result<(Vec<McpTool>, Vec<String>), ApiError> {
    let mut servers = app.store.mcp_servers(tenant_id).await?;
    if let Some(only) = only {
        servers.retain(|server| only.contains(&server.name));
    }
    let listed = futures::future::join_all(
        servers
            .iter()
            .map(|server| crate::mcp_client::list_tools(server, &app.mcp_http, LIST_TIMEOUT)),
    )
    .await;
    let mut tools = Vec::new();
    let mut notices = Vec::new();
    for (server, result) in servers.iter().zip(listed) {
        match result {
            Ok(found) => tools.extend(found),
            Err(why) => notices.push(format!(
                "[[SYSTEM: the MCP server {} ({}) could not be used when this conversation started ({why}); its tools are not available in it.]]",
                server.name, server.url
            )),
        }
    }
    Ok((tools, notices))
}
