//! The HTTP edge: REST, WebSocket and SSE per ../shared/api.md, on axum. The only layer that
//! knows the wire format of requests; every error leaves in the contract's shape.

pub(crate) mod agents;
mod auth;
mod client_tools;
mod cluster;
mod console;
mod continuation;
mod conversations;
mod delivery;
mod error;
mod fork;
pub mod guard;
mod images;
pub mod keys;
mod mcp;
mod mcp_servers;
mod openapi;
mod ops;
mod queue;
mod rate;
pub mod schedules;
mod stream;
mod trace;
mod usage;
mod webhooks;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use tokio_util::sync::CancellationToken;
use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use auth::{hash_key, key_prefix, new_key};
/// The check of a client's system event (the fuzz target `request_bodies`).
#[doc(hidden)]
pub use delivery::check_client_event;
pub use error::ApiError;
/// Image validation and resizing of user messages (the fuzz target `image`).
#[doc(hidden)]
pub use images::{Prepared, prepare as prepare_image};

use crate::config::{AuthMode, Settings};
use crate::egress::{Client, Egress};
use crate::hub::EventHub;
use crate::metrics::Metrics;
use crate::model::Tenant;
use crate::node::Cluster;
use crate::persistence::Persistence;
use crate::quotas::Quotas;
use crate::runtime::{BackgroundTasks, Conversations, Runtime};
use crate::sandbox::Sandbox;
use crate::store::Store;
use crate::workspace::Workspaces;

/// Name of the tenant that `dev` auth mode acts as.
pub const DEV_TENANT: &str = "default";

/// What every handler shares: the handles of the runtime the HTTP layer uses, and its own.
#[derive(Debug)]
pub struct AppInner {
    pub settings: Arc<Settings>,
    /// Reads; writes go through `persistence`.
    pub store: Store,
    pub persistence: Persistence,
    /// Frames of conversations to clients.
    pub hub: Arc<EventHub>,
    /// The one door into a conversation.
    pub conversations: Conversations,
    pub quotas: Arc<Quotas>,
    pub background: Arc<BackgroundTasks>,
    pub metrics: Arc<Metrics>,
    /// The tool sandbox (`None`: `sandbox.mode = off`).
    pub sandbox: Option<Arc<Sandbox>>,
    pub workspaces: Arc<Workspaces>,
    /// What the server may connect to on a tenant's behalf (its MCP servers).
    pub egress: Egress,
    /// The HTTP client of calls to tenants' MCP servers, under `egress`.
    pub mcp_http: Client,
    /// This node of a cluster (Postgres); `None`: the only node.
    pub cluster: Option<Arc<Cluster>>,
    /// The tenant of requests without a key, in `dev` mode.
    pub dev_tenant: Option<Tenant>,
    /// The workspace root, canonical; tenants' cwds lie under `<root>/<tenant id>`.
    pub workspace_root: PathBuf,
    /// Tripped when the server starts shutting down; live streams close on it.
    pub shutdown: CancellationToken,
    keys: Mutex<HashMap<String, (Tenant, Instant)>>,
    /// Request rates per API key.
    pub rate: rate::RateLimits,
    /// The checks of `Host` and `Origin` (guard.rs).
    pub guard: guard::Guard,
    /// Which API key opened each MCP session (mcp.rs).
    pub mcp_sessions: mcp::Owners,
    /// MCP calls of the 2026-07-28 protocol waiting for the client's next round.
    pub mcp_rounds: mcp::Rounds,
    /// The tenants with webhooks (an endpoint made here counts at once).
    pub webhooks: Arc<crate::webhooks::Subscribers>,
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
        runtime: &Runtime,
        dev_tenant: Option<Tenant>,
        workspace_root: PathBuf,
        shutdown: CancellationToken,
    ) -> AppState {
        let settings = runtime.settings.clone();
        let rate = rate::RateLimits::new(settings.rate_limits.clone());
        let guard = guard::Guard::new(&settings, dev_tenant.is_some());
        AppState(Arc::new(AppInner {
            guard,
            mcp_sessions: mcp::Owners::default(),
            mcp_rounds: mcp::Rounds::default(),
            settings,
            store: runtime.store.clone(),
            persistence: runtime.persistence.clone(),
            hub: runtime.hub.clone(),
            conversations: runtime.conversations.clone(),
            quotas: runtime.quotas.clone(),
            background: runtime.background.clone(),
            metrics: runtime.metrics.clone(),
            sandbox: runtime.tool_limits.sandbox.clone(),
            workspaces: runtime.tool_limits.workspaces.clone(),
            egress: runtime.egress.clone(),
            mcp_http: runtime.mcp_http.clone(),
            webhooks: runtime.webhooks.clone(),
            cluster: runtime.cluster.clone(),
            dev_tenant,
            workspace_root,
            shutdown,
            keys: Mutex::new(HashMap::new()),
            rate,
        }))
    }
}

