//! Ops routes: no /v1 prefix, no auth.

use std::sync::LazyLock;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::AppState;
use super::error::reply;
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

/// The database answers (and how tool processes are confined).
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "Ready", body = Ready),
        (status = 503, description = "The database does not answer", body = Ready),
    ))]
pub async fn readyz(State(app): State<AppState>) -> Response {
    let sandbox = match &app.services.tool_limits.sandbox {
        Some(sandbox) => sandbox.describe(),
        None => json!({
            "mode": "off",
            "warning": "sandbox.mode is off: tool processes run unconfined, with the server's view of the filesystem and network",
        }),
    };
    let ready = match app.services.store.ping().await {
        Ok(()) => Ok(()),
        Err(e) => Err(e.to_string()),
    };
    let node = match (&app.services.cluster, &ready) {
        (Some(cluster), Ok(())) => Some(crate::wire::NodeInfo {
            id: cluster.node_id.clone(),
            conversations_owned: app
                .services
                .store
                .owned_count(cluster.node())
                .await
                .unwrap_or(0),
        }),
        _ => None,
    };
    match ready {
        Ok(()) => reply(
            StatusCode::OK,
            &Ready {
                status: "ready",
                database: "ok".to_owned(),
                sandbox,
                node,
            },
        ),
        Err(database) => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            &Ready {
                status: "unavailable",
                database,
                sandbox,
                node,
            },
        ),
    }
}

/// Metrics in the Prometheus text format.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain", body = String)))]
pub async fn metrics(State(app): State<AppState>) -> Response {
    let metrics = &app.services.metrics;
    metrics.gauges(
        app.services.registry.running().len(),
        app.services.store.pool_size(),
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics.encode(),
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
