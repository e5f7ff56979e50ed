//! A scripted OpenAI-compatible chat-completions server for tests and benchmarks.
//!
//! It speaks the real wire format: `text/event-stream` with `data:` chunks of
//! `chat.completion.chunk` objects, content in pieces, tool-call arguments split across
//! chunks by index, a usage chunk, then `data: [DONE]`; error statuses with OpenAI's error
//! body; and stalls that last until the client hangs up. It records every request body.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use serde_json::{Value, json};

/// One scripted answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// Text in pieces, then `finish` ("stop" or "length").
    Text { text: String, finish: &'static str },
    /// Optional text, then tool calls `(id, name, arguments)`, arguments split in fragments.
    Tools {
        text: Option<String>,
        calls: Vec<(String, String, Value)>,
    },
    /// A tool call whose arguments are the given raw string (for invalid JSON and sizes).
    RawToolCall {
        id: String,
        name: String,
        arguments: String,
    },
    /// An error status with OpenAI's error body.
    Status {
        status: u16,
        message: String,
        retry_after_secs: Option<u64>,
    },
    /// Headers, then nothing until the client hangs up.
    Stall,
    /// A first content chunk, then nothing until the client hangs up.
    StallAfterFirstChunk,
    /// A content chunk, then the connection closes without finish_reason or [DONE].
    Truncated,
    /// Text a word per chunk with `pause` before each: a slow model, so that a client sees
    /// the deltas arrive one by one.
    Paced { text: String, pause: Duration },
    /// A body of `size` bytes of content, streamed in chunks.
    Huge { size: usize },
    /// These bytes, as they are, with this content type: a recorded response of a real
    /// server, streamed in the pieces given.
    Raw {
        content_type: String,
        pieces: Vec<Bytes>,
    },
    /// The request, byte for byte, to a real OpenAI-compatible server at this `/v1` base
    /// URL (a llama.cpp `llama-server` in the tests that have one), and its answer back as
    /// it comes: status, content type and body. `extra` (a JSON object, or null) is merged
    /// into the request's top level first, for sampling settings a test needs (e.g.
    /// a stop string); with null the body is forwarded untouched.
    Forward { base_url: String, extra: Value },
}

impl Reply {
    pub fn text(text: &str) -> Reply {
        Reply::Text {
            text: text.to_owned(),
            finish: "stop",
        }
    }

    pub fn tool(id: &str, name: &str, args: Value) -> Reply {
        Reply::Tools {
            text: None,
            calls: vec![(id.to_owned(), name.to_owned(), args)],
        }
    }

    pub fn bash(id: &str, command: &str) -> Reply {
        Reply::tool(id, "bash", json!({"command": command}))
    }

    /// `body` with `content_type`, streamed in pieces of `piece` bytes (so events are cut at
    /// arbitrary points, as a network may cut them).
    pub fn raw(content_type: &str, body: &[u8], piece: usize) -> Reply {
        Reply::Raw {
            content_type: content_type.to_owned(),
            pieces: body
                .chunks(piece.max(1))
                .map(Bytes::copy_from_slice)
                .collect(),
        }
    }

