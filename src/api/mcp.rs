//! Bedrock as an MCP server (Model Context Protocol, streamable HTTP) at `/mcp`: agents and
//! MCP clients drive conversations with five tools. Built on `rmcp`, the official SDK; no
//! JSON-RPC is written here.
//!
//! Each tool is the REST route of the same name, called in process through the server's
//! own router with the MCP request's `Authorization` header. Keys, tenant isolation (another
//! tenant's conversation is "not found"), validation, errors and cluster forwarding are
//! therefore exactly the REST API's. An API error comes back as a tool result with
//! `isError`, saying its code and message.
//!
//! `send_message` runs one turn. It follows the conversation's frames while the turn runs:
//! - state changes and tool progress go out as MCP progress notifications;
//! - a server-to-client request (confirm, prompt, select, custom, or an approval) goes to a
//!   client that declared elicitation as an elicitation form, and the answer is posted as the
//!   request's reply. Both protocol eras are served, each its own way:
//!   - 2025-11-25 and older (`initialize`, a session): an `elicitation/create` sent on the
//!     call's stream, in the middle of the call;
//!   - 2026-07-28 (`server/discover`, no session): the call answers with an input-required
//!     result (SEP-2322) carrying the elicitations and a `requestState`, and the client
//!     retries the call with the answers and that state; the turn goes on meanwhile, and the
//!     retry follows it on (see [`Rounds`]);
//! - without that capability, the request goes out as a notification naming it, and the
//!   client answers with the `respond` tool.
//!
//! Either way it is the same stored request a WebSocket client sees, answered once. When the
//! turn ends, the tool returns the agent's final text, with the tool calls of the turn as
//! structured content. A cancelled MCP request cancels the turn: `notifications/cancelled`,
//! or on 2026-07-28 the call's response stream closed by the client.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRequestParts as _, State};
use axum::http::request::Parts;
use axum::http::{Method, Request, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::{Extension, InputResponses as Answers, RequestState};
use rmcp::handler::server::wrapper::Parameters;
// Logging notifications carry the fallback of a request for a client without elicitation:
// every client shows them. SEP-2577 deprecates them for a protocol after 2025-11-25; the same
// text goes out as a progress notification too.
use rmcp::model::{
    CallToolResponse, CallToolResult, ContentBlock, ElicitRequest, ElicitRequestParams,
    ElicitResult, ElicitationAction, ElicitationSchema, Implementation, InputRequest,
    InputRequests, InputRequiredResult, InputResponses as ModelInputResponses,
    ProgressNotificationParam, ProtocolVersion, ServerCapabilities, ServerConfig,
};
#[allow(deprecated)]
use rmcp::model::{LoggingLevel, LoggingMessageNotificationParam};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler, schemars, tool, tool_handler, tool_router};
use serde::Deserialize;
use serde_json::{Value, json};
use tower::ServiceExt as _;

use super::AppState;

/// The MCP service, to nest at `/mcp`; `api` is the REST router its tools call.
pub fn service(
    app: AppState,
    api: Router,
) -> StreamableHttpService<BedrockMcp, LocalSessionManager> {
    // Host (dev mode) and Origin are checked for every route by `guard`, with the contract's
    // errors and `server.public_host` / `allowed_origins`; rmcp's own checks would refuse
    // what those settings allow.
    let config = StreamableHttpServerConfig::default()
        .with_cancellation_token(app.shutdown.child_token())
        .disable_allowed_hosts()
        .disable_allowed_origins();
    let sessions = Arc::new(LocalSessionManager::default());
    let _ = app.mcp_sessions.manager.set(sessions.clone());
    StreamableHttpService::new(
        move || Ok(BedrockMcp::new(app.clone(), api.clone())),
        sessions,
        config,
    )
}

/// The API key (its hash; dev mode's bucket for requests without one) that opened each MCP
/// session: a session answers only to it.
#[derive(Debug, Default)]
pub struct Owners {
    owners: Mutex<(HashMap<String, String>, usize)>,
    manager: OnceLock<Arc<LocalSessionManager>>,
}

impl Owners {
    fn owner(&self, session: &str) -> Option<String> {
        let owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        owners.0.get(session).cloned()
    }

    async fn bind(&self, session: String, key: String) {
        let prune = {
            let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
            owners.0.insert(session, key);
            owners.0.len() >= owners.1.max(1024)
        };
        // Sessions rmcp ended by itself (expired, closed) go from the map now and then.
        if prune && let Some(manager) = self.manager.get() {
            let live: HashSet<String> = manager
                .sessions
                .read()
                .await
                .keys()
                .map(|id| id.to_string())
                .collect();
            let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
            owners.0.retain(|id, _| live.contains(id));
            owners.1 = owners.0.len() * 2;
        }
    }

    fn forget(&self, session: &str) {
        let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        owners.0.remove(session);
    }
}

/// How long a round waits for the client's retry after its longest question expired (by
/// then the turn has gone on without the answer; the retry still follows it to its end).
const ROUND_GRACE: Duration = Duration::from_secs(300);

/// Expired rounds one `put` or `take` forgets at most; the rest go at the next.
const SWEEP_BATCH: usize = 256;

/// The calls of the 2026-07-28 protocol that wait for the client's next round (SEP-2322).
///
/// A `send_message` whose turn asks the client something answers with an input-required
/// result, and the client retries the call with the answers and the `requestState` it was
/// given. That state comes back from the client and is not trusted: it is only a handle (256
/// random bits) to the round kept here, which holds what the retry needs: the API key that
/// made the call (and its tenant), the conversation, the turn (its user message), and the
/// questions. It holds no subscription: a waiting round costs the conversation nothing (it
/// may rest, and no node hears of a client for it); the retry subscribes again and reads the
/// requests still pending from the store. A handle is good for the key that made the call and
/// the conversation it named, until the round expires, and is used up once the retry's
/// answers are posted (a retry refused for its answers, or failing inside, leaves the round
/// as it was). Anything else (a forged, replayed or expired handle, another key's, another
/// conversation's) is the same invalid-params error, which does not say whether the handle
/// exists, and the round is left as it was.
///
/// Rounds expire when their longest question does (at most `requests.max_timeout_ms` away)
/// and [`ROUND_GRACE`] later; expired ones are forgotten as rounds are put and taken. A key,
/// a tenant and the node keep at most `[mcp] rounds_per_key`, `rounds_per_tenant` and
/// `rounds_per_node`; past one, the oldest round of that key, tenant or node is dropped.
#[derive(Default)]
pub struct Rounds {
    waiting: Mutex<Waiting>,
}

impl std::fmt::Debug for Rounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let waiting = self.waiting.lock().map_or(0, |w| w.rounds.len());
        f.debug_struct("Rounds").field("waiting", &waiting).finish()
    }
}

/// The rounds kept, and their indexes: by age (a round's number, lower is older) for the
/// node, each key and each tenant, and by expiry.
#[derive(Default)]
struct Waiting {
    rounds: HashMap<String, Kept>,
    oldest: BTreeMap<u64, String>,
    by_key: HashMap<String, BTreeMap<u64, String>>,
    by_tenant: HashMap<String, BTreeMap<u64, String>>,
    expiries: BTreeSet<(Instant, u64)>,
    /// The next round's number.
    next: u64,
}

/// A round as kept: its number (its age) and its expiry.
struct Kept {
    number: u64,
    expires: Instant,
    round: Round,
}

/// How many rounds a key, a tenant and the node may keep (`[mcp]`).
#[derive(Clone, Copy, Debug)]
struct Caps {
    per_key: usize,
    per_tenant: usize,
    per_node: usize,
}

impl Caps {
    fn of(settings: &crate::config::Settings) -> Caps {
        let cap = |n: u64| usize::try_from(n).unwrap_or(usize::MAX).max(1);
        Caps {
            per_key: cap(settings.mcp.rounds_per_key),
            per_tenant: cap(settings.mcp.rounds_per_tenant),
            per_node: cap(settings.mcp.rounds_per_node),
        }
    }
}

