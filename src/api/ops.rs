//! Ops routes: no /v1 prefix, no auth. `/healthz`, `/readyz` and `/openapi.json` are on the
//! public listener; `/metrics` and `/status` on the operator listener (`[metrics] listen`).

use std::sync::LazyLock;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::AppState;
use super::error::{ApiError, reply};
use crate::wire::{Health, Ready};

/// The OpenAPI document as served (and as docs/openapi.json holds it), made once.
pub static OPENAPI: LazyLock<String> = LazyLock::new(|| {
    let mut text = super::openapi_document()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"the document did not serialise: {e}\"}}"));
    text.push('\n');
    text
});

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "Up", body = Health)))]
pub async fn healthz() -> Response {
    reply(StatusCode::OK, &Health { status: "ok" })
}

/// Whether tool processes are confined, as the public `/readyz` says it: the mode, and the
/// warning when they are not. The details (Landlock ABI, the tools' user) are the operator
/// listener's (`GET /status`).
fn sandbox_mode(app: &AppState) -> serde_json::Value {
    match &app.sandbox {
        Some(_) => json!({"mode": "enforce"}),
        None => json!({
            "mode": "off",
            "warning": "sandbox.mode is off: tool processes run unconfined, with the server's view of the filesystem and network",
        }),
    }
}

/// The node's id and the leases it holds, on a cluster whose database answers.
async fn node_info(app: &AppState, ready: bool) -> Option<crate::wire::NodeInfo> {
    let cluster = app.cluster.as_ref().filter(|_| ready)?;
    Some(crate::wire::NodeInfo {
        id: cluster.node_id.clone(),
        conversations_owned: app.store.owned_count(cluster.node()).await.unwrap_or(0),
    })
}

/// The database answers (and whether tool processes are confined).
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "Ready", body = Ready),
        (status = 503, description = "The database does not answer", body = Ready),
    ))]
pub async fn readyz(State(app): State<AppState>) -> Response {
    let sandbox = sandbox_mode(&app);
    let ready = match app.store.ping().await {
        Ok(()) => true,
        Err(error) => {
            // Why stays in the log: the public answer says only which check failed.
            tracing::warn!(%error, "readyz: the database does not answer");
            false
        }
    };
    let node = node_info(&app, ready).await;
    if ready {
        reply(
            StatusCode::OK,
            &Ready {
                status: "ready",
                database: "ok".to_owned(),
                sandbox,
                node,
            },
        )
    } else {
        reply(
            StatusCode::SERVICE_UNAVAILABLE,
            &Ready {
                status: "unavailable",
                database: "unavailable".to_owned(),
                sandbox,
                node,
            },
        )
    }
}

/// The operator listener's `GET /status`: what `/readyz` says, with the sandbox's details
/// and the database's error, if any.
pub async fn status(State(app): State<AppState>) -> Response {
    let sandbox = match &app.sandbox {
        Some(sandbox) => sandbox.describe(),
        None => sandbox_mode(&app),
    };
    let database = match app.store.ping().await {
        Ok(()) => Ok(()),
        Err(e) => Err(e.to_string()),
    };
    let node = node_info(&app, database.is_ok()).await;
    reply(
        if database.is_ok() {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        &json!({
            "status": if database.is_ok() { "ready" } else { "unavailable" },
            "database": database.err().unwrap_or_else(|| "ok".to_owned()),
            "sandbox": sandbox,
            "node": node,
        }),
    )
}

/// The node's metrics in the Prometheus text format, as the contract has them on the public
/// port, without what one tenant must not learn of another: every series labelled with a
/// tenant is left out (the operator listener's `/metrics` has them all).
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text format, without series per tenant (those are on the operator listener, `[metrics] listen`)", content_type = "text/plain", body = String)))]
pub async fn public_metrics(State(app): State<AppState>) -> Response {
    let text = encoded(&app);
    let public: String = text
        .lines()
        .filter(|line| line.starts_with('#') || !line.contains("tenant=\""))
        .flat_map(|line| [line, "\n"])
        .collect();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        public,
    )
        .into_response()
}

fn encoded(app: &AppState) -> String {
    let metrics = &app.metrics;
    metrics.gauges(app.conversations.running().len(), app.store.pool_size());
    metrics.encode()
}

/// Metrics in the Prometheus text format (the operator listener's `GET /metrics`).
pub async fn metrics(State(app): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        encoded(&app),
    )
        .into_response()
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "The OpenAPI document", content_type = "application/json", body = Object)))]
pub async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        OPENAPI.as_str(),
    )
        .into_response()
}

/// The admin API's check: `Authorization: Bearer <metrics.admin_token>`; without a token
/// configured there is no admin API (404).
fn admin(app: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    use secrecy::ExposeSecret as _;
    use sha2::Digest as _;
    let token = app.settings.metrics.admin_token.expose_secret();
    if token.is_empty() {
        return Err(ApiError::not_found("route"));
    }
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    // Compared as digests, so the time taken says nothing of the token.
    if sha2::Sha256::digest(given.as_bytes()) != sha2::Sha256::digest(token.as_bytes()) {
        return Err(ApiError::unauthorized("the admin token is not valid"));
    }
    Ok(())
}

/// A key command's refusal as the API says it: a missing tenant or key is 404.
fn admin_error(error: super::keys::KeyError) -> ApiError {
    match error {
        super::keys::KeyError::NotFound(message) => {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
        }
        super::keys::KeyError::Store(error) => error.into(),
    }
}

/// `GET /admin/tenants/{name}/keys`: as `bedrock tenant key list NAME`.
pub async fn admin_list_keys(
    State(app): State<AppState>,
    headers: HeaderMap,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Result<Response, ApiError> {
    admin(&app, &headers)?;
    let keys = super::keys::list_keys_in(&app.store, &name)
        .await
        .map_err(admin_error)?;
    Ok(axum::Json(keys).into_response())
}

/// `POST /admin/tenants/{name}/keys`: as `bedrock tenant key create NAME` (the key, once).
pub async fn admin_create_key(
    State(app): State<AppState>,
    headers: HeaderMap,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Result<Response, ApiError> {
    admin(&app, &headers)?;
    let key = super::keys::create_key_in(&app.store, &name)
        .await
        .map_err(admin_error)?;
    Ok((StatusCode::CREATED, axum::Json(key)).into_response())
}

/// `DELETE /admin/tenants/{name}/keys/{key}`: as `bedrock tenant key revoke NAME KEY`.
pub async fn admin_revoke_key(
    State(app): State<AppState>,
    headers: HeaderMap,
    axum::extract::Path((name, key)): axum::extract::Path<(String, String)>,
) -> Result<Response, ApiError> {
    admin(&app, &headers)?;
    let revoked = super::keys::revoke_key_in(&app.store, &name, &key)
        .await
        .map_err(admin_error)?;
    Ok(axum::Json(revoked).into_response())
}