    pub fn status(status: u16, message: &str) -> Reply {
        Reply::Status {
            status,
            message: message.to_owned(),
            retry_after_secs: None,
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// Replies for requests whose first user message contains the key, before the script.
    routes: Vec<(String, VecDeque<Reply>)>,
    script: VecDeque<Reply>,
    fallback: Option<Reply>,
    /// With no script: answer a tool result with text, anything else with this tool call.
    auto_tool: Option<(String, Value)>,
    /// With no script: do what the last user message says (see `follow_instructions`).
    instructed: bool,
    /// The `flaky` messages already refused once.
    flaky: std::collections::HashSet<String>,
    /// Per mille of requests answered with an HTTP 500, and with a stall.
    faults: (u64, u64),
    /// Requests seen, for picking the faulty ones.
    seen: u64,
    /// Whether request bodies are kept (benchmarks turn it off).
    forget: bool,
    requests: Vec<Value>,
    /// When on, how long the fake took over each request, by the request's first user text.
    times: Option<HashMap<String, Vec<Duration>>>,
    /// When on, when each request arrived, by the request's first user text.
    arrivals: Option<HashMap<String, Vec<std::time::Instant>>>,
    latency: Duration,
    usage: (u64, u64),
}

#[derive(Debug)]
pub(super) struct Shared {
    inner: Mutex<Inner>,
    hangups: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// The HTTP client of [`Reply::Forward`], made at the first forwarded request.
    forward_client: std::sync::OnceLock<Option<reqwest::Client>>,
}

/// A running fake backend.
#[derive(Clone, Debug)]
pub struct FakeLlm {
    /// The `/v1` base URL to configure as BEDROCK_LLM_BASE_URL.
    pub base_url: String,
    shared: Arc<Shared>,
}

impl FakeLlm {
    /// Starts on a free loopback port.
    pub async fn start() -> FakeLlm {
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                usage: (100, 10),
                ..Inner::default()
            }),
            hangups: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            forward_client: std::sync::OnceLock::new(),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(complete))
            .route("/v1/messages", post(messages))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("the fake LLM binds a loopback port");
        let addr = listener.local_addr().expect("a bound address");
        tokio::spawn(async move {
            let _ = axum::serve(crate::app::no_delay(listener), app).await;
        });
        FakeLlm {
            base_url: format!("http://{addr}/v1"),
            shared,
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.shared.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues replies, answered in order.
    pub fn push(&self, replies: impl IntoIterator<Item = Reply>) {
        self.inner().script.extend(replies);
    }

    /// Queues replies for the requests whose first user message contains `key` (a
    /// sub-agent's task prompt, say); they are answered before the general script.
    pub fn route(&self, key: &str, replies: impl IntoIterator<Item = Reply>) {
        self.inner()
            .routes
            .push((key.to_owned(), replies.into_iter().collect()));
    }

    /// Every turn becomes one tool call then a text answer: a request whose last message is
    /// a tool result gets the text `done: ` and the last user message's text, any other gets
    /// a call of `tool` with `args`.
    pub fn auto_tool_turns(&self, tool: &str, args: Value) {
        self.inner().auto_tool = Some((tool.to_owned(), args));
    }

    /// Turns follow their user message (soak benchmarks, the console's browser tests):
    /// `call <tool> <JSON args>` asks for that tool call, `slowly <text>` streams the text a
    /// word every 250 ms, `flaky <text>` is refused once with a 429 (Retry-After: 2) and then
    /// answered, anything else is answered `done: <text>`; a tool result is answered with
    /// text. A sub-agent (its request offers submit_result) submits at once.
    pub fn follow_instructions(&self) {
        self.inner().instructed = true;
    }

    /// Answers `errors` per mille of the requests after this with an HTTP 500 and `stalls`
    /// per mille with a stream that never ends, spread evenly.
    pub fn faults(&self, errors: u64, stalls: u64) {
        self.inner().faults = (errors.min(1000), stalls.min(1000));
    }

    /// Stops keeping request bodies (long benchmarks).
    pub fn forget_requests(&self) {
        let mut inner = self.inner();
        inner.requests = Vec::new();
        inner.forget = true;
    }

    /// Starts (over) timing requests: from the handler's start to the response it hands to
    /// the HTTP server, latency included. Benchmarks take it out of the turn times they
    /// measure, so that what is left is the service's own time.
    pub fn time_requests(&self) {
        self.inner().times = Some(HashMap::new());
    }

    /// The times taken since [`FakeLlm::time_requests`], in order of arrival, by the text of
    /// the requests' first user message; timing goes on.
    pub fn take_request_times(&self) -> HashMap<String, Vec<Duration>> {
        self.inner()
            .times
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Starts (over) noting when requests arrive (see [`FakeLlm::take_arrivals`]).
    pub fn record_arrivals(&self) {
        self.inner().arrivals = Some(HashMap::new());
    }

    /// When requests arrived since [`FakeLlm::record_arrivals`] or the last take, by the
    /// text of their first user message; noting goes on.
    pub fn take_arrivals(&self) -> HashMap<String, Vec<std::time::Instant>> {
        self.inner()
            .arrivals
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// The most requests that were in flight at once.
    pub fn max_in_flight(&self) -> usize {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }

    /// Every request after the script is used up goes to the real OpenAI-compatible server
    /// at `base_url` (see [`Reply::Forward`]); the fake still records them.
    pub fn forward_to(&self, base_url: &str, extra: Value) {
        self.fallback(Reply::Forward {
            base_url: base_url.to_owned(),
            extra,
        });
    }

    /// The reply once the script is used up (default: a short text).
    pub fn fallback(&self, reply: Reply) {
        self.inner().fallback = Some(reply);
    }

    /// A delay before every reply.
    pub fn latency(&self, latency: Duration) {
        self.inner().latency = latency;
    }

    /// The prompt and completion tokens reported in the usage chunk.
    pub fn usage(&self, prompt_tokens: u64, completion_tokens: u64) {
        self.inner().usage = (prompt_tokens, completion_tokens);
    }

    /// Every request body received, in order.
    pub fn requests(&self) -> Vec<Value> {
        self.inner().requests.clone()
    }

    /// How many stalled responses ended because the client hung up.
    pub fn hangups(&self) -> usize {
        self.shared.hangups.load(Ordering::SeqCst)
    }
}

fn chunk(delta: Value, finish: Option<&str>) -> Bytes {
    let value = json!({
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "fake",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    });
    Bytes::from(format!("data: {value}\n\n"))
}

fn usage_chunk(prompt: u64, completion: u64) -> Bytes {
    let value = json!({
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "fake",
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    });
    Bytes::from(format!("data: {value}\n\n"))
}

/// The chunks of one tool call: id and name first, then the arguments in fragments.
fn tool_call(
    chunks: &mut Vec<Bytes>,
    index: usize,
    id: &str,
    name: &str,
    fragments: impl IntoIterator<Item = String>,
) {
    chunks.push(chunk(
        json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
        None,
    ));
    for fragment in fragments {
        chunks.push(chunk(
            json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}),
            None,
        ));
    }
}

/// The end of a stream: the finish reason, the usage chunk, `[DONE]`.
fn finish(chunks: &mut Vec<Bytes>, reason: &str, prompt: u64, completion: u64) {
    chunks.push(chunk(json!({}), Some(reason)));
    chunks.push(usage_chunk(prompt, completion));
    chunks.push(Bytes::from_static(b"data: [DONE]\n\n"));
}

/// Splits `text` into about three pieces on character boundaries.
pub(super) fn pieces(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let size = chars.len().div_ceil(3).max(1);
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}

/// An error status with `body` and, when given, Retry-After.
pub(super) fn error_response(status: u16, body: &Value, retry_after_secs: Option<u64>) -> Response {
    let mut response = (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response();
    if let Some(seconds) = retry_after_secs
        && let Ok(value) = HeaderValue::from_str(&seconds.to_string())
    {
        response.headers_mut().insert(header::RETRY_AFTER, value);
    }
    response
}

/// These bytes, as they are, with this content type.
pub(super) fn raw_response(
    content_type: &str,
    pieces: Vec<Bytes>,
    shared: Arc<Shared>,
) -> Response {
    let mut response = stream_response(pieces, false, shared);
    if let Ok(value) = HeaderValue::from_str(content_type) {
        response.headers_mut().insert(header::CONTENT_TYPE, value);
    }
    response
}

/// Counts a hang-up when the response body is dropped before it ends.
struct HangupGuard {
    shared: Arc<Shared>,
    finished: bool,
}

impl Drop for HangupGuard {
    fn drop(&mut self) {
        if !self.finished {
            self.shared.hangups.fetch_add(1, Ordering::SeqCst);
        }
    }
}

pub(super) fn stream_response(
    chunks: Vec<Bytes>,
    then_stall: bool,
    shared: Arc<Shared>,
) -> Response {
    stream_paced(chunks, then_stall, Duration::ZERO, shared)
}

/// The chunks with `pause` before each one after the first.
pub(super) fn stream_paced(
    chunks: Vec<Bytes>,
    then_stall: bool,
    pause: Duration,
    shared: Arc<Shared>,
) -> Response {
    let guard = HangupGuard {
        shared,
        finished: false,
    };
    let body = futures::stream::unfold(
        (chunks.into_iter().enumerate(), guard, then_stall),
        move |(mut it, mut guard, stall)| async move {
            match it.next() {
                Some((i, bytes)) => {
                    if i > 0 && !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                    }
                    Some((Ok::<_, std::io::Error>(bytes), (it, guard, stall)))
                }
                None if stall => {
                    futures::future::pending::<()>().await;
                    None
                }
                None => {
                    guard.finished = true;
                    drop(guard);
                    None
                }
            }
        },
    );
    let mut response = Response::new(Body::from_stream(body));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    response
}

/// What routing needs of a request: the text of the first user message (a JSON array of
/// parts, for one with images), the text of the last one, and whether the last message is a
/// tool result.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Keys {
    pub(super) first_user: String,
    pub(super) last_user: String,
    pub(super) last_is_tool: bool,
}

