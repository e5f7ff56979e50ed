//! The HTTP edge: REST, WebSocket and SSE per ../shared/api.md, on axum. The only layer that
//! knows the wire format of requests; every error leaves in the contract's shape.

mod auth;
mod conversations;
mod error;
mod images;
mod ops;
mod requests;
mod stream;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use tokio_util::sync::CancellationToken;

pub use auth::{hash_key, key_prefix, new_key};
pub use error::ApiError;

use crate::config::{AuthMode, Settings};
use crate::model::Tenant;
use crate::runtime::Services;

/// Name of the tenant that `dev` auth mode acts as.
pub const DEV_TENANT: &str = "default";

/// What every handler shares.
#[derive(Debug)]
pub struct AppInner {
    pub services: Arc<Services>,
    pub settings: Arc<Settings>,
    /// The tenant of requests without a key, in `dev` mode.
    pub dev_tenant: Option<Tenant>,
    /// The workspace root, canonical; tenants' cwds lie under `<root>/<tenant id>`.
    pub workspace_root: PathBuf,
    /// Tripped when the server starts shutting down; live streams close on it.
    pub shutdown: CancellationToken,
    keys: Mutex<HashMap<String, (Tenant, Instant)>>,
}

#[derive(Clone, Debug)]
pub struct AppState(Arc<AppInner>);

impl std::ops::Deref for AppState {
    type Target = AppInner;

    fn deref(&self) -> &AppInner {
        &self.0
    }
}

/// Whether `auth` in `settings` means dev mode on `listen`; refuses dev mode off loopback.
pub fn resolve_auth(mode: AuthMode, listen: SocketAddr) -> Result<bool, String> {
    let loopback = listen.ip().is_loopback();
    match mode {
        AuthMode::Required => Ok(false),
        AuthMode::Auto => Ok(loopback),
        AuthMode::Dev if loopback => Ok(true),
        AuthMode::Dev => Err(format!(
            "BEDROCK_AUTH=dev is only allowed on a loopback address, not {listen}: set BEDROCK_AUTH=required and create keys with `bedrock tenant create`"
        )),
    }
}

impl AppState {
    pub fn new(
        services: Arc<Services>,
        dev_tenant: Option<Tenant>,
        workspace_root: PathBuf,
        shutdown: CancellationToken,
    ) -> AppState {
        AppState(Arc::new(AppInner {
            settings: services.settings.clone(),
            services,
            dev_tenant,
            workspace_root,
            shutdown,
            keys: Mutex::new(HashMap::new()),
        }))
    }
}

/// The whole HTTP surface.
pub fn router(state: AppState) -> Router {
    let limit = state.settings.server.max_body_bytes;
    let v1 = Router::new()
        .route(
            "/conversations",
            post(conversations::create).get(conversations::list),
        )
        .route(
            "/conversations/{id}",
            get(conversations::get).delete(conversations::delete),
        )
        .route(
            "/conversations/{id}/messages",
            get(conversations::messages).post(conversations::send),
        )
        .route("/conversations/{id}/children", get(conversations::children))
        .route("/conversations/{id}/cancel", post(conversations::cancel))
        .route("/conversations/{id}/archive", post(conversations::archive))
        .route(
            "/conversations/{id}/unarchive",
            post(conversations::unarchive),
        )
        .route(
            "/conversations/{id}/events",
            post(conversations::system_event),
        )
        .route(
            "/conversations/{id}/requests/{request_id}",
            post(conversations::respond),
        )
        .route("/conversations/{id}/tasks", get(conversations::tasks))
        .route(
            "/conversations/{id}/tasks/{task_id}/cancel",
            post(conversations::cancel_task),
        )
        .route("/conversations/{id}/ws", get(stream::websocket))
        .route("/conversations/{id}/stream", get(stream::sse));
    Router::new()
        .nest("/v1", v1)
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .route("/openapi.json", get(ops::openapi))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(panicked))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not take that method",
    )
}

fn panicked(_: Box<dyn std::any::Any + Send + 'static>) -> axum::response::Response {
    tracing::error!("a request handler panicked");
    ApiError::internal("the server failed while handling this request").into_response()
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    /// Every route of the router, as OpenAPI spells it.
    const ROUTES: [(&str, &str); 20] = [
        ("post", "/v1/conversations"),
        ("get", "/v1/conversations"),
        ("get", "/v1/conversations/{id}"),
        ("delete", "/v1/conversations/{id}"),
        ("get", "/v1/conversations/{id}/messages"),
        ("post", "/v1/conversations/{id}/messages"),
        ("get", "/v1/conversations/{id}/children"),
        ("post", "/v1/conversations/{id}/cancel"),
        ("post", "/v1/conversations/{id}/archive"),
        ("post", "/v1/conversations/{id}/unarchive"),
        ("post", "/v1/conversations/{id}/events"),
        ("post", "/v1/conversations/{id}/requests/{request_id}"),
        ("get", "/v1/conversations/{id}/tasks"),
        ("post", "/v1/conversations/{id}/tasks/{task_id}/cancel"),
        ("get", "/v1/conversations/{id}/ws"),
        ("get", "/v1/conversations/{id}/stream"),
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/metrics"),
        ("get", "/openapi.json"),
    ];

    #[test]
    fn the_openapi_document_covers_every_route() {
        let doc: Value =
            serde_json::from_str(super::ops::OPENAPI).expect("docs/openapi.json is JSON");
        let paths = doc["paths"].as_object().expect("paths");
        for (method, path) in ROUTES {
            assert!(
                paths.get(path).and_then(|p| p.get(method)).is_some(),
                "{method} {path} is not documented"
            );
        }
        let documented: usize = paths
            .values()
            .map(|p| {
                p.as_object()
                    .map_or(0, |o| o.keys().filter(|k| *k != "parameters").count())
            })
            .sum();
        assert_eq!(
            documented, 20,
            "a documented route that the router does not have"
        );
    }
}
