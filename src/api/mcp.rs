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

use std::collections::{HashMap, HashSet, VecDeque};
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

/// The timeout of a question that does not say its own (the longest of `[requests]`).
const QUESTION_TIMEOUT: Duration = Duration::from_secs(900);

/// Rounds one API key may leave waiting; past that its oldest is dropped.
const ROUNDS_PER_KEY: usize = 64;

/// The calls of the 2026-07-28 protocol that wait for the client's next round (SEP-2322).
///
/// A `send_message` whose turn asks the client something answers with an input-required
/// result, and the client retries the call with the answers and the `requestState` it was
/// given. That state comes back from the client and is not trusted: it is only a handle (256
/// random bits) to the round kept here, which holds everything the call needs: the API key
/// that made it, the conversation, the questions and the turn's subscription. A handle is
/// good once, for the key that made the call and the conversation it named, until the round
/// expires. Anything else (a forged, replayed or expired handle, another key's, another
/// conversation's) is the same invalid-params error, which does not say whether the handle
/// exists, and the round is left as it was.
#[derive(Default)]
pub struct Rounds {
    waiting: Mutex<HashMap<String, (Instant, Round)>>,
}

impl std::fmt::Debug for Rounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let waiting = self.waiting.lock().map_or(0, |w| w.len());
        f.debug_struct("Rounds").field("waiting", &waiting).finish()
    }
}

/// A call that answered with an input-required result, until the client's retry.
struct Round {
    /// The API key (its hash; dev mode's bucket) that made the call.
    key: String,
    /// The conversation's REST path.
    path: String,
    /// The sequence id of the call's user message.
    after: u64,
    followed: Followed,
    /// The questions put to the client (their `client_request` frames).
    asks: Vec<Value>,
}

impl Rounds {
    /// Keeps a round until the client's retry; its handle, the `requestState`.
    fn put(&self, hub: &crate::hub::EventHub, round: Round) -> String {
        let handle = format!("bkr_{}", hex::encode(rand::random::<[u8; 32]>()));
        let longest = round
            .asks
            .iter()
            .filter_map(|a| a["timeout_ms"].as_u64())
            .max()
            .map_or(QUESTION_TIMEOUT, Duration::from_millis);
        let now = Instant::now();
        let expires = now + longest + ROUND_GRACE;
        let dropped: Vec<Round> = {
            let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
            let mut dropped: Vec<Round> = waiting
                .extract_if(|_, (at, _)| *at <= now)
                .map(|(_, (_, round))| round)
                .collect();
            let mut mine: Vec<(Instant, String)> = waiting
                .iter()
                .filter(|(_, (_, r))| r.key == round.key)
                .map(|(handle, (at, _))| (*at, handle.clone()))
                .collect();
            if mine.len() >= ROUNDS_PER_KEY {
                mine.sort();
                for (_, handle) in &mine[..=mine.len() - ROUNDS_PER_KEY] {
                    dropped.extend(waiting.remove(handle).map(|(_, round)| round));
                }
            }
            waiting.insert(handle.clone(), (expires, round));
            dropped
        };
        for round in dropped {
            let conversation = round.followed.conversation.clone();
            drop(round);
            hub.release(&conversation);
        }
        handle
    }