/// The fake must cost little next to the service it stands in front of, and a request
/// carries the whole history, so the body is not parsed when it need not be. In compact JSON
/// (what the gateway sends) every `"role":"` is a message's role: inside a string its quotes
/// would be escaped. Anything else is parsed ([`Peek`]).
fn route_keys(body: &[u8]) -> Keys {
    quick_route_keys(body).unwrap_or_else(|| Peek::route_keys(body))
}

fn quick_route_keys(body: &[u8]) -> Option<Keys> {
    const ROLE: &[u8] = b"\"role\":\"";
    const USER: &[u8] = b"\"role\":\"user\",\"content\":";
    let last = memchr::memmem::rfind(body, ROLE)? + ROLE.len();
    let last_is_tool = body[last..].starts_with(b"tool\"");
    let content_at = |at: usize| -> Option<String> {
        let content: &serde_json::value::RawValue =
            serde_json::Deserializer::from_slice(&body[at + USER.len()..])
                .into_iter()
                .next()?
                .ok()?;
        Some(
            serde_json::from_str::<String>(content.get())
                .unwrap_or_else(|_| content.get().to_owned()),
        )
    };
    let (first_user, last_user) = match memchr::memmem::find(body, USER) {
        None if memchr::memmem::find(body, b"\"role\":\"user\"").is_some() => return None,
        None => (String::new(), String::new()),
        Some(first) => {
            // Every user message must have its content next for the last one found to be
            // the last user message.
            let users = memchr::memmem::find_iter(body, b"\"role\":\"user\"").count();
            if users != memchr::memmem::find_iter(body, USER).count() {
                return None;
            }
            let last = memchr::memmem::rfind(body, USER).unwrap_or(first);
            (content_at(first)?, content_at(last)?)
        }
    };
    Some(Keys {
        first_user,
        last_user,
        last_is_tool,
    })
}