/// A call that answered with an input-required result, until the client's retry.
#[derive(Clone, Debug)]
struct Round {
    /// The API key (its hash; dev mode's bucket) that made the call.
    key: String,
    /// The key's tenant.
    tenant: String,
    /// The conversation's id.
    conversation: String,
    /// The conversation's REST path.
    path: String,
    /// The sequence id of the call's user message: the turn.
    after: u64,
    /// The questions put to the client (pending requests, as the store has them).
    asks: Vec<Value>,
    /// The requests already put to the client in this call.
    asked: HashSet<String>,
    /// Progress notifications sent so far.
    progress: u32,
}

/// A round taken for a retry: what gives it back under its handle if the retry fails.
struct Taken {
    handle: String,
    number: u64,
    expires: Instant,
}

impl Waiting {
    fn remove(&mut self, handle: &str) -> Option<Kept> {
        let kept = self.rounds.remove(handle)?;
        self.oldest.remove(&kept.number);
        for (index, owner) in [
            (&mut self.by_key, &kept.round.key),
            (&mut self.by_tenant, &kept.round.tenant),
        ] {
            if let Some(rounds) = index.get_mut(owner) {
                rounds.remove(&kept.number);
                if rounds.is_empty() {
                    index.remove(owner);
                }
            }
        }
        self.expiries.remove(&(kept.expires, kept.number));
        Some(kept)
    }

    /// Forgets expired rounds, at most [`SWEEP_BATCH`] of them.
    fn sweep(&mut self, now: Instant) {
        for _ in 0..SWEEP_BATCH {
            let Some(&(at, number)) = self.expiries.first() else {
                return;
            };
            if at > now {
                return;
            }
            self.expiries.pop_first();
            if let Some(handle) = self.oldest.get(&number).cloned() {
                self.remove(&handle);
            }
        }
    }

    /// Drops the oldest rounds of the node, then of the round's tenant and key, until one
    /// more fits under each cap.
    fn make_room(&mut self, caps: Caps, key: &str, tenant: &str) {
        while self.rounds.len() >= caps.per_node {
            let Some(handle) = self.oldest.values().next().cloned() else {
                break;
            };
            self.remove(&handle);
        }
        for (cap, by_tenant, owner) in [(caps.per_tenant, true, tenant), (caps.per_key, false, key)]
        {
            loop {
                let index = if by_tenant {
                    &self.by_tenant
                } else {
                    &self.by_key
                };
                let Some(rounds) = index.get(owner).filter(|r| r.len() >= cap) else {
                    break;
                };
                let Some(handle) = rounds.values().next().cloned() else {
                    break;
                };
                self.remove(&handle);
            }
        }
    }

    fn insert(&mut self, handle: String, kept: Kept) {
        let number = kept.number;
        self.oldest.insert(number, handle.clone());
        self.by_key
            .entry(kept.round.key.clone())
            .or_default()
            .insert(number, handle.clone());
        self.by_tenant
            .entry(kept.round.tenant.clone())
            .or_default()
            .insert(number, handle.clone());
        self.expiries.insert((kept.expires, number));
        self.rounds.insert(handle, kept);
    }
}

impl Rounds {
    fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps a round until the client's retry or `expires`; its handle, the `requestState`.
    fn put(&self, caps: Caps, round: Round, expires: Instant) -> String {
        let handle = format!("bkr_{}", hex::encode(rand::random::<[u8; 32]>()));
        let mut waiting = self.waiting();
        waiting.sweep(Instant::now());
        waiting.make_room(caps, &round.key, &round.tenant);
        let number = waiting.next;
        waiting.next += 1;
        waiting.insert(
            handle.clone(),
            Kept {
                number,
                expires,
                round,
            },
        );
        handle
    }

    /// Gives a taken round back under its handle, as it was (its age and expiry), for a
    /// retry that failed before it was done with it.
    fn restore(&self, caps: Caps, taken: Taken, round: Round) {
        let mut waiting = self.waiting();
        let now = Instant::now();
        waiting.sweep(now);
        if taken.expires <= now {
            return;
        }
        waiting.make_room(caps, &round.key, &round.tenant);
        waiting.insert(
            taken.handle,
            Kept {
                number: taken.number,
                expires: taken.expires,
                round,
            },
        );
    }

    /// The round a retried call names, if it is this key's, for this conversation, and
    /// still waiting; it is the call's from then on (see [`Rounds::restore`]).
    fn take(
        &self,
        handle: &str,
        key: &str,
        conversation: &str,
    ) -> Result<(Round, Taken), ErrorData> {
        let mut waiting = self.waiting();
        let now = Instant::now();
        waiting.sweep(now);
        let fits = waiting.rounds.get(handle).is_some_and(|kept| {
            kept.expires > now && kept.round.key == key && kept.round.conversation == conversation
        });
        // Another caller's attempt leaves the round to its owner.
        if fits && let Some(kept) = waiting.remove(handle) {
            let taken = Taken {
                handle: handle.to_owned(),
                number: kept.number,
                expires: kept.expires,
            };
            return Ok((kept.round, taken));
        }
        Err(ErrorData::invalid_params(
            "requestState is not valid: this server did not give it to this caller for this conversation's send_message, or it was used already, or it expired. The turn goes on: read it with get_messages, or cancel it",
            None,
        ))
    }
}

/// When a round expires: [`ROUND_GRACE`] after its longest question does, as the store has
/// it (not a new full timeout at each round), and never more than `max` (the longest a
/// request may wait) and the grace from now.
fn round_expiry(asks: &[Value], max: Duration) -> Instant {
    let now = Instant::now();
    let wall = chrono::Utc::now();
    let longest = asks
        .iter()
        .map(|ask| {
            match ask["expires_at"]
                .as_str()
                .and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok())
            {
                // Past already: the grace alone.
                Some(at) => (at.with_timezone(&chrono::Utc) - wall)
                    .to_std()
                    .unwrap_or(Duration::ZERO),
                None => ask["timeout_ms"]
                    .as_u64()
                    .map_or(max, Duration::from_millis),
            }
        })
        .max()
        .unwrap_or(Duration::ZERO)
        .min(max);
    now.checked_add(longest.saturating_add(ROUND_GRACE))
        .or_else(|| now.checked_add(ROUND_GRACE))
        .unwrap_or(now)
}

/// rmcp's answer to an unknown session, which another key's session looks like.
fn unknown_session() -> Response {
    let mut response = Response::new(Body::from("Not Found: Session not found"));
    *response.status_mut() = StatusCode::NOT_FOUND;
    response
}

/// The MCP server of one session.
#[derive(Clone)]
pub struct BedrockMcp {
    app: AppState,
    /// The REST API, without `/mcp`.
    api: Router,
    tool_router: ToolRouter<Self>,
}

/// Who makes an MCP request: its API key (hash) and tenant, found once by [`authenticate`].
#[derive(Clone, Debug)]
struct McpCaller {
    key: String,
    tenant_id: String,
}

/// `/mcp` takes the REST API's keys: a request without a valid one is refused with 401 in
/// the contract's shape before MCP sees it (and counts against the key's rate). A session
/// belongs to the key that opened it: with another key its id is unknown (404), for GET,
/// POST and DELETE alike.
pub async fn authenticate(
    State(app): State<AppState>,
    request: Request<Body>,
    next: Next,
) -> Response {
    let (mut parts, body) = request.into_parts();
    let tenant_id = match super::auth::Caller::from_request_parts(&mut parts, &app).await {
        Ok(super::auth::Caller(tenant)) => tenant.id,
        Err(error) => return error.into_response(),
    };
    let key = match super::auth::Credential::from_request_parts(&mut parts, &app).await {
        Ok(credential) => super::auth::key_id(&credential),
        Err(error) => return error.into_response(),
    };
    // The tools read who calls from here (authenticating again would count the request
    // against the key's rate twice).
    parts.extensions.insert(McpCaller {
        key: key.clone(),
        tenant_id,
    });
    let session = parts
        .headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if let Some(session) = &session
        && app
            .mcp_sessions
            .owner(session)
            .is_some_and(|owner| owner != key)
    {
        return unknown_session();
    }
    let method = parts.method.clone();
    let response = next.run(Request::from_parts(parts, body)).await;
    match &session {
        None => {
            if let Some(new) = response
                .headers()
                .get(SESSION_HEADER)
                .and_then(|v| v.to_str().ok())
            {
                app.mcp_sessions.bind(new.to_owned(), key).await;
            }
        }
        Some(session) if method == Method::DELETE && response.status().is_success() => {
            app.mcp_sessions.forget(session);
        }
        Some(_) => {}
    }
    response
}

