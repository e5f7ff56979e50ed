//! Ops routes: no /v1 prefix, no auth.

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::AppState;

/// The OpenAPI document of the API (docs/openapi.json).
pub const OPENAPI: &str = include_str!("../../docs/openapi.json");

pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn readyz(State(app): State<AppState>) -> Response {
    let sandbox = match &app.services.tool_limits.sandbox {
        Some(sandbox) => sandbox.describe(),
        None => json!({
            "mode": "off",
            "warning": "sandbox.mode is off: tool processes run unconfined, with the server's view of the filesystem and network",
        }),
    };
    match app.services.store.ping().await {
        Ok(()) => {
            Json(json!({"status": "ready", "database": "ok", "sandbox": sandbox})).into_response()
        }
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unavailable", "database": e.to_string(), "sandbox": sandbox})),
        )
            .into_response(),
    }
}

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

pub async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}