    /// The round a retried call names, if it is this key's, for this conversation, and
    /// still waiting; it is the call's from then on.
    fn take(&self, handle: &str, key: &str, conversation: &str) -> Result<Round, ErrorData> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let fits = waiting.get(handle).is_some_and(|(at, round)| {
            *at > Instant::now() && round.key == key && round.followed.conversation == conversation
        });
        // Another caller's attempt leaves the round to its owner.
        if fits && let Some((_, round)) = waiting.remove(handle) {
            return Ok(round);
        }
        Err(ErrorData::invalid_params(
            "requestState is not valid: this server did not give it to this caller for this conversation's send_message, or it was used already, or it expired. The turn goes on: read it with get_messages, or cancel it",
            None,
        ))
    }
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
    if let Err(error) = super::auth::Caller::from_request_parts(&mut parts, &app).await {
        return error.into_response();
    }
    let key = match super::auth::Credential::from_request_parts(&mut parts, &app).await {
        Ok(credential) => super::auth::key_id(&credential),
        Err(error) => return error.into_response(),
    };
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
    /// The request's id, as its notification named it.
    pub request_id: String,
    /// The reply: `{"confirmed": bool}`, `{"text": s}`, `{"selected": [values]}`,
    /// `{"custom": any}` or `{"cancelled": true}`.
    pub payload: Value,
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

    /// The API key (its hash; dev mode's bucket) of the MCP request.
    async fn caller_key(&self, parts: &Parts) -> Result<String, ErrorData> {
        let mut parts = parts.clone();
        super::auth::Credential::from_request_parts(&mut parts, &self.app)
            .await
            .map(|credential| super::auth::key_id(&credential))
            .map_err(|_| ErrorData::invalid_request("the request's key cannot be read", None))
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
        let key = self.caller_key(&parts).await?;
        // A retried call of the 2026-07-28 protocol: the round it continues, whose message
        // was sent already.
        let (mut followed, after, path) = match request_state {
            Some(handle) => {
                let round = self.app.mcp_rounds.take(&handle, &key, &id)?;
                let turn = Turn {
                    server: self,
                    parts: &parts,
                    ctx: &ctx,
                    path: &round.path,
                    rounds: false,
                };
                let mut followed = round.followed;
                turn.answer(&round.asks, answers.unwrap_or_default(), &mut followed)
                    .await;
                (followed, round.after, round.path)
            }
            None => {
                // Subscribed before the send, so no frame of the turn is missed.
                let frames = self.app.services.hub.subscribe(&id);
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
                    self.app.services.hub.release(&id);
                    return Ok(api_error(status, &sent).into());
                }
                let after = sent["message"]["sequence_id"].as_u64().unwrap_or(0);
                (Followed::new(id.clone(), frames), after, path)
            }
        };
        let turn = Turn {
            server: self,
            parts: &parts,
            ctx: &ctx,
            path: &path,
            rounds: asks_in_rounds(&ctx),
        };
        let stop = turn.follow(&mut followed).await;
        let state = match stop {
            Stop::Ended(state) => state,
            Stop::Cancelled => {
                drop(followed);
                self.app.services.hub.release(&id);
                let _ = self
                    .rest(&parts, Method::POST, &format!("{path}/cancel"), None)
                    .await;
                return Ok(CallToolResult::error(vec![ContentBlock::text(
                    "cancelled: the turn was cancelled",
                )])
                .into());
            }
            Stop::Asks(asks) => {
                let requests = input_requests(&asks);
                let handle = self.app.mcp_rounds.put(
                    &self.app.services.hub,
                    Round {
                        key,
                        path,
                        after,
                        followed,
                        asks,
                    },
                );
                return Ok(InputRequiredResult::new(Some(requests), Some(handle)).into());
            }
        };
        drop(followed);
        self.app.services.hub.release(&id);
        turn.result(after, state).await.map(Into::into)
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
        description = "Answer a question the agent asked (a request named by a notification, for clients without elicitation)."
    )]
    async fn respond(
        &self,
        Parameters(args): Parameters<RespondArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let path = format!(
            "/v1/conversations/{}/requests/{}",
            segment(&args.conversation_id),
            segment(&args.request_id)
        );
        self.call(
            &parts,
            Method::POST,
            &path,
            Some(json!({"payload": args.payload})),
            |_| "answered".to_owned(),
        )
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
    /// (2026-07-28) The turn asks the client these requests (their `client_request` frames):
    /// the call answers with an input-required result.
    Asks(Vec<Value>),
}

/// What a `send_message` follows of its conversation; kept between the rounds of a call of
/// the 2026-07-28 protocol, so that no frame of the turn is missed meanwhile.
struct Followed {
    conversation: String,
    frames: crate::hub::Subscription,
    /// Frames taken from the subscription and not handled yet: (kind, JSON).
    backlog: VecDeque<(String, Value)>,
    /// The requests already put to the client.
    asked: HashSet<String>,
    /// Progress notifications sent so far.
    progress: u32,
}