/// The header that names an MCP session.
const SESSION_HEADER: &str = "mcp-session-id";

impl std::fmt::Debug for BedrockMcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BedrockMcp").finish_non_exhaustive()
    }
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct CreateArgs {
    /// The working directory, relative to the tenant's workspace (default: its own).
    pub cwd: Option<String>,
    /// The model (default: the server's).
    pub model: Option<String>,
    /// Instructions added to the agent's system prompt.
    pub system_prompt: Option<String>,
    /// A name: 1 to 64 characters of a-z, 0-9, `-` and `_`.
    pub slug: Option<String>,
    /// An agent of the tenant's to create it from: `name` (its latest version) or
    /// `name@N`. With it, only cwd and slug may be given.
    pub agent: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SendArgs {
    /// The conversation's id or slug.
    pub conversation_id: String,
    /// The user's message.
    pub text: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ConversationArgs {
    /// The conversation's id or slug.
    pub conversation_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct MessagesArgs {
    /// The conversation's id or slug.
    pub conversation_id: String,
    /// Only messages after this sequence id (default 0).
    pub after: Option<u64>,
    /// At most this many (1 to 1000, default 100).
    pub limit: Option<u32>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RespondArgs {
    /// The conversation's id or slug.
    pub conversation_id: String,
    /// A request's id, as its notification named it (with `payload`).
    #[serde(default)]
    pub request_id: Option<String>,
    /// The reply to the request: `{"confirmed": bool}`, `{"text": s}`,
    /// `{"selected": [values]}`, `{"custom": any}` or `{"cancelled": true}`.
    #[serde(default)]
    pub payload: Option<Value>,
    /// Or a client tool call's id, as its notification named it (with `output`).
    #[serde(default)]
    pub call_id: Option<String>,
    /// The client tool's result, as the agent gets it.
    #[serde(default)]
    pub output: Option<String>,
    /// The client tool failed.
    #[serde(default)]
    pub is_error: Option<bool>,
}

/// An API answer that is not a success, as a tool result the model can read.
fn api_error(status: u16, body: &Value) -> CallToolResult {
    let code = body["error"]["code"].as_str().unwrap_or("error");
    let message = body["error"]["message"]
        .as_str()
        .map_or_else(|| format!("HTTP {status}"), str::to_owned);
    CallToolResult::error(vec![ContentBlock::text(format!("{code}: {message}"))])
}

/// A successful API answer as a tool result: a line of text and the JSON as structured
/// content.
fn structured(text: String, body: Value) -> CallToolResult {
    let mut result = CallToolResult::structured(body);
    result.content = vec![ContentBlock::text(text)];
    result
}

fn internal(what: impl std::fmt::Display) -> ErrorData {
    ErrorData::internal_error(what.to_string(), None)
}

/// A path segment, escaped.
fn segment(text: &str) -> String {
    url::form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

impl BedrockMcp {
    fn new(app: AppState, api: Router) -> Self {
        Self {
            app,
            api,
            tool_router: Self::tool_router(),
        }
    }

    /// The API key (its hash; dev mode's bucket) of the MCP request, and its tenant's id, as
    /// [`authenticate`] found them.
    fn caller(parts: &Parts) -> Result<(String, String), ErrorData> {
        parts
            .extensions
            .get::<McpCaller>()
            .map(|caller| (caller.key.clone(), caller.tenant_id.clone()))
            .ok_or_else(|| ErrorData::invalid_request("the request's key cannot be read", None))
    }

    /// Calls the REST API in process, as the MCP request's key: (status, body).
    async fn rest(
        &self,
        parts: &Parts,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), ErrorData> {
        let router = self.api.clone();
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(key) = parts.headers.get(header::AUTHORIZATION) {
            request = request.header(header::AUTHORIZATION, key);
        }
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let request = request.body(Body::from(body)).map_err(internal)?;
        let response = router.oneshot(request).await.map_err(internal)?;
        let status = response.status().as_u16();
        let bytes = axum::body::to_bytes(response.into_body(), 64 << 20)
            .await
            .map_err(internal)?;
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }

    /// A REST call whose success is the tool's result.
    async fn call(
        &self,
        parts: &Parts,
        method: Method,
        path: &str,
        body: Option<Value>,
        text: impl FnOnce(&Value) -> String,
    ) -> Result<CallToolResult, ErrorData> {
        let (status, body) = self.rest(parts, method, path, body).await?;
        if !(200..300).contains(&status) {
            return Ok(api_error(status, &body));
        }
        Ok(structured(text(&body), body))
    }

    /// A retried call with `round`'s handle: posts the answers, then follows the turn on
    /// from where the round stopped, unless it has ended meanwhile. An error leaves the
    /// round to be given back (the answers posted before it are not posted again: their
    /// requests are resolved).
    async fn retry(
        &self,
        round: &Round,
        answers: ModelInputResponses,
        parts: &Parts,
        ctx: &RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let hub = &self.app.hub;
        // Subscribed before anything is posted, so no frame of the turn is missed from here.
        let frames = hub.subscribe(&round.conversation);
        let mut followed =
            Followed::new(hub.clone(), round.conversation.clone(), round.after, frames);
        followed.asked.clone_from(&round.asked);
        followed.progress = round.progress;
        let turn = Turn {
            server: self,
            parts,
            ctx,
            path: &round.path,
            rounds: asks_in_rounds(ctx),
        };
        turn.answer(&round.asks, &answers, &mut followed).await?;
        let identity = (round.key.clone(), round.tenant.clone());
        // The turn ended while the round waited (answered elsewhere, cancelled, failed, or a
        // later message started another): its result, not the next turn's questions.
        if let Some(state) = turn.ended(&round.conversation, round.after).await {
            return self
                .finish(&turn, &mut followed, identity, Some(state))
                .await;
        }
        // What the round missed: the requests pending now (those not put to this client
        // yet, and those it left unanswered, are asked).
        turn.reload_pending(&mut followed).await;
        self.finish(&turn, &mut followed, identity, None).await
    }

    /// Follows the turn (unless it has `ended` already) to what ends this call: the turn's
    /// result, a cancel, or (in rounds) an input-required result under a new handle.
    async fn finish(
        &self,
        turn: &Turn<'_>,
        followed: &mut Followed,
        (key, tenant): (String, String),
        ended: Option<Value>,
    ) -> Result<CallToolResponse, ErrorData> {
        let stop = match ended {
            Some(state) => Stop::Ended(state),
            None => turn.follow(followed).await,
        };
        match stop {
            Stop::Ended(state) => turn.result(followed.after, state).await.map(Into::into),
            Stop::Cancelled => {
                let _ = self
                    .rest(
                        turn.parts,
                        Method::POST,
                        &format!("{}/cancel", turn.path),
                        None,
                    )
                    .await;
                Ok(CallToolResult::error(vec![ContentBlock::text(
                    "cancelled: the turn was cancelled",
                )])
                .into())
            }
            Stop::Asks(asks) => {
                let settings = &self.app.settings;
                let requests = input_requests(&asks);
                let expires = round_expiry(&asks, settings.requests.max_timeout());
                let handle = self.app.mcp_rounds.put(
                    Caps::of(settings),
                    Round {
                        key,
                        tenant,
                        conversation: followed.conversation.clone(),
                        path: turn.path.to_owned(),
                        after: followed.after,
                        asks,
                        asked: std::mem::take(&mut followed.asked),
                        progress: followed.progress,
                    },
                    expires,
                );
                Ok(InputRequiredResult::new(Some(requests), Some(handle)).into())
            }
        }
    }
}

#[tool_router]
impl BedrockMcp {
    #[tool(
        description = "Create a conversation with a Bedrock agent. Returns the conversation (its id is what the other tools take)."
    )]
    async fn create_conversation(
        &self,
        Parameters(args): Parameters<CreateArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut body = serde_json::Map::new();
        for (key, value) in [
            ("cwd", args.cwd),
            ("model", args.model),
            ("system_prompt", args.system_prompt),
            ("slug", args.slug),
            ("agent", args.agent),
        ] {
            if let Some(value) = value {
                body.insert(key.into(), Value::String(value));
            }
        }
        self.call(
            &parts,
            Method::POST,
            "/v1/conversations",
            Some(Value::Object(body)),
            |c| {
                format!(
                    "created conversation {} ({})",
                    c["id"].as_str().unwrap_or_default(),
                    c["slug"].as_str().unwrap_or_default()
                )
            },
        )
        .await
    }

    #[tool(
        description = "Send a message and run the agent's turn to its end: returns the agent's final text, with the tool calls it made as structured content. Progress notifications carry the turn's states and tool progress. Questions the agent asks come as elicitations (on the 2026-07-28 protocol, as an input-required result: retry the call with the answers and the requestState), or, for a client without elicitation, as notifications answered with the respond tool."
    )]
    async fn send_message(
        &self,
        Parameters(args): Parameters<SendArgs>,
        Extension(parts): Extension<Parts>,
        RequestState(request_state): RequestState,
        Answers(answers): Answers,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let path = format!("/v1/conversations/{}", segment(&args.conversation_id));
        let (status, conversation) = self.rest(&parts, Method::GET, &path, None).await?;
        if status != 200 {
            return Ok(api_error(status, &conversation).into());
        }
        let id = conversation["id"].as_str().unwrap_or_default().to_owned();
        let (key, tenant) = Self::caller(&parts)?;
        let hub = &self.app.hub;
        // A retried call of the 2026-07-28 protocol: the round it continues, whose message
        // was sent already. Until the retry is done with it (its answers posted), a failure
        // gives the round back under the same handle.
        let Some(handle) = request_state else {
            // Subscribed before the send, so no frame of the turn is missed.
            let frames = hub.subscribe(&id);
            let (status, sent) = self
                .rest(
                    &parts,
                    Method::POST,
                    &format!("{path}/messages"),
                    Some(json!({"text": args.text})),
                )
                .await?;
            if !(200..300).contains(&status) {
                drop(frames);
                hub.release(&id);
                return Ok(api_error(status, &sent).into());
            }
            let after = sent["message"]["sequence_id"].as_u64().unwrap_or(0);
            let mut followed = Followed::new(hub.clone(), id.clone(), after, frames);
            let turn = Turn {
                server: self,
                parts: &parts,
                ctx: &ctx,
                path: &path,
                rounds: asks_in_rounds(&ctx),
            };
            return self.finish(&turn, &mut followed, (key, tenant), None).await;
        };
        let (round, taken) = self.app.mcp_rounds.take(&handle, &key, &id)?;
        let caps = Caps::of(&self.app.settings);
        let retried = self
            .retry(&round, answers.unwrap_or_default(), &parts, &ctx)
            .await;
        match retried {
            Ok(response) => Ok(response),
            Err(error) => {
                self.app.mcp_rounds.restore(caps, taken, round);
                Err(error)
            }
        }
    }

    #[tool(
        description = "Cancel the conversation's running turn (its LLM request, tools and sub-agents). Idempotent."
    )]
    async fn cancel(
        &self,
        Parameters(args): Parameters<ConversationArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let path = format!(
            "/v1/conversations/{}/cancel",
            segment(&args.conversation_id)
        );
        self.call(&parts, Method::POST, &path, None, |c| {
            format!(
                "cancelled; the conversation is {}",
                c["state"]["kind"].as_str().unwrap_or_default()
            )
        })
        .await
    }

    #[tool(
        description = "The conversation's messages in order (user, agent, tool, system, error), after a sequence id."
    )]
    async fn get_messages(
        &self,
        Parameters(args): Parameters<MessagesArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let path = format!(
            "/v1/conversations/{}/messages?after={}&limit={}",
            segment(&args.conversation_id),
            args.after.unwrap_or(0),
            args.limit.unwrap_or(100)
        );
        self.call(&parts, Method::GET, &path, None, |m| {
            format!("{} messages", m["messages"].as_array().map_or(0, Vec::len))
        })
        .await
    }

    #[tool(
        description = "Answer a question the agent asked (request_id and payload: a request named by a notification, for clients without elicitation), or give the result of a client tool the agent called (call_id and output, as its notification named it)."
    )]
    async fn respond(
        &self,
        Parameters(args): Parameters<RespondArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let conversation = segment(&args.conversation_id);
        let (path, body) = match (args.request_id, args.payload, args.call_id, args.output) {
            (Some(request_id), Some(payload), None, None) => (
                format!(
                    "/v1/conversations/{conversation}/requests/{}",
                    segment(&request_id)
                ),
                json!({"payload": payload}),
            ),
            (None, None, Some(call_id), Some(output)) => (
                format!(
                    "/v1/conversations/{conversation}/tool_results/{}",
                    segment(&call_id)
                ),
                json!({"output": output, "is_error": args.is_error.unwrap_or(false)}),
            ),
            _ => {
                return Err(ErrorData::invalid_params(
                    "give request_id and payload (a question's answer), or call_id and output (a client tool's result)",
                    None,
                ));
            }
        };
        self.call(&parts, Method::POST, &path, Some(body), |_| {
            "answered".to_owned()
        })
        .await
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for BedrockMcp {
    // Logging is declared for the requests' fallback notifications (see `ask`).
    #[allow(deprecated)]
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_logging()
                .build(),
        )
        .with_server_info(Implementation::new("bedrock", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "Bedrock runs LLM agent conversations. create_conversation, then send_message runs a turn and returns the agent's answer; cancel stops a turn; get_messages reads the history; respond answers the agent's questions when your client cannot do elicitation.",
        )
    }
}