/// The whole parse behind [`route_keys`], for bodies it cannot read quickly.
#[derive(serde::Deserialize)]
struct Peek<'a> {
    #[serde(borrow, default)]
    messages: Vec<PeekMessage<'a>>,
}

#[derive(serde::Deserialize)]
struct PeekMessage<'a> {
    #[serde(borrow)]
    role: std::borrow::Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<&'a serde_json::value::RawValue>,
}

impl Peek<'_> {
    /// [`route_keys`] by a whole parse (nothing, for a body that is not JSON).
    fn route_keys(body: &[u8]) -> Keys {
        let peek: Peek<'_> = serde_json::from_slice(body).unwrap_or(Peek {
            messages: Vec::new(),
        });
        let mut users = peek.messages.iter().filter(|m| m.role == "user");
        Keys {
            first_user: text_of(users.next()),
            last_user: text_of(peek.messages.iter().rev().find(|m| m.role == "user")),
            last_is_tool: peek.messages.last().is_some_and(|m| m.role == "tool"),
        }
    }
}

/// A message's text (a JSON array of parts, for one with images); empty without one.
fn text_of(message: Option<&PeekMessage<'_>>) -> String {
    let Some(content) = message.and_then(|m| m.content) else {
        return String::new();
    };
    serde_json::from_str::<String>(content.get()).unwrap_or_else(|_| content.get().to_owned())
}