impl Followed {
    fn new(conversation: String, frames: crate::hub::Subscription) -> Self {
        Followed {
            conversation,
            frames,
            backlog: VecDeque::new(),
            asked: HashSet::new(),
            progress: 0,
        }
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

impl Turn<'_> {
    /// Follows the conversation's frames until its turn ends, the call is cancelled, or (in
    /// rounds) the turn asks the client something.
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
                        if let Some(state) = self.rested().await {
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
                        if let Some(state) = self.rested().await {
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
                "tool_progress" => {
                    followed.progress += 1;
                    let message = format!(
                        "{}: {}",
                        value["tool_name"].as_str().unwrap_or_default(),
                        value["message"].as_str().unwrap_or_default()
                    );
                    self.progress(followed.progress, &message).await;
                }
                "client_request" => {
                    let request_id = value["request_id"].as_str().unwrap_or_default();
                    if !followed.asked.insert(request_id.to_owned()) {
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
                                && followed.asked.insert(request_id.to_owned())
                            {
                                asks.push(value);
                            } else {
                                followed.backlog.push_back((frame.kind.clone(), value));
                            }
                        }
                        return Stop::Asks(asks);
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

    /// The turn's last state if it has ended, as stored.
    async fn rested(&self) -> Option<Value> {
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

    /// Subscribes again after the subscription lagged or closed; the requests still pending
    /// go to the backlog (those already asked are not asked again).
    async fn resubscribe(&self, followed: &mut Followed) {
        let hub = &self.server.app.services.hub;
        followed.frames = hub.subscribe(&followed.conversation);
        hub.release(&followed.conversation);
        if let Ok(pending) = self
            .server
            .app
            .services
            .store
            .pending_requests(&followed.conversation)
            .await
        {
            for request in &pending {
                let value = serde_json::to_value(crate::wire::pending_request(request))
                    .unwrap_or(Value::Null);
                followed
                    .backlog
                    .push_back(("client_request".to_owned(), value));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    /// Posts the client's answers to a round's questions (`answers`, by request id); a
    /// question it left unanswered is asked again.
    async fn answer(&self, asks: &[Value], answers: ModelInputResponses, followed: &mut Followed) {
        for request in asks {
            let request_id = request["request_id"].as_str().unwrap_or_default();
            let answer = answers
                .get(request_id)
                .and_then(|a| serde_json::from_value::<ElicitResult>(a.clone()).ok());
            let (Some(answer), Some((_, _, reply))) =
                (answer, elicitation(&request["request_type"]))
            else {
                followed.asked.remove(request_id);
                followed
                    .backlog
                    .push_front(("client_request".to_owned(), request.clone()));
                continue;
            };
            let payload = reply_payload(&request["request_type"], reply, answer);
            let path = format!("{}/requests/{}", self.path, segment(request_id));
            // Already answered by another client, expired or cancelled: nothing to do.
            let _ = self
                .server
                .rest(
                    self.parts,
                    Method::POST,
                    &path,
                    Some(json!({"payload": payload})),
                )
                .await;
        }
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

    /// The tool's result once the turn ended in `state`: the agent's last text, and the
    /// turn's tool calls with their outcomes.
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
            requested_schema: schema,
        };
        match ctx.peer.create_elicitation(params).await {
            Ok(answer) => {
                let payload = reply_payload(request_type, reply, answer);
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
    if let Some(token) = ctx.meta.get_progress_token() {
        let _ = ctx
            .peer
            .notify_progress(ProgressNotificationParam::new(token, 0.0).with_message(&text))
            .await;
    }
    let _ = ctx
        .peer
        .notify_logging_message(
            LoggingMessageNotificationParam::new(
                LoggingLevel::Notice,
                json!({"request_id": request_id, "request_type": request_type, "timeout_ms": frame["timeout_ms"], "message": text}),
            )
            .with_logger("bedrock.client_request"),
        )
        .await;
}

type ReplyOf = fn(Value) -> Value;

/// The reply to a request that an elicitation's answer makes: accepted, the form's content
/// as `reply` makes it; declined, a confirm's no, else a cancel; cancelled, a cancel.
fn reply_payload(request_type: &Value, reply: ReplyOf, answer: ElicitResult) -> Value {
    match answer.action {
        ElicitationAction::Accept => reply(answer.content.unwrap_or(Value::Null)),
        ElicitationAction::Decline => match request_type.get("confirm") {
            Some(_) => json!({"confirmed": false}),
            None => json!({"cancelled": true}),
        },
        // Cancel, and whatever later protocols add (the enum is non-exhaustive).
        ElicitationAction::Cancel | _ => json!({"cancelled": true}),
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
            |c| json!({"confirmed": c["confirmed"].as_bool().unwrap_or(false)}),
        ),
        "prompt" => (
            json!({"type": "object", "properties": {"text": {"type": "string", "title": "Answer", "default": spec["default"].as_str().unwrap_or_default()}}, "required": ["text"]}),
            |c| json!({"text": c["text"].as_str().unwrap_or_default()}),
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
                |c| json!({"selected": [c["selected"].as_str().unwrap_or_default()]}),
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
                |c| json!({"selected": c["selected"].as_array().cloned().unwrap_or_default()}),
            )
        }
        // A custom request's own schema, when it is one MCP forms can show (an object of
        // primitive fields); else the fallback.
        "custom" => (spec["schema"].clone(), |c| json!({"custom": c})),
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