/// The whole HTTP surface.
pub fn router(state: AppState) -> Router {
    let api = api_router(state.clone());
    // MCP at /mcp (docs/api.md, "MCP"): its tools call the REST API above.
    let mcp = Router::new()
        .nest_service("/mcp", mcp::service(state.clone(), api.clone()))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            mcp::authenticate,
        ));
    // Host (dev mode) and Origin over everything (guard.rs).
    api.merge(mcp)
        .layer(axum::middleware::from_fn_with_state(state, guard::check))
}

/// The REST API and the console without the outer checks of Host and Origin: what MCP's
/// tools and schedules' firings call in process.
pub fn api_router(state: AppState) -> Router {
    let limit = state.settings.server.max_body_bytes;
    let (router, _) = routes().split_for_parts();
    router
        // The web console (not part of the API, so not in the OpenAPI document).
        .route("/", axum::routing::get(console::index))
        .route("/console/{*file}", axum::routing::get(console::asset))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            cluster::forward,
        ))
        .layer(DefaultBodyLimit::max(limit))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(panicked))
        .with_state(state)
}

/// The operator listener (`[metrics] listen`): metrics and this node's details, without
/// keys. Not part of the API.
pub fn operator_router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", axum::routing::get(ops::metrics))
        .route("/status", axum::routing::get(ops::status))
        .route(
            "/admin/tenants/{name}/keys",
            axum::routing::get(ops::admin_list_keys).post(ops::admin_create_key),
        )
        .route(
            "/admin/tenants/{name}/keys/{key}",
            axum::routing::delete(ops::admin_revoke_key),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Every route with its OpenAPI operation: the router and the document come from the same
/// registrations, so neither has a route the other lacks.
fn routes() -> OpenApiRouter<AppState> {
    use conversations as c;
    let v1 = OpenApiRouter::new()
        .routes(routes!(c::create, c::list))
        .routes(routes!(c::get, c::delete))
        .routes(routes!(c::messages, c::send))
        .routes(routes!(c::children))
        .routes(routes!(c::image))
        .routes(routes!(fork::fork))
        .routes(routes!(continuation::continue_conversation))
        .routes(routes!(c::cancel))
        .routes(routes!(c::archive))
        .routes(routes!(c::unarchive))
        .routes(routes!(c::system_event))
        .routes(routes!(c::respond))
        .routes(routes!(client_tools::tool_result))
        .routes(routes!(client_tools::calls))
        .routes(routes!(queue::list, queue::take_all))
        .routes(routes!(queue::take_one))
        .routes(routes!(trace::list))
        .routes(routes!(c::tasks))
        .routes(routes!(c::cancel_task))
        .routes(routes!(stream::websocket))
        .routes(routes!(stream::sse))
        .routes(routes!(usage::usage))
        .routes(routes!(mcp_servers::create, mcp_servers::list))
        .routes(routes!(mcp_servers::delete))
        .routes(routes!(agents::create, agents::list))
        .routes(routes!(agents::import))
        .routes(routes!(agents::export))
        .routes(routes!(agents::get, agents::change, agents::delete))
        .routes(routes!(agents::versions))
        .routes(routes!(agents::version))
        .routes(routes!(webhooks::create, webhooks::list))
        .routes(routes!(webhooks::get, webhooks::update, webhooks::delete))
        .routes(routes!(webhooks::rotate_secret))
        .routes(routes!(webhooks::deliveries))
        .routes(routes!(webhooks::retry))
        .routes(routes!(schedules::create, schedules::list))
        .routes(routes!(schedules::get, schedules::delete))
        .routes(routes!(schedules::pause))
        .routes(routes!(schedules::resume))
        .routes(routes!(schedules::runs));
    OpenApiRouter::with_openapi(openapi::Document::openapi())
        .nest("/v1", v1)
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::public_metrics))
        .routes(routes!(ops::openapi))
}

/// The OpenAPI document of the API, derived from the routes and the wire types.
pub fn openapi_document() -> utoipa::openapi::OpenApi {
    let (_, document) = routes().split_for_parts();
    openapi::finish(document)
}

/// [`openapi_document`] as JSON, made once: what `/openapi.json` serves and
/// docs/openapi.json holds.
pub fn openapi_json() -> &'static str {
    ops::OPENAPI.as_str()
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