/// Counts requests in flight while it lives.
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(shared: &Arc<Shared>) -> Self {
        let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        shared.max_in_flight.fetch_max(now, Ordering::SeqCst);
        Self(shared.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The API a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    OpenAi,
    Anthropic,
}

mod anthropic;

/// The OpenAI-compatible API. A history a strict backend refuses is refused as llama-server
/// refuses it (`strict_refusal`), so that every test holds the gateway to sending histories
/// any backend accepts.
async fn complete(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    // A fake that forwards to a real server leaves the judging of histories to it. One that
    // keeps no requests (a benchmark's) judges none either: the full parse of every request
    // would cost CPU on the machine the server under measurement runs on.
    let judges = {
        let inner = shared.inner.lock().unwrap_or_else(|e| e.into_inner());
        !inner.forget && !matches!(inner.fallback, Some(Reply::Forward { .. }))
    };
    if judges && let Some((status, message)) = strict_refusal(&body) {
        let mut inner = shared.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .requests
            .push(serde_json::from_slice(&body).unwrap_or(Value::Null));
        drop(inner);
        // As llama-server answers it.
        let kind = if status == StatusCode::BAD_REQUEST {
            "invalid_request_error"
        } else {
            "server_error"
        };
        return (
            status,
            axum::Json(
                json!({"error": {"code": status.as_u16(), "message": message, "type": kind}}),
            ),
        )
            .into_response();
    }
    serve(shared, body, Api::OpenAi).await
}

/// What llama-server refuses of a history, with its status and words: past tool-call
/// arguments that do not parse (HTTP 500), and two or more assistant messages at the end of
/// the list (HTTP 400). The body is read once, for both.
fn strict_refusal(body: &[u8]) -> Option<(StatusCode, String)> {
    #[derive(serde::Deserialize)]
    struct Body {
        #[serde(default)]
        messages: Vec<Message>,
    }
    #[derive(serde::Deserialize)]
    struct Message {
        #[serde(default)]
        role: String,
        #[serde(default)]
        tool_calls: Option<Vec<Call>>,
    }
    #[derive(serde::Deserialize)]
    struct Call {
        function: Function,
    }
    #[derive(serde::Deserialize)]
    struct Function {
        #[serde(default)]
        arguments: Value,
    }
    let parsed: Body = serde_json::from_slice(body).ok()?;
    let unparsable = parsed
        .messages
        .iter()
        .flat_map(|m| m.tool_calls.iter().flatten())
        .find_map(|call| {
            let text = call.function.arguments.as_str()?;
            serde_json::from_str::<Value>(text)
                .err()
                .map(|e| format!("Failed to parse tool call arguments as JSON: {e}"))
        });
    if let Some(message) = unparsable {
        return Some((StatusCode::INTERNAL_SERVER_ERROR, message));
    }
    let assistants_at_the_end = parsed
        .messages
        .iter()
        .rev()
        .take_while(|m| m.role == "assistant")
        .count();
    (assistants_at_the_end >= 2).then(|| {
        (
            StatusCode::BAD_REQUEST,
            "Cannot have 2 or more assistant messages at the end of the list.".to_owned(),
        )
    })
}

/// Anthropic's Messages API: the same script, answered in its event stream. A request that
/// Anthropic would refuse is refused as Anthropic refuses it (`anthropic::check`).
async fn messages(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err((status, message)) = anthropic::check(&headers, &body) {
        let mut inner = shared.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .requests
            .push(serde_json::from_slice(&body).unwrap_or(Value::Null));
        drop(inner);
        return anthropic::reply_with(Reply::status(status, &message), 0, 0, shared.clone());
    }
    serve(shared, body, Api::Anthropic).await
}

async fn serve(shared: Arc<Shared>, body: Bytes, api: Api) -> Response {
    let started = std::time::Instant::now();
    let keys = match api {
        Api::OpenAi => route_keys(&body),
        Api::Anthropic => anthropic::route_keys(&body),
    };
    let (reply, latency, (prompt, completion)) = {
        let mut inner = shared.inner.lock().unwrap_or_else(|e| e.into_inner());
        if !inner.forget {
            inner
                .requests
                .push(serde_json::from_slice(&body).unwrap_or(Value::Null));
        }
        if let Some(arrivals) = &mut inner.arrivals {
            arrivals
                .entry(keys.first_user.clone())
                .or_default()
                .push(started);
        }
        let routed = inner
            .routes
            .iter_mut()
            .find(|(key, replies)| !replies.is_empty() && keys.first_user.contains(key.as_str()))
            .and_then(|(_, replies)| replies.pop_front());
        let auto = inner.auto_tool.as_ref().map(|(tool, args)| {
            if keys.last_is_tool {
                Reply::text(&format!("done: {}", keys.last_user))
            } else {
                let id = format!("call_{}", uuid::Uuid::now_v7().simple());
                Reply::tool(&id, tool, args.clone())
            }
        });
        inner.seen += 1;
        // Spread evenly: a fixed odd multiplier walks every residue mod 1000.
        let dice = inner.seen.wrapping_mul(617) % 1000;
        let (errors, stalls) = inner.faults;
        let fault = if dice < errors {
            Some(Reply::status(500, "a fault of the fake"))
        } else if dice < errors + stalls {
            Some(Reply::Stall)
        } else {
            None
        };
        let seen = inner.seen;
        let instructed = if !inner.instructed {
            None
        } else if keys.last_user.starts_with("flaky ")
            && !keys.last_is_tool
            && inner.flaky.insert(keys.last_user.clone())
        {
            // The first request of a `flaky` message is rate-limited, the retry answered.
            Some(Reply::Status {
                status: 429,
                message: "slow down (a flaky message of the fake)".to_owned(),
                retry_after_secs: Some(2),
            })
        } else {
            Some(instructed_reply(&body, &keys, seen))
        };
        let reply = fault
            .or(routed)
            .or_else(|| inner.script.pop_front())
            .or(instructed)
            .or(auto)
            .or_else(|| inner.fallback.clone())
            .unwrap_or_else(|| Reply::text("ok"));
        (reply, inner.latency, inner.usage)
    };
    let in_flight = InFlight::new(&shared);
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    let response = match (api, reply) {
        (Api::OpenAi, Reply::Forward { base_url, extra }) => {
            forward(&shared, &base_url, &extra, body).await
        }
        (_, Reply::Forward { .. }) => (
            StatusCode::NOT_IMPLEMENTED,
            "the fake forwards only chat completions",
        )
            .into_response(),
        (Api::OpenAi, reply) => reply_with(reply, prompt, completion, shared.clone()).await,
        (Api::Anthropic, reply) => anthropic::reply_with(reply, prompt, completion, shared.clone()),
    };
    drop(in_flight);
    let mut inner = shared.inner.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(times) = &mut inner.times {
        times
            .entry(keys.first_user)
            .or_default()
            .push(started.elapsed());
    }
    response
}

/// [`Reply::Forward`]: `body` (with `extra` merged in) to `{base_url}/chat/completions`,
/// the answer streamed back as it arrives. A server that cannot be reached is a 502.
async fn forward(shared: &Shared, base_url: &str, extra: &Value, body: Bytes) -> Response {
    let body = match extra.as_object() {
        Some(extra) if !extra.is_empty() => {
            match serde_json::from_slice::<serde_json::Map<String, Value>>(&body) {
                Ok(mut request) => {
                    request.extend(extra.clone());
                    Bytes::from(Value::Object(request).to_string())
                }
                Err(_) => body,
            }
        }
        _ => body,
    };
    // One client for the fake's forwarded requests, its connections kept (a fake lives in
    // one runtime; a client shared between runtimes would reuse dead connections).
    let client = shared.forward_client.get_or_init(|| {
        crate::install_crypto();
        reqwest::Client::builder().no_proxy().build().ok()
    });
    let Some(client) = client else {
        return (StatusCode::BAD_GATEWAY, "no HTTP client").into_response();
    };
    let sent = client
        .post(format!(
            "{}/chat/completions",
            base_url.trim_end_matches('/')
        ))
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await;
    let upstream = match sent {
        Ok(upstream) => upstream,
        Err(e) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    };
    let status =
        StatusCode::from_u16(upstream.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = upstream.headers().get(header::CONTENT_TYPE).cloned();
    let mut response = Response::new(Body::from_stream(upstream.bytes_stream()));
    *response.status_mut() = status;
    if let Some(content_type) = content_type {
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, content_type);
    }
    response
}

/// What `follow_instructions` answers.
fn instructed_reply(body: &[u8], keys: &Keys, n: u64) -> Reply {
    let id = format!("call_{n}");
    if memchr::memmem::find(body, b"\"name\":\"submit_result\"").is_some() {
        return Reply::tool(&id, "submit_result", json!({"result": "sub-task done"}));
    }
    if keys.last_is_tool {
        return Reply::text("done");
    }
    if let Some(call) = keys.last_user.strip_prefix("call ")
        && let Some((tool, args)) = call.split_once(' ')
        && let Ok(args) = serde_json::from_str::<Value>(args)
    {
        return Reply::tool(&id, tool, args);
    }
    if let Some(text) = keys.last_user.strip_prefix("slowly ") {
        return Reply::Paced {
            text: text.to_owned(),
            pause: Duration::from_millis(250),
        };
    }
    Reply::text(&format!("done: {}", keys.last_user))
}

async fn reply_with(reply: Reply, prompt: u64, completion: u64, shared: Arc<Shared>) -> Response {
    let role = chunk(json!({"role": "assistant", "content": ""}), None);
    match reply {
        Reply::Text {
            text,
            finish: reason,
        } => {
            let mut chunks = vec![role];
            chunks.extend(
                pieces(&text)
                    .into_iter()
                    .map(|p| chunk(json!({"content": p}), None)),
            );
            finish(&mut chunks, reason, prompt, completion);
            stream_response(chunks, false, shared)
        }
        Reply::Tools { text, calls } => {
            let mut chunks = vec![role];
            if let Some(text) = text {
                chunks.extend(
                    pieces(&text)
                        .into_iter()
                        .map(|p| chunk(json!({"content": p}), None)),
                );
            }
            for (index, (id, name, args)) in calls.into_iter().enumerate() {
                tool_call(&mut chunks, index, &id, &name, pieces(&args.to_string()));
            }
            finish(&mut chunks, "tool_calls", prompt, completion);
            stream_response(chunks, false, shared)
        }
        Reply::RawToolCall {
            id,
            name,
            arguments,
        } => {
            let mut chunks = vec![role];
            let fragments = arguments
                .as_bytes()
                .chunks(4096)
                .map(|piece| String::from_utf8_lossy(piece).into_owned());
            tool_call(&mut chunks, 0, &id, &name, fragments);
            finish(&mut chunks, "tool_calls", prompt, completion);
            stream_response(chunks, false, shared)
        }
        Reply::Status {
            status,
            message,
            retry_after_secs,
        } => {
            let body = json!({"error": {"message": message, "type": "fake_error", "param": null, "code": null}});
            error_response(status, &body, retry_after_secs)
        }
        Reply::Raw {
            content_type,
            pieces,
        } => raw_response(&content_type, pieces, shared),
        Reply::Stall => stream_response(Vec::new(), true, shared),
        Reply::StallAfterFirstChunk => stream_response(
            vec![role, chunk(json!({"content": "partial"}), None)],
            true,
            shared,
        ),
        Reply::Paced { text, pause } => {
            let mut chunks = vec![role];
            chunks.extend(
                text.split_inclusive(' ')
                    .map(|word| chunk(json!({"content": word}), None)),
            );
            finish(&mut chunks, "stop", prompt, completion);
            stream_paced(chunks, false, pause, shared)
        }
        Reply::Truncated => stream_response(
            vec![role, chunk(json!({"content": "cut"}), None)],
            false,
            shared,
        ),
        Reply::Huge { size } => {
            let piece = "x".repeat(1024);
            let mut chunks = vec![role];
            for _ in 0..size.div_ceil(1024) {
                chunks.push(chunk(json!({"content": piece}), None));
            }
            chunks.push(chunk(json!({}), Some("stop")));
            chunks.push(Bytes::from_static(b"data: [DONE]\n\n"));
            stream_response(chunks, false, shared)
        }
        // Answered by `serve`, which has the request's body.
        Reply::Forward { .. } => StatusCode::NOT_IMPLEMENTED.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past tool-call arguments that are not JSON are refused, as llama-server refuses
    /// them; JSON ones (a string holding an object) are not.
    #[test]
    fn unparsable_past_arguments_are_refused() {
        let with = |arguments: Value| {
            json!({"messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "bash", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "failed"},
            ]})
            .to_string()
        };
        let refused = strict_refusal(with(json!("{\"command\":")).as_bytes()).map(|(_, m)| m);
        assert!(
            refused
                .as_deref()
                .is_some_and(|m| m.starts_with("Failed to parse tool call arguments as JSON")),
            "{refused:?}"
        );
        assert_eq!(
            strict_refusal(with(json!("{\"command\": \"ls\"}")).as_bytes()),
            None
        );
        assert_eq!(
            strict_refusal(
                with(json!("{\"invalid_arguments\": \"{\\\"command\\\":\"}")).as_bytes()
            ),
            None
        );
    }

    /// Two assistant messages at the end are refused as llama-server refuses them (400); one
    /// is not, nor two apart.
    #[test]
    fn two_assistant_messages_at_the_end_are_refused() {
        let with = |roles: &[&str]| {
            let messages: Vec<Value> = roles
                .iter()
                .map(|role| json!({"role": role, "content": "x"}))
                .collect();
            json!({ "messages": messages }).to_string()
        };
        let refused = strict_refusal(with(&["user", "assistant", "assistant"]).as_bytes());
        assert_eq!(
            refused.map(|(status, _)| status),
            Some(StatusCode::BAD_REQUEST)
        );
        for fine in [
            &["user", "assistant"][..],
            &["user", "assistant", "user", "assistant"][..],
            &["assistant", "assistant", "user"][..],
        ] {
            assert_eq!(strict_refusal(with(fine).as_bytes()), None, "{fine:?}");
        }
    }

    /// The quick read of the routing keys agrees with the whole parse, and a body it cannot
    /// read quickly is parsed.
    #[test]
    fn route_keys_agree_with_the_whole_parse() {
        let bodies = [
            // What the gateway sends: compact, a tool result last, quotes and role-like text
            // inside strings, a tool parameter named role.
            concat!(
                r#"{"model":"m","messages":[{"role":"system","content":"be \"role\":\"tool\" brief"},"#,
                r#"{"role":"user","content":"spin \"role\":\"user\" now"},"#,
                r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","#,
                r#""function":{"name":"bash","arguments":"{\"role\":\"x\"}"}}]},"#,
                r#"{"role":"tool","content":"out","tool_call_id":"c"}],"#,
                r#""tools":[{"type":"function","function":{"name":"t","#,
                r#""parameters":{"properties":{"role":{"type":"string"}}}}}]}"#
            ),
            // A user message with images: its content is an array of parts.
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"look"}]},{"role":"assistant","content":"seen"}]}"#,
            // No user message at all.
            r#"{"messages":[{"role":"system","content":"s"}]}"#,
        ];
        for body in bodies {
            assert!(quick_route_keys(body.as_bytes()).is_some(), "{body}");
            assert_eq!(
                route_keys(body.as_bytes()),
                Peek::route_keys(body.as_bytes()),
                "{body}"
            );
        }
        assert_eq!(
            route_keys(bodies[0].as_bytes()),
            Keys {
                first_user: "spin \"role\":\"user\" now".to_owned(),
                last_user: "spin \"role\":\"user\" now".to_owned(),
                last_is_tool: true,
            }
        );
        let two_turns = r#"{"messages":[{"role":"user","content":"one"},{"role":"assistant","content":"a"},{"role":"user","content":"two"}]}"#;
        assert_eq!(
            route_keys(two_turns.as_bytes()),
            Keys {
                first_user: "one".to_owned(),
                last_user: "two".to_owned(),
                last_is_tool: false,
            }
        );
        assert_eq!(
            route_keys(two_turns.as_bytes()),
            Peek::route_keys(two_turns.as_bytes())
        );
        // Pretty-printed, or a user message whose content is not next: the whole parse.
        let pretty = serde_json::to_string_pretty(&json!({"messages": [
            {"role": "user", "content": "hi"}, {"role": "tool", "content": "r"}]}))
        .expect("JSON");
        let reordered = r#"{"messages":[{"role":"user","name":"n","content":"hi"}]}"#;
        for body in [pretty.as_str(), reordered] {
            assert!(quick_route_keys(body.as_bytes()).is_none(), "{body}");
            assert_eq!(
                route_keys(body.as_bytes()),
                Peek::route_keys(body.as_bytes()),
                "{body}"
            );
        }
    }

    /// Request times are kept per first user message, in order, the latency included.
    #[tokio::test]
    async fn request_times_are_kept_by_first_user_message() {
        crate::install_crypto();
        let fake = FakeLlm::start().await;
        fake.time_requests();
        fake.latency(Duration::from_millis(20));
        let client = reqwest::Client::new();
        for first in ["a", "b", "a"] {
            let body = json!({"model": "m", "stream": true, "messages": [
                {"role": "user", "content": first}, {"role": "assistant", "content": "x"}]});
            let response = client
                .post(format!("{}/chat/completions", fake.base_url))
                .json(&body)
                .send()
                .await
                .expect("the fake answers");
            assert!(response.status().is_success());
            let text = response.text().await.expect("a body");
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        }
        let times = fake.take_request_times();
        assert_eq!(times.len(), 2, "{times:?}");
        assert_eq!(times["a"].len(), 2);
        assert_eq!(times["b"].len(), 1);
        assert!(
            times
                .values()
                .flatten()
                .all(|t| *t >= Duration::from_millis(20))
        );
        // Taken means gone; timing goes on.
        assert!(fake.take_request_times().is_empty());
    }
}