/// How following a turn stopped.
enum Stop {
    /// The turn ended in this state.
    Ended(Value),
    /// The MCP request was cancelled: `notifications/cancelled`, or (2026-07-28) its
    /// response stream closed.
    Cancelled,
    /// (2026-07-28) The turn asks the client these requests (pending, as the store has
    /// them): the call answers with an input-required result.
    Asks(Vec<Value>),
}

/// What one `send_message` call (one round of it, on 2026-07-28) follows of its turn. Its
/// subscription is the call's only: dropped, it is released at once, so the conversation
/// may rest.
struct Followed {
    hub: Arc<crate::hub::EventHub>,
    conversation: String,
    /// The sequence id of the turn's user message: a user message after it starts another
    /// turn, which is not this call's.
    after: u64,
    frames: crate::hub::Subscription,
    /// Frames taken from the subscription and not handled yet: (kind, JSON).
    backlog: VecDeque<(String, Value)>,
    /// The requests already put to the client.
    asked: HashSet<String>,
    /// The requests resolved since this call followed the turn (`client_request_resolved`).
    resolved: HashSet<String>,
    /// Progress notifications sent so far.
    progress: u32,
}

impl Followed {
    fn new(
        hub: Arc<crate::hub::EventHub>,
        conversation: String,
        after: u64,
        frames: crate::hub::Subscription,
    ) -> Self {
        Followed {
            hub,
            conversation,
            after,
            frames,
            backlog: VecDeque::new(),
            asked: HashSet::new(),
            resolved: HashSet::new(),
            progress: 0,
        }
    }
}

impl Drop for Followed {
    fn drop(&mut self) {
        self.frames.close();
        self.hub.release(&self.conversation);
    }
}

/// A turn being followed for one `send_message`.
struct Turn<'a> {
    server: &'a BedrockMcp,
    parts: &'a Parts,
    ctx: &'a RequestContext<RoleServer>,
    path: &'a str,
    /// Questions with a form go to the client as an input-required result (the 2026-07-28
    /// protocol, to a client that declared elicitation), rather than as elicitations sent
    /// in the middle of the call.
    rounds: bool,
}

/// States in which a turn has ended.
const REST: [&str; 4] = ["idle", "error", "completed", "context_exhausted"];

/// The state a call reports for its turn when a later user message started another turn
/// before the call saw its own end.
fn superseded(by: u64) -> Value {
    json!({"kind": "superseded", "by_sequence_id": by})
}

/// Whether this call's questions go in rounds (SEP-2322): its protocol is 2026-07-28 or later,
/// where a server does not send requests in the middle of a call, and its client declared
/// elicitation.
fn asks_in_rounds(ctx: &RequestContext<RoleServer>) -> bool {
    let modern = ctx
        .protocol_version()
        .is_some_and(|v| v.as_str() >= ProtocolVersion::V_2026_07_28.as_str());
    modern
        && ctx
            .client_capabilities()
            .and_then(|c| c.elicitation)
            .is_some()
}

/// The MCP error of an answer the retry cannot post: it names the request and says why.
fn refused(request_id: &str, why: &str) -> ErrorData {
    ErrorData::invalid_params(
        format!(
            "the answer to request {request_id} is not valid: {why}. Nothing of this call was answered past it; retry with a valid answer and the same requestState"
        ),
        Some(json!({"request_id": request_id})),
    )
}

impl Turn<'_> {
    /// Follows the conversation's frames until its turn ends, the call is cancelled, or (in
    /// rounds) the turn asks the client something still pending.
    async fn follow(&self, followed: &mut Followed) -> Stop {
        let mut asked = tokio::task::JoinSet::new();
        loop {
            let (kind, value) = if let Some(frame) = followed.backlog.pop_front() {
                frame
            } else {
                let frame = tokio::select! {
                    () = self.ctx.ct.cancelled() => return Stop::Cancelled,
                    frame = followed.frames.recv() => frame,
                    // A safety net: the state as stored.
                    () = tokio::time::sleep(Duration::from_secs(2)) => {
                        if let Some(state) = self.ended(&followed.conversation, followed.after).await {
                            return Stop::Ended(state);
                        }
                        continue;
                    }
                };
                match frame {
                    Ok(frame) => (
                        frame.kind.clone(),
                        serde_json::from_str(&frame.json).unwrap_or(Value::Null),
                    ),
                    // Lagged or closed: a new subscription, and the stored state and pending
                    // requests stand for the frames missed.
                    Err(_) => {
                        self.resubscribe(followed).await;
                        if let Some(state) =
                            self.ended(&followed.conversation, followed.after).await
                        {
                            return Stop::Ended(state);
                        }
                        continue;
                    }
                }
            };
            match kind.as_str() {
                "state" => {
                    let kind = value["state"]["kind"].as_str().unwrap_or_default();
                    followed.progress += 1;
                    self.progress(followed.progress, &format!("state: {kind}"))
                        .await;
                    if REST.contains(&kind) {
                        return Stop::Ended(value["state"].clone());
                    }
                }
                // A user message after the turn's own: the turn has ended and another runs.
                "message" => {
                    let message = &value["message"];
                    let sequence = message["sequence_id"].as_u64().unwrap_or_default();
                    if message["message_type"] == "user" && sequence > followed.after {
                        return Stop::Ended(superseded(sequence));
                    }
                }
                "tool_progress" => {
                    followed.progress += 1;
                    let message = format!(
                        "{}: {}",
                        value["tool_name"].as_str().unwrap_or_default(),
                        value["message"].as_str().unwrap_or_default()
                    );
                    self.progress(followed.progress, &message).await;
                }
                "client_request_resolved" => {
                    if let Some(request_id) = value["request_id"].as_str() {
                        followed.resolved.insert(request_id.to_owned());
                    }
                }
                // The client runs the tool and answers with `respond` (call_id, output)
                // while this call goes on following the turn.
                "client_tool_call" => tell_tool_call(self.ctx, &value).await,
                "client_request" => {
                    let request_id = value["request_id"].as_str().unwrap_or_default();
                    if followed.resolved.contains(request_id)
                        || !followed.asked.insert(request_id.to_owned())
                    {
                        continue;
                    }
                    if self.rounds && elicitation(&value["request_type"]).is_some() {
                        // The requests already waiting go in the same round; other frames
                        // wait for the next.
                        let mut asks = vec![value];
                        while let Ok(frame) = followed.frames.try_recv() {
                            let value: Value =
                                serde_json::from_str(&frame.json).unwrap_or(Value::Null);
                            let request_id = value["request_id"].as_str().unwrap_or_default();
                            if frame.kind == "client_request"
                                && elicitation(&value["request_type"]).is_some()
                                && !followed.resolved.contains(request_id)
                                && followed.asked.insert(request_id.to_owned())
                            {
                                asks.push(value);
                            } else {
                                followed.backlog.push_back((frame.kind.clone(), value));
                            }
                        }
                        // Only what is still pending is asked: a question answered
                        // elsewhere, expired or cancelled (with its turn) is not.
                        let asks = self.still_pending(followed, asks).await;
                        if asks.is_empty() {
                            continue;
                        }
                        return Stop::Asks(asks);
                    }
                    if self.rounds {
                        // A request without a form, in rounds: its notification goes out
                        // now, before the call may answer with the next round.
                        ask(self.server, self.parts, self.ctx, self.path, &value).await;
                        continue;
                    }
                    let (server, parts, ctx, path) = (
                        self.server.clone(),
                        self.parts.clone(),
                        self.ctx.clone(),
                        self.path.to_owned(),
                    );
                    asked.spawn(async move { ask(&server, &parts, &ctx, &path, &value).await });
                }
                _ => {}
            }
        }
    }

    /// The state this call reports if its turn (the one of user message `after`) has ended:
    /// [`superseded`] when a later user message started another, else the conversation's
    /// stored state when it is at rest.
    async fn ended(&self, conversation: &str, after: u64) -> Option<Value> {
        let app = &self.server.app;
        if let Ok(Some(next)) = app
            .store
            .next_user_message(conversation, i64::try_from(after).unwrap_or(i64::MAX))
            .await
        {
            return Some(superseded(u64::try_from(next).unwrap_or_default()));
        }
        match self
            .server
            .rest(self.parts, Method::GET, self.path, None)
            .await
        {
            Ok((200, c)) if REST.contains(&c["state"]["kind"].as_str().unwrap_or_default()) => {
                Some(c["state"].clone())
            }
            _ => None,
        }
    }

    /// The conversation's pending requests, as the store has them; None when it cannot say.
    async fn pending(&self, conversation: &str) -> Option<Vec<crate::model::ClientRequest>> {
        self.server
            .app
            .store
            .pending_requests(conversation)
            .await
            .ok()
    }

    /// The requests of `asks` still pending, as the store has them (with `expires_at`); all
    /// of them when the store cannot say.
    async fn still_pending(&self, followed: &Followed, asks: Vec<Value>) -> Vec<Value> {
        let Some(pending) = self.pending(&followed.conversation).await else {
            return asks;
        };
        let now = chrono::Utc::now();
        asks.into_iter()
            .filter_map(|ask| {
                let request = pending
                    .iter()
                    .find(|r| r.id == ask["request_id"].as_str().unwrap_or_default())?;
                (request.expires_at > now)
                    .then(|| serde_json::to_value(crate::wire::pending_request(request)).ok())
                    .flatten()
            })
            .collect()
    }

    /// Puts the requests pending now in the backlog (those already asked are not asked
    /// again).
    async fn reload_pending(&self, followed: &mut Followed) {
        if let Some(pending) = self.pending(&followed.conversation).await {
            for request in &pending {
                let value = serde_json::to_value(crate::wire::pending_request(request))
                    .unwrap_or(Value::Null);
                followed
                    .backlog
                    .push_back(("client_request".to_owned(), value));
            }
        }
    }

    /// Subscribes again after the subscription lagged or closed; the requests still pending
    /// go to the backlog (those already asked are not asked again).
    async fn resubscribe(&self, followed: &mut Followed) {
        let hub = &self.server.app.hub;
        followed.frames = hub.subscribe(&followed.conversation);
        hub.release(&followed.conversation);
        self.reload_pending(followed).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    /// Posts the client's answers to a round's questions (`answers`, by request id); a
    /// question it left unanswered is asked again. Every answer is read and checked before
    /// any is posted: one that does not fit its question (not an elicitation result, content
    /// that does not fit the form or the request) is an invalid-params error naming the
    /// request. A question resolved meanwhile (answered elsewhere, expired, cancelled) is
    /// dropped; an answer the API refuses is the same invalid-params error, and one it fails
    /// to store an internal error.
    async fn answer(
        &self,
        asks: &[Value],
        answers: &ModelInputResponses,
        followed: &mut Followed,
    ) -> Result<(), ErrorData> {
        let mut replies = Vec::new();
        let mut unanswered = Vec::new();
        for request in asks {
            let request_id = request["request_id"].as_str().unwrap_or_default();
            match answers.get(request_id) {
                Some(answer) => {
                    let payload =
                        reply_to(request, answer).map_err(|why| refused(request_id, &why))?;
                    replies.push((request_id, payload));
                }
                None => unanswered.push(request),
            }
        }
        for (request_id, payload) in replies {
            let path = format!("{}/requests/{}", self.path, segment(request_id));
            let (status, body) = self
                .server
                .rest(
                    self.parts,
                    Method::POST,
                    &path,
                    Some(json!({"payload": payload})),
                )
                .await?;
            let why = || {
                format!(
                    "{} (HTTP {status})",
                    body["error"]["message"].as_str().unwrap_or_default()
                )
            };
            match status {
                200..=299 => {}
                // Resolved meanwhile (already answered, expired, cancelled) or gone: there is
                // nothing left to answer, and it is not asked again.
                404 | 409 => {
                    followed.resolved.insert(request_id.to_owned());
                }
                400 | 413 | 422 => return Err(refused(request_id, &why())),
                _ => {
                    return Err(ErrorData::internal_error(
                        format!(
                            "the answer to request {request_id} could not be stored: {}; retry with the same requestState",
                            why()
                        ),
                        Some(json!({"request_id": request_id})),
                    ));
                }
            }
        }
        for request in unanswered.into_iter().rev() {
            let request_id = request["request_id"].as_str().unwrap_or_default();
            followed.asked.remove(request_id);
            followed
                .backlog
                .push_front(("client_request".to_owned(), request.clone()));
        }
        Ok(())
    }

    async fn progress(&self, n: u32, message: &str) {
        if let Some(token) = self.ctx.meta.get_progress_token() {
            let _ = self
                .ctx
                .peer
                .notify_progress(
                    ProgressNotificationParam::new(token, f64::from(n)).with_message(message),
                )
                .await;
        }
    }

    /// The tool's result once the turn (of user message `after`) ended in `state`: the
    /// agent's last text, and the turn's tool calls with their outcomes. Messages of a later
    /// turn are not the call's.
    async fn result(&self, after: u64, state: Value) -> Result<CallToolResult, ErrorData> {
        let path = format!("{}/messages?after={after}&limit=1000", self.path);
        let (_, body) = self
            .server
            .rest(self.parts, Method::GET, &path, None)
            .await?;
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        let mut text = String::new();
        let mut calls: Vec<Value> = Vec::new();
        for message in &messages {
            let content = &message["content"];
            match message["message_type"].as_str() {
                Some("user") => break,
                Some("agent") => {
                    if let Some(t) = content["text"].as_str().filter(|t| !t.is_empty()) {
                        t.clone_into(&mut text);
                    }
                    for call in content["tool_uses"].as_array().into_iter().flatten() {
                        calls.push(
                            json!({"id": call["id"], "name": call["name"], "input": call["input"]}),
                        );
                    }
                }
                Some("tool") => {
                    if let Some(call) = calls.iter_mut().find(|c| c["id"] == content["tool_use_id"])
                    {
                        call["ok"] = content["ok"].clone();
                        call["output"] = json!(crate::tools::preview(
                            content["output"].as_str().unwrap_or_default(),
                            2000
                        ));
                    }
                }
                _ => {}
            }
        }
        let failed = state["kind"] == "error";
        let shown = if failed {
            format!(
                "the turn failed ({}): {}",
                state["error_kind"].as_str().unwrap_or_default(),
                state["message"].as_str().unwrap_or_default()
            )
        } else {
            text.clone()
        };
        let mut result = structured(
            shown,
            json!({"state": state, "text": text, "tool_calls": calls}),
        );
        result.is_error = Some(failed);
        Ok(result)
    }
}

/// Puts one server-to-client request to the MCP client: as an elicitation when it can do
/// them, else as a notification naming it (answered with the respond tool).
#[allow(deprecated)]
async fn ask(
    server: &BedrockMcp,
    parts: &Parts,
    ctx: &RequestContext<RoleServer>,
    path: &str,
    frame: &Value,
) {
    let request_id = frame["request_id"].as_str().unwrap_or_default();
    let request_type = &frame["request_type"];
    let elicits = ctx
        .client_capabilities()
        .and_then(|c| c.elicitation)
        .is_some();
    if let Some((message, schema, reply)) = elicitation(request_type).filter(|_| elicits) {
        let params = ElicitRequestParams::FormElicitationParams {
            meta: None,
            message,
            requested_schema: schema.clone(),
        };
        match ctx.peer.create_elicitation(params).await {
            Ok(answer) => match reply_payload(request_type, &schema, reply, answer) {
                Ok(payload) => {
                    let path = format!("{path}/requests/{}", segment(request_id));
                    let _ = server
                        .rest(
                            parts,
                            Method::POST,
                            &path,
                            Some(json!({"payload": payload})),
                        )
                        .await;
                    return;
                }
                // Content that does not fit the form answers nothing: the request stays
                // pending, and the fallback tells the client how to answer it.
                Err(why) => {
                    tracing::debug!(%why, request_id, "an elicitation's answer does not fit its form; falling back to a notification");
                }
            },
            // The session cannot carry it (a protocol where elicitation is not sent
            // mid-call, say): the fallback.
            Err(error) => {
                tracing::debug!(%error, "an elicitation could not be sent; falling back to a notification");
            }
        }
    }
    let text = format!(
        "the agent asks (request {request_id}): {}; answer with the respond tool, payload as {}",
        describe(request_type),
        reply_shape(request_type)
    );
    let data = json!({"request_id": request_id, "request_type": request_type, "timeout_ms": frame["timeout_ms"], "message": text});
    tell(ctx, &text, data, "bedrock.client_request").await;
}

/// What the client is to do, as a progress notification (`text`) and a log message
/// (`data`, from `logger`): what clients without a form show. (Logging is deprecated by a
/// later protocol revision; it is what today's clients show.)
#[allow(deprecated)]
async fn tell(ctx: &RequestContext<RoleServer>, text: &str, data: Value, logger: &str) {
    if let Some(token) = ctx.meta.get_progress_token() {
        let _ = ctx
            .peer
            .notify_progress(ProgressNotificationParam::new(token, 0.0).with_message(text))
            .await;
    }
    let _ = ctx
        .peer
        .notify_logging_message(
            LoggingMessageNotificationParam::new(LoggingLevel::Notice, data).with_logger(logger),
        )
        .await;
}

/// Tells the MCP client that the agent called one of its client tools, to be answered with
/// `respond`.
async fn tell_tool_call(ctx: &RequestContext<RoleServer>, frame: &Value) {
    let call_id = frame["call_id"].as_str().unwrap_or_default();
    let name = frame["name"].as_str().unwrap_or_default();
    let text = format!(
        "the agent calls the client tool {name} (call {call_id}) with input {}; run it and answer with the respond tool: call_id and output (is_error when it failed), before {}",
        crate::tools::preview(&frame["input"].to_string(), 2000),
        frame["expires_at"].as_str().unwrap_or_default()
    );
    let data = json!({
        "call_id": call_id,
        "tool_use_id": frame["tool_use_id"],
        "name": name,
        "input": frame["input"],
        "expires_at": frame["expires_at"],
        "message": text,
    });
    tell(ctx, &text, data, "bedrock.client_tool_call").await;
}

/// How a form's content becomes a reply (`None`: the content lacks the form's field).
type ReplyOf = fn(&Value) -> Option<Value>;

/// The reply to a request that an elicitation's answer makes: accepted, the form's content
/// as `reply` makes it, once it fits the form (`schema`) and the request; declined, a
/// confirm's no, else a cancel; cancelled, a cancel. Content that does not fit is refused,
/// never taken for a default, saying why.
fn reply_payload(
    request_type: &Value,
    schema: &ElicitationSchema,
    reply: ReplyOf,
    answer: ElicitResult,
) -> Result<Value, String> {
    let payload = match answer.action {
        ElicitationAction::Accept => {
            let content = answer
                .content
                .ok_or("an accepted answer needs the form's content")?;
            fits_form(
                &serde_json::to_value(schema).unwrap_or(Value::Null),
                &content,
            )?;
            reply(&content).ok_or("the content lacks the form's field")?
        }
        ElicitationAction::Decline => match request_type.get("confirm") {
            Some(_) => json!({"confirmed": false}),
            None => json!({"cancelled": true}),
        },
        // Cancel, and whatever later protocols add (the enum is non-exhaustive).
        ElicitationAction::Cancel | _ => json!({"cancelled": true}),
    };
    crate::runtime::check_reply(request_type, &payload)?;
    Ok(payload)
}

/// The reply a round's answer (an elicitation result, as JSON) makes to its request.
fn reply_to(request: &Value, answer: &Value) -> Result<Value, String> {
    let answer = serde_json::from_value::<ElicitResult>(answer.clone())
        .map_err(|e| format!("it is not an elicitation result ({e})"))?;
    let request_type = &request["request_type"];
    let (_, schema, reply) = elicitation(request_type).ok_or("the request has no form")?;
    reply_payload(request_type, &schema, reply, answer)
}

/// Whether a form's content fits its schema (MCP forms: an object of primitive fields):
/// every required field is there, and every field of the form it has is of its type and,
/// for a choice, one of the choices. Fields the form does not have are left alone.
fn fits_form(schema: &Value, content: &Value) -> Result<(), String> {
    let content = content
        .as_object()
        .ok_or_else(|| format!("the content must be an object, not {content}"))?;
    for field in schema["required"].as_array().into_iter().flatten() {
        let field = field.as_str().unwrap_or_default();
        if !content.contains_key(field) {
            return Err(format!("the field {field:?} is required"));
        }
    }
    let Some(properties) = schema["properties"].as_object() else {
        return Ok(());
    };
    for (field, value) in content {
        let Some(property) = properties.get(field) else {
            continue;
        };
        fits_field(property, value).map_err(|why| format!("the field {field:?} {why}"))?;
    }
    Ok(())
}

/// The choices a field (or an array's items) offers, if it is a choice: `enum`, or the
/// `const`s of `oneOf` / `anyOf`.
fn choices(property: &Value) -> Option<Vec<&Value>> {
    if let Some(values) = property["enum"].as_array() {
        return Some(values.iter().collect());
    }
    ["oneOf", "anyOf"].iter().find_map(|of| {
        property[*of]
            .as_array()
            .map(|options| options.iter().map(|o| &o["const"]).collect())
    })
}

fn fits_field(property: &Value, value: &Value) -> Result<(), String> {
    let typed = match property["type"].as_str() {
        Some("string") => value.is_string(),
        Some("boolean") => value.is_boolean(),
        Some("number") => value.is_number(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("array") => value.is_array(),
        _ => true,
    };
    if !typed {
        return Err(format!(
            "must be of type {}, not {value}",
            property["type"].as_str().unwrap_or_default()
        ));
    }
    let one_of = |value: &Value, choices: &[&Value]| {
        if choices.contains(&value) {
            Ok(())
        } else {
            Err(format!("takes one of {choices:?}, not {value}"))
        }
    };
    if let Some(values) = value.as_array() {
        if let Some(choices) = choices(&property["items"]) {
            for value in values {
                one_of(value, &choices)?;
            }
        }
        return Ok(());
    }
    match choices(property) {
        Some(choices) => one_of(value, &choices),
        None => Ok(()),
    }
}

/// A round's questions as the input requests of an input-required result: an elicitation
/// each, under its request id.
fn input_requests(asks: &[Value]) -> InputRequests {
    let mut requests = InputRequests::new();
    for request in asks {
        if let Some((message, schema, _)) = elicitation(&request["request_type"]) {
            let params = ElicitRequestParams::FormElicitationParams {
                meta: None,
                message,
                requested_schema: schema,
            };
            requests.insert(
                request["request_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                InputRequest::Elicitation(ElicitRequest::new(params)),
            );
        }
    }
    requests
}

/// The elicitation of a request kind: its message, its form's schema, and how the form's
/// content becomes the reply. `None` when the kind has no form (the fallback is used).
fn elicitation(request_type: &Value) -> Option<(String, ElicitationSchema, ReplyOf)> {
    let (kind, spec) = request_type.as_object()?.iter().next()?;
    let message = spec["message"]
        .as_str()
        .unwrap_or("The agent asks")
        .to_owned();
    let (schema, reply): (Value, ReplyOf) = match kind.as_str() {
        "confirm" => (
            json!({"type": "object", "properties": {"confirmed": {"type": "boolean", "title": "Confirm", "default": spec["default"].as_bool().unwrap_or(false)}}, "required": ["confirmed"]}),
            |c| Some(json!({"confirmed": c["confirmed"].as_bool()?})),
        ),
        "prompt" => (
            json!({"type": "object", "properties": {"text": {"type": "string", "title": "Answer", "default": spec["default"].as_str().unwrap_or_default()}}, "required": ["text"]}),
            |c| Some(json!({"text": c["text"].as_str()?})),
        ),
        "select" if spec["multi_select"].as_bool() != Some(true) => {
            let values: Vec<&Value> = spec["options"]
                .as_array()?
                .iter()
                .map(|o| &o["value"])
                .collect();
            let names: Vec<&Value> = spec["options"]
                .as_array()?
                .iter()
                .map(|o| &o["label"])
                .collect();
            (
                json!({"type": "object", "properties": {"selected": {"type": "string", "title": "Choice", "enum": values, "enumNames": names}}, "required": ["selected"]}),
                |c| Some(json!({"selected": [c["selected"].as_str()?]})),
            )
        }
        "select" => {
            let values: Vec<&Value> = spec["options"]
                .as_array()?
                .iter()
                .map(|o| &o["value"])
                .collect();
            (
                json!({"type": "object", "properties": {"selected": {"type": "array", "title": "Choices", "items": {"type": "string", "enum": values}}}, "required": ["selected"]}),
                |c| Some(json!({"selected": c["selected"].as_array()?})),
            )
        }
        // A custom request's own schema, when it is one MCP forms can show (an object of
        // primitive fields); else the fallback.
        "custom" => (spec["schema"].clone(), |c| Some(json!({"custom": c}))),
        _ => return None,
    };
    let schema: ElicitationSchema = serde_json::from_value(schema).ok()?;
    Some((message, schema, reply))
}

fn describe(request_type: &Value) -> String {
    let Some((kind, spec)) = request_type.as_object().and_then(|o| o.iter().next()) else {
        return request_type.to_string();
    };
    match spec["message"].as_str() {
        Some(message) => format!("{kind}: {message}"),
        None => format!("{kind}: {spec}"),
    }
}

fn reply_shape(request_type: &Value) -> &'static str {
    match request_type
        .as_object()
        .and_then(|o| o.keys().next())
        .map(String::as_str)
    {
        Some("confirm") => r#"{"confirmed": true|false}"#,
        Some("prompt") => r#"{"text": "..."}"#,
        Some("select") => r#"{"selected": ["value", ...]}"#,
        _ => r#"{"custom": ...}"#,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(key: &str, tenant: &str, conversation: &str) -> Round {
        Round {
            key: key.to_owned(),
            tenant: tenant.to_owned(),
            conversation: conversation.to_owned(),
            path: format!("/v1/conversations/{conversation}"),
            after: 1,
            asks: Vec::new(),
            asked: HashSet::new(),
            progress: 0,
        }
    }

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    const CAPS: Caps = Caps {
        per_key: 2,
        per_tenant: 3,
        per_node: 5,
    };

    fn kept(rounds: &Rounds, handle: &str) -> bool {
        rounds.waiting().rounds.contains_key(handle)
    }

    /// Past a key's cap its oldest round goes, past a tenant's the tenant's oldest (of any
    /// of its keys), past the node's the node's oldest; the indexes stay in step.
    #[test]
    fn the_oldest_round_goes_past_each_cap() {
        let rounds = Rounds::default();
        // Key k1 of tenant t: its third round drops its first.
        let a1 = rounds.put(CAPS, round("k1", "t", "c"), later());
        // The soonest to expire is not the one dropped: the oldest is.
        let a2 = rounds.put(
            CAPS,
            round("k1", "t", "c"),
            Instant::now() + Duration::from_secs(60),
        );
        let a3 = rounds.put(CAPS, round("k1", "t", "c"), later());
        assert!(!kept(&rounds, &a1) && kept(&rounds, &a2) && kept(&rounds, &a3));
        // Key k2 of the same tenant: the tenant's cap (3) drops the tenant's oldest, k1's.
        let b1 = rounds.put(CAPS, round("k2", "t", "c"), later());
        assert!(kept(&rounds, &a2) && kept(&rounds, &a3) && kept(&rounds, &b1));
        let b2 = rounds.put(CAPS, round("k2", "t", "c"), later());
        assert!(!kept(&rounds, &a2) && kept(&rounds, &a3));
        assert!(kept(&rounds, &b1) && kept(&rounds, &b2));
        // Other tenants fill the node (5): the node's oldest goes, whoever's it is.
        let c1 = rounds.put(CAPS, round("k3", "u", "d"), later());
        let c2 = rounds.put(CAPS, round("k4", "v", "e"), later());
        assert_eq!(rounds.waiting().rounds.len(), 5);
        let c3 = rounds.put(CAPS, round("k5", "w", "f"), later());
        assert!(!kept(&rounds, &a3), "the node's oldest");
        for handle in [&b1, &b2, &c1, &c2, &c3] {
            assert!(kept(&rounds, handle));
        }
        let waiting = rounds.waiting();
        assert_eq!(waiting.rounds.len(), 5);
        assert_eq!(waiting.oldest.len(), 5);
        assert_eq!(waiting.expiries.len(), 5);
        assert_eq!(waiting.by_key.values().map(BTreeMap::len).sum::<usize>(), 5);
        assert_eq!(
            waiting.by_tenant.values().map(BTreeMap::len).sum::<usize>(),
            5
        );
        assert!(
            !waiting.by_key.contains_key("k1"),
            "an empty index entry goes"
        );
    }

    /// A handle is taken only by its key on its conversation; anyone else's try leaves it.
    /// Taken, it is gone; given back, it is there again under the same handle.
    #[test]
    fn a_round_is_taken_by_its_owner_only_and_can_be_given_back() {
        let rounds = Rounds::default();
        let handle = rounds.put(CAPS, round("k1", "t", "c"), later());
        assert!(rounds.take(&handle, "k2", "c").is_err(), "another key");
        assert!(
            rounds.take(&handle, "k1", "other").is_err(),
            "another conversation"
        );
        assert!(rounds.take("bkr_00", "k1", "c").is_err(), "a forged handle");
        let (taken, ticket) = rounds.take(&handle, "k1", "c").expect("the owner's");
        assert!(rounds.take(&handle, "k1", "c").is_err(), "used");
        rounds.restore(CAPS, ticket, taken);
        let (_, _) = rounds.take(&handle, "k1", "c").expect("given back");
    }

    /// An expired round is refused and forgotten by the next put or take, without waiting.
    #[test]
    fn expired_rounds_are_refused_and_swept() {
        let rounds = Rounds::default();
        let past = Instant::now();
        let gone = rounds.put(CAPS, round("k1", "t", "c"), past);
        let other = rounds.put(CAPS, round("k9", "t9", "c9"), past);
        assert!(rounds.take(&gone, "k1", "c").is_err());
        assert!(!kept(&rounds, &gone) && !kept(&rounds, &other));
        let waiting = rounds.waiting();
        assert!(waiting.rounds.is_empty() && waiting.oldest.is_empty());
        assert!(waiting.expiries.is_empty() && waiting.by_key.is_empty());
    }

    /// A round lives until its longest question expires, as stored (a question asked again
    /// does not get a new full timeout), and the grace; never past the longest a request
    /// may wait and the grace, whatever `timeout_ms` says.
    #[test]
    fn a_rounds_expiry_comes_from_its_questions_and_is_bounded() {
        let max = Duration::from_secs(3600);
        let in_ten = (chrono::Utc::now() + chrono::TimeDelta::minutes(10)).to_rfc3339();
        let before = Instant::now();
        let at = round_expiry(
            &[json!({"expires_at": in_ten, "timeout_ms": 3_000_000_u64})],
            max,
        );
        assert!(at <= Instant::now() + Duration::from_secs(600) + ROUND_GRACE);
        assert!(at >= before + Duration::from_secs(590) + ROUND_GRACE);
        // Expired already: the grace alone.
        let past = (chrono::Utc::now() - chrono::TimeDelta::minutes(10)).to_rfc3339();
        let at = round_expiry(&[json!({"expires_at": past})], max);
        assert!(at <= Instant::now() + ROUND_GRACE);
        // A huge timeout is cut to the longest a request may wait.
        let at = round_expiry(&[json!({"timeout_ms": u64::MAX})], max);
        assert!(at <= Instant::now() + max + ROUND_GRACE);
        let far = (chrono::DateTime::<chrono::Utc>::MAX_UTC).to_rfc3339();
        let at = round_expiry(&[json!({"expires_at": far})], max);
        assert!(at <= Instant::now() + max + ROUND_GRACE);
    }

    fn request(request_type: Value) -> Value {
        json!({"request_id": "r1", "request_type": request_type})
    }

    /// An answer is refused, saying why, when it is not an elicitation result or its content
    /// does not fit the form or the request; it is never taken for a default.
    #[test]
    fn answers_that_do_not_fit_are_refused_not_defaulted() {
        let confirm = request(json!({"confirm": {"message": "ok?", "default": false}}));
        let prompt = request(json!({"prompt": {"message": "name?"}}));
        let select = request(
            json!({"select": {"message": "pick", "options": [{"value": "a", "label": "A"}, {"value": "b", "label": "B"}], "multi_select": false}}),
        );
        let multi = request(
            json!({"select": {"message": "pick", "options": [{"value": "a", "label": "A"}, {"value": "b", "label": "B"}], "multi_select": true}}),
        );
        let custom = request(
            json!({"custom": {"type_name": "t", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}),
        );
        let accept = |content: Value| json!({"action": "accept", "content": content});
        for (request, answer) in [
            (&prompt, accept(json!({"text": 42}))),
            (&prompt, json!({"text": "not an elicitation result"})),
            (&prompt, json!({"action": "accept"})),
            (&confirm, accept(json!({"confirmed": "true"}))),
            (&confirm, accept(json!({}))),
            (&select, accept(json!({"selected": "z"}))),
            (&select, accept(json!({"selected": ["a"]}))),
            (&multi, accept(json!({"selected": ["a", "z"]}))),
            (&multi, accept(json!({"selected": []}))),
            (&custom, accept(json!({"n": "seven"}))),
            (&custom, accept(json!({"m": 1}))),
        ] {
            let refused = reply_to(request, &answer);
            assert!(refused.is_err(), "{request} {answer}: {refused:?}");
        }
        for (request, answer, reply) in [
            (
                &prompt,
                accept(json!({"text": "Ada"})),
                json!({"text": "Ada"}),
            ),
            (
                &confirm,
                accept(json!({"confirmed": true})),
                json!({"confirmed": true}),
            ),
            (
                &confirm,
                json!({"action": "decline"}),
                json!({"confirmed": false}),
            ),
            (
                &select,
                accept(json!({"selected": "b"})),
                json!({"selected": ["b"]}),
            ),
            (
                &select,
                json!({"action": "cancel"}),
                json!({"cancelled": true}),
            ),
            (
                &multi,
                accept(json!({"selected": ["a", "b"]})),
                json!({"selected": ["a", "b"]}),
            ),
            (
                &custom,
                accept(json!({"n": 7})),
                json!({"custom": {"n": 7}}),
            ),
        ] {
            assert_eq!(reply_to(request, &answer), Ok(reply), "{request} {answer}");
        }
    }
}
