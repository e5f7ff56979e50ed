//! Anthropic's Messages API, beside the OpenAI-compatible path: for the models whose
//! `[models."..."] provider` is `anthropic`.
//!
//! No SDK: the maintained Rust crates for this API retry on their own, hide the raw byte
//! stream (so the gateway's byte and idle limits could not be enforced on it) or lag the
//! API. The request is plain JSON over the gateway's reqwest client. The response is a
//! `text/event-stream`, parsed by `eventsource-stream`, a maintained SSE parser that also
//! handles events cut at any byte, CRLF line ends and comments. Each event is translated
//! into the chunk type of the OpenAI path (chunk.rs), and the same [`Accumulator`] assembles
//! the reply. Tool ids, argument limits, bad tool JSON and truncation are therefore handled
//! exactly as they are for every other backend.
//!
//! What Anthropic's API wants differently:
//! - the system prompt is a top-level `system`;
//! - tool results are `tool_result` blocks of a user message: each is stored on its own, and
//!   runs of messages of one role are merged when the request is written, tool_result
//!   blocks first, as the API requires;
//! - images are base64 `image` blocks;
//! - a tool's input must be an object;
//! - two `cache_control` breakpoints: one on the system prompt (which caches the tools with
//!   it) and one on the last message, so each step of a turn reads the history before it from
//!   the cache. The usage of `message_start` counts cache reads and writes, which go to the
//!   metrics and the request's span.

use std::sync::Arc;
use std::time::Instant;

use base64::Engine as _;
use futures::StreamExt as _;
use serde::ser::SerializeSeq as _;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::chunk::{Choice, Chunk, Delta, FunctionDelta, ToolCallDelta, UsageIn};
use super::request::{ImageLoader, RequestContext, Wire, system_prompt};
use super::{Failure, Shared};
use crate::state_machine::{ErrorKind, LlmReply, MessageContent};

/// The API version sent in `anthropic-version`.
pub const API_VERSION: &str = "2023-06-01";

/// The wire form of a stored message, as Anthropic's API gets it.
pub fn wire(content: &MessageContent) -> Wire {
    if matches!(content, MessageContent::User { images, .. } if !images.is_empty()) {
        return Wire::Images(content.clone());
    }
    match convert(content, &|_| None).map(|m| serde_json::value::to_raw_value(&m)) {
        Some(Ok(json)) => Wire::Json(json),
        Some(Err(_)) => Wire::Images(content.clone()),
        None => Wire::Skip,
    }
}

/// The messages of `history` that carry images, converted, in order.
pub fn images(history: &[Wire], loader: ImageLoader<'_>) -> serde_json::Result<Vec<Box<RawValue>>> {
    history
        .iter()
        .filter_map(|message| match message {
            Wire::Images(content) => convert(content, loader),
            Wire::Skip | Wire::Json(_) | Wire::Thought { .. } => None,
        })
        .map(|message| serde_json::value::to_raw_value(&message))
        .collect()
}

fn text_block(text: &str) -> Value {
    json!({"type": "text", "text": text})
}

fn convert(content: &MessageContent, images: ImageLoader<'_>) -> Option<Value> {
    Some(match content {
        MessageContent::User { text, images: refs } => {
            let mut blocks = Vec::with_capacity(refs.len() + 1);
            for image in refs {
                blocks.push(match images(&image.id) {
                    // REQ-BED-013: already resized when it was stored.
                    Some((media_type, bytes)) => json!({
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": media_type,
                            "data": base64::engine::general_purpose::STANDARD.encode(bytes),
                        },
                    }),
                    None => text_block(&format!("[image {} is no longer available]", image.id)),
                });
            }
            // Anthropic refuses empty text blocks.
            if !text.is_empty() || blocks.is_empty() {
                blocks.push(text_block(if text.is_empty() { "(no text)" } else { text }));
            }
            json!({"role": "user", "content": blocks})
        }
        MessageContent::Agent {
            text, tool_uses, ..
        } => {
            let mut blocks = Vec::with_capacity(tool_uses.len() + 1);
            // Without its trailing whitespace: a cut answer is continued by a request that
            // ends with it, and Anthropic refuses a final assistant text that ends in
            // whitespace.
            if let Some(text) = text.as_deref().map(str::trim_end).filter(|t| !t.is_empty()) {
                blocks.push(text_block(text));
            }
            for tool in tool_uses {
                // The input must be an object: arguments that were not JSON go back as the
                // string they were, under a key that says so.
                let input = if tool.input.is_object() {
                    tool.input.clone()
                } else {
                    json!({"invalid_arguments": tool.input})
                };
                blocks.push(
                    json!({"type": "tool_use", "id": tool.id, "name": tool.name, "input": input}),
                );
            }
            if blocks.is_empty() {
                return None;
            }
            json!({"role": "assistant", "content": blocks})
        }
        MessageContent::Tool(result) => json!({
            "role": "user",
            "content": [{
                "type": "tool_result",
                "tool_use_id": result.tool_use_id,
                // Anthropic refuses an empty result that is an error.
                "content": if result.output.is_empty() { "(no output)" } else { &result.output },
                "is_error": !result.ok,
            }],
        }),
        // Injected context goes as a user turn, as on the OpenAI path.
        MessageContent::System { text } => json!({"role": "user", "content": [text_block(text)]}),
        MessageContent::Error { .. } => return None,
    })
}

/// The request's tools in Anthropic's form, made once per kind of agent.
fn tools_json(is_sub_agent: bool, only_submit: bool) -> serde_json::Result<&'static RawValue> {
    static CACHE: super::request::ToolsCache = super::request::ToolsCache::new();
    CACHE.get(is_sub_agent, only_submit, |tools| {
        tools
            .iter()
            .map(|tool| {
                json!({
                    "name": tool.name,
                    "description": tool.description,
                    "input_schema": tool.parameters,
                })
            })
            .collect::<Vec<Value>>()
    })
}

/// The history with the last message marked as a cache breakpoint.
#[derive(Debug)]
struct Messages<'a> {
    history: &'a [Wire],
    images: &'a [Box<RawValue>],
}

impl Messages<'_> {
    /// The pieces in order (messages with images taken from `images`).
    fn pieces(&self) -> impl Iterator<Item = &RawValue> {
        let mut images = self.images.iter();
        self.history
            .iter()
            .filter_map(move |message| match message {
                Wire::Skip => None,
                Wire::Json(json) | Wire::Thought { plain: json, .. } => Some(&**json),
                Wire::Images(_) => images.next().map(|json| &**json),
            })
    }
}

/// A stored piece as the serializer reads it: its role and its content blocks, borrowed.
#[derive(serde::Deserialize)]
struct Piece<'a> {
    #[serde(borrow)]
    role: &'a str,
    #[serde(borrow)]
    content: &'a RawValue,
}

/// A content block's type, read without reading the rest of it.
#[derive(serde::Deserialize)]
struct BlockKind<'a> {
    #[serde(borrow, rename = "type")]
    kind: &'a str,
}

/// One message as sent: a stored piece as it is, or several merged.
#[derive(serde::Serialize)]
struct Out<'a> {
    role: &'a str,
    content: OutContent<'a>,
}

#[derive(serde::Serialize)]
#[serde(untagged)]
enum OutContent<'a> {
    Raw(&'a RawValue),
    Blocks(Vec<OutBlock<'a>>),
}

#[derive(serde::Serialize)]
#[serde(untagged)]
enum OutBlock<'a> {
    Raw(&'a RawValue),
    /// The last block, with the cache breakpoint.
    Marked(Value),
}

impl serde::Serialize for Messages<'_> {
    /// Anthropic wants roles to alternate, and every tool_result of an assistant message in
    /// the one user message right after it, before anything else in it. Stored pieces are
    /// one message each (each tool result its own), so runs of one role are merged here,
    /// tool_result blocks first. The last block of the last message is the cache breakpoint.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let mut groups: Vec<(&str, Vec<&RawValue>)> = Vec::new();
        for raw in self.pieces() {
            let piece: Piece<'_> = serde_json::from_str(raw.get()).map_err(S::Error::custom)?;
            match groups.last_mut() {
                Some((role, contents)) if *role == piece.role => contents.push(piece.content),
                Some(_) | None => groups.push((piece.role, vec![piece.content])),
            }
        }
        let last = groups.len().saturating_sub(1);
        let mut seq = serializer.serialize_seq(Some(groups.len()))?;
        for (at, (role, contents)) in groups.into_iter().enumerate() {
            if at != last && contents.len() == 1 {
                seq.serialize_element(&Out {
                    role,
                    content: OutContent::Raw(contents[0]),
                })?;
                continue;
            }
            let mut results = Vec::new();
            let mut others = Vec::new();
            for content in contents {
                let blocks: Vec<&RawValue> =
                    serde_json::from_str(content.get()).map_err(S::Error::custom)?;
                for block in blocks {
                    let kind: BlockKind<'_> =
                        serde_json::from_str(block.get()).map_err(S::Error::custom)?;
                    if kind.kind == "tool_result" {
                        results.push(OutBlock::Raw(block));
                    } else {
                        others.push(OutBlock::Raw(block));
                    }
                }
            }
            results.append(&mut others);
            if at == last
                && let Some(OutBlock::Raw(block)) = results.pop()
            {
                results.push(OutBlock::Marked(with_breakpoint(block)));
            }
            seq.serialize_element(&Out {
                role,
                content: OutContent::Blocks(results),
            })?;
        }
        seq.end()
    }
}

/// A content block with `cache_control` on it: the one block of the history that is parsed
/// whole again per request.
fn with_breakpoint(block: &RawValue) -> Value {
    let mut value: Value = serde_json::from_str(block.get()).unwrap_or(Value::Null);
    if let Some(object) = value.as_object_mut() {
        object.insert("cache_control".into(), json!({"type": "ephemeral"}));
    }
    value
}

/// The body of a streaming Messages request.
#[derive(Debug, serde::Serialize)]
pub struct Body<'a> {
    model: &'a str,
    max_tokens: u32,
    system: [Value; 1],
    messages: Messages<'a>,
    #[serde(skip_serializing_if = "super::request::Tools::is_empty")]
    tools: super::request::Tools<'a>,
    /// `{"type": "none"}` for the summary request: the history's tool blocks need the tools
    /// defined, but none may be called.
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<Value>,
    stream: bool,
}

/// The body of the streaming request for `history`, its messages with images converted by
/// [`images`].
pub fn body<'a>(
    ctx: &RequestContext<'a>,
    history: &'a [Wire],
    images: &'a [Box<RawValue>],
) -> serde_json::Result<Body<'a>> {
    let tools = super::request::with_mcp(
        tools_json(ctx.is_sub_agent, ctx.only_submit)?,
        ctx,
        |name, description, schema| {
            json!({
                "name": name,
                "description": description,
                "input_schema": schema,
            })
        },
    )?;
    Ok(Body {
        model: ctx.model,
        max_tokens: ctx.max_output_tokens,
        system: [json!({
            "type": "text",
            "text": system_prompt(ctx),
            "cache_control": {"type": "ephemeral"},
        })],
        messages: Messages { history, images },
        tool_choice: (ctx.no_tools && !tools.is_empty()).then(|| json!({"type": "none"})),
        tools,
        stream: true,
    })
}

/// Usage as `message_start` and `message_delta` report it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheUsage {
    pub read: u64,
    pub written: u64,
}

/// Turns Anthropic's events into the chunks of the OpenAI path.
#[derive(Debug, Default)]
pub struct Translator {
    /// The kind of each content block, by index: tool calls are numbered among themselves.
    tool_index: Vec<(u64, u64)>,
    tools: u64,
    input_tokens: u64,
    pub cache: CacheUsage,
    /// `message_stop` was seen: the answer is complete.
    pub done: bool,
}

impl Translator {
    /// The chunk one event stands for (`None`: nothing to add), or the failure it reports.
    pub fn event(&mut self, name: &str, data: &str) -> Result<Option<Chunk>, Failure> {
        let value: Value = match serde_json::from_str(data) {
            Ok(value) => value,
            Err(_) if name == "ping" || data.trim().is_empty() => return Ok(None),
            Err(e) => {
                return Err(Failure::new(
                    ErrorKind::Unknown,
                    format!(
                        "the backend sent an event that is not JSON ({e}): {}",
                        crate::tools::preview(data, 200)
                    ),
                ));
            }
        };
        // The event's own `type` is the authority; the `event:` line only names it.
        let kind = value.get("type").and_then(Value::as_str).unwrap_or(name);
        let chunk = match kind {
            "message_start" => {
                let usage = value.pointer("/message/usage");
                let count = |field: &str| {
                    usage
                        .and_then(|u| u.get(field))
                        .and_then(Value::as_u64)
                        .unwrap_or(0)
                };
                self.cache = CacheUsage {
                    read: count("cache_read_input_tokens"),
                    written: count("cache_creation_input_tokens"),
                };
                // What the context holds: cached or not, every input token is in it.
                self.input_tokens = count("input_tokens") + self.cache.read + self.cache.written;
                return Ok(None);
            }
            "content_block_start" => {
                let index = value.get("index").and_then(Value::as_u64).unwrap_or(0);
                let block = value.get("content_block").unwrap_or(&Value::Null);
                match block.get("type").and_then(Value::as_str) {
                    Some("tool_use" | "server_tool_use") => {
                        let n = self.tools;
                        self.tools += 1;
                        self.tool_index.push((index, n));
                        // The input arrives in input_json_delta events; a non-empty object
                        // here (some servers send it whole) is the input.
                        let input = block
                            .get("input")
                            .filter(|i| i.as_object().is_some_and(|o| !o.is_empty()))
                            .map(|i| Value::String(i.to_string()));
                        delta(Delta {
                            tool_calls: vec![ToolCallDelta {
                                index: Some(n),
                                id: block.get("id").and_then(Value::as_str).map(str::to_owned),
                                function: FunctionDelta {
                                    name: block
                                        .get("name")
                                        .and_then(Value::as_str)
                                        .map(str::to_owned),
                                    arguments: input,
                                },
                                extra_content: None,
                            }],
                            ..Delta::default()
                        })
                    }
                    Some("text") => text_delta(block.get("text")),
                    Some("thinking") => thinking_delta(block.get("thinking")),
                    Some(_) | None => return Ok(None),
                }
            }
            "content_block_delta" => {
                let index = value.get("index").and_then(Value::as_u64).unwrap_or(0);
                let d = value.get("delta").unwrap_or(&Value::Null);
                match d.get("type").and_then(Value::as_str) {
                    Some("text_delta") => text_delta(d.get("text")),
                    Some("thinking_delta") => thinking_delta(d.get("thinking")),
                    Some("input_json_delta") => {
                        let Some(&(_, n)) = self.tool_index.iter().rev().find(|(i, _)| *i == index)
                        else {
                            return Err(Failure::new(
                                ErrorKind::Unknown,
                                format!(
                                    "the backend sent tool input for block {index}, which is not a tool call"
                                ),
                            ));
                        };
                        delta(Delta {
                            tool_calls: vec![ToolCallDelta {
                                index: Some(n),
                                function: FunctionDelta {
                                    arguments: d.get("partial_json").cloned(),
                                    ..FunctionDelta::default()
                                },
                                ..ToolCallDelta::default()
                            }],
                            ..Delta::default()
                        })
                    }
                    // signature_delta, citations_delta, ...: nothing the reply keeps.
                    Some(_) | None => return Ok(None),
                }
            }
            "message_delta" => {
                let reason = value
                    .pointer("/delta/stop_reason")
                    .and_then(Value::as_str)
                    .map(|reason| match reason {
                        "max_tokens" | "model_context_window_exceeded" => "length",
                        "tool_use" => "tool_calls",
                        // end_turn, stop_sequence, pause_turn, refusal
                        _ => "stop",
                    });
                let output = value
                    .pointer("/usage/output_tokens")
                    .and_then(Value::as_u64);
                Chunk {
                    choices: reason
                        .map(|reason| Choice {
                            index: Some(0),
                            delta: Delta::default(),
                            finish_reason: Some(reason.to_owned()),
                        })
                        .into_iter()
                        .collect(),
                    usage: Some(UsageIn {
                        prompt_tokens: Some(self.input_tokens),
                        completion_tokens: output,
                    }),
                    ..Chunk::default()
                }
            }
            "message_stop" => {
                self.done = true;
                return Ok(None);
            }
            "error" => return Err(stream_error(&value)),
            // ping, content_block_stop, and whatever comes later.
            _ => return Ok(None),
        };
        Ok(Some(chunk))
    }
}

fn delta(delta: Delta) -> Chunk {
    Chunk {
        choices: vec![Choice {
            index: Some(0),
            delta,
            finish_reason: None,
        }],
        ..Chunk::default()
    }
}

fn text_delta(text: Option<&Value>) -> Chunk {
    delta(Delta {
        content: text
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .map(str::to_owned),
        ..Delta::default()
    })
}

fn thinking_delta(text: Option<&Value>) -> Chunk {
    delta(Delta {
        reasoning: text
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .map(str::to_owned),
        ..Delta::default()
    })
}

/// The failure an `error` event, or an error body, reports (`{"type": "error", "error":
/// {"type", "message"}}`).
pub fn stream_error(value: &Value) -> Failure {
    let error = value.get("error").unwrap_or(value);
    let kind = error.get("type").and_then(Value::as_str).unwrap_or("");
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("the backend reported an error");
    Failure::new(
        error_kind(kind),
        format!("the backend reported {kind}: {message}"),
    )
}

/// Anthropic's error types, classified as the gateway classifies statuses.
fn error_kind(kind: &str) -> ErrorKind {
    match kind {
        "rate_limit_error" | "overloaded_error" => ErrorKind::RateLimit,
        "authentication_error" | "permission_error" => ErrorKind::Auth,
        "invalid_request_error" | "request_too_large" | "not_found_error" => {
            ErrorKind::InvalidRequest
        }
        "api_error" | "timeout_error" => ErrorKind::Network,
        _ => ErrorKind::Unknown,
    }
}

/// The failure a non-success status means. 529 (overloaded) is a rate limit, as 429 is.
fn status_failure(status: u16, body: &[u8], retry_after_ms: Option<u64>) -> Failure {
    let mut failure = super::http::status_failure(status, body, retry_after_ms);
    if status == 529 {
        failure.kind = ErrorKind::RateLimit;
    }
    failure
}

/// Sends the request and accumulates the streamed reply, forwarding text deltas live, under
/// the same limits as the OpenAI path: time to first byte, idle time between chunks, total
/// time, response bytes.
pub(super) async fn stream_reply(
    shared: &Shared,
    job: &super::LlmJob,
    body: &Body<'_>,
    deadline: tokio::time::Instant,
    started: Instant,
) -> Result<LlmReply, Failure> {
    let settings = &shared.settings;
    let llm = &settings.llm;
    let provider = &settings.anthropic;
    let total_limit = || {
        Failure::new(
            ErrorKind::Network,
            format!(
                "the request took longer than the limit of {} ms",
                llm.total_timeout_ms
            ),
        )
    };
    let bytes = serde_json::to_vec(body).map_err(|e| {
        Failure::new(
            ErrorKind::InvalidRequest,
            format!("cannot encode the request: {e}"),
        )
    })?;
    let request = shared
        .http
        .post(format!(
            "{}/v1/messages",
            provider.base_url.trim_end_matches('/')
        ))
        .header(
            "x-api-key",
            secrecy::ExposeSecret::expose_secret(&provider.api_key),
        )
        .header("anthropic-version", API_VERSION)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(reqwest::header::ACCEPT, "text/event-stream")
        .body(bytes)
        .send();
    let first_byte = std::time::Duration::from_millis(llm.first_byte_timeout_ms);
    let response = match tokio::time::timeout(first_byte, request).await {
        Err(_) => {
            return Err(Failure::new(
                ErrorKind::Network,
                format!(
                    "no response within {} ms (time to first byte)",
                    llm.first_byte_timeout_ms
                ),
            ));
        }
        Ok(Err(e)) => {
            return Err(Failure::new(
                ErrorKind::Network,
                format!("connection to the LLM backend failed: {e}"),
            ));
        }
        Ok(Ok(response)) => response,
    };
    let status = response.status();
    if !status.is_success() {
        let idle = std::time::Duration::from_millis(llm.idle_timeout_ms);
        let (body, retry_after) = super::http::refused(response, idle).await;
        let mut failure = status_failure(status.as_u16(), &body, retry_after);
        // Anthropic's error body names its type: more exact than the status alone.
        if let Ok(value) = serde_json::from_slice::<Value>(&body)
            && value.pointer("/error/type").is_some()
            && status.as_u16() != 529
        {
            let typed = stream_error(&value);
            if typed.kind != ErrorKind::Unknown {
                failure.kind = typed.kind;
            }
        }
        return Err(failure);
    }
    let limits = super::http::HttpLimits {
        first_byte,
        idle: std::time::Duration::from_millis(llm.idle_timeout_ms),
        max_response_bytes: llm.max_response_bytes,
    };
    let probe = Arc::new(super::http::Probe::default());
    let raw = super::http::limited(response.bytes_stream(), limits, probe.clone());
    // One event at a time: the parser copies what it has not parsed at every line (events.rs).
    let mut events = std::pin::pin!(eventsource_stream::EventStream::new(
        super::events::one_event_each(raw)
    ));
    let mut translator = Translator::default();
    let mut accumulator =
        super::Accumulator::new(llm.max_tool_args_bytes, super::generated_ids(&job.request));
    let mut first_token = None;
    loop {
        match tokio::time::timeout_at(deadline, events.next()).await {
            Err(_) => return Err(total_limit()),
            Ok(None) => break,
            Ok(Some(Err(error))) => {
                return Err(probe.failure().unwrap_or_else(|| {
                    Failure::new(ErrorKind::Network, format!("the stream broke: {error}"))
                }));
            }
            Ok(Some(Ok(event))) => {
                let Some(chunk) = translator.event(&event.event, &event.data)? else {
                    continue;
                };
                let added = accumulator.push(chunk)?;
                super::forward(job, added, started, &mut first_token);
            }
        }
    }
    if let Some(failure) = probe.failure() {
        return Err(failure);
    }
    let cache = translator.cache;
    let span = tracing::Span::current();
    span.record("cache_read_tokens", cache.read);
    span.record("cache_write_tokens", cache.written);
    let metrics = &shared.metrics;
    metrics.tokens(&job.tenant_id, &job.model, "cache_read", cache.read);
    metrics.tokens(&job.tenant_id, &job.model, "cache_write", cache.written);
    // Without message_stop the answer was cut, whatever came before it.
    accumulator.finish(translator.done).and_then(|reply| {
        if translator.done {
            Ok(reply)
        } else {
            Err(Failure::new(
                ErrorKind::Network,
                "the stream ended before the model finished (no message_stop): truncated",
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state_machine::{ImageRef, ToolResult, ToolUse};

    fn events(stream: &str) -> Vec<(String, String)> {
        stream
            .split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                let mut name = String::new();
                let mut data = String::new();
                for line in e.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = n.to_owned();
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data = d.to_owned();
                    }
                }
                (name, data)
            })
            .collect()
    }

    fn reply_of(stream: &str) -> Result<LlmReply, Failure> {
        let mut translator = Translator::default();
        let mut accumulator = crate::llm::Accumulator::new(1 << 20, "call_x".into());
        for (name, data) in events(stream) {
            if let Some(chunk) = translator.event(&name, &data)? {
                accumulator.push(chunk)?;
            }
        }
        assert!(translator.done, "message_stop seen");
        accumulator.finish(translator.done)
    }

    /// A recorded tool-using answer (Anthropic's documented stream): text, then a tool call
    /// whose input comes in pieces, usage with cache reads.
    #[test]
    fn a_tool_using_stream_becomes_one_reply() {
        let stream = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-x\",\"stop_reason\":null,\"usage\":{\"input_tokens\":472,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":1000,\"output_tokens\":2}}}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
            "event: ping\ndata: {\"type\": \"ping\"}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Let me look.\"}}\n\n",
            "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_01\",\"name\":\"bash\",\"input\":{}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"command\\\": \\\"ls\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\" -la\\\"}\"}}\n\n",
            "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":1}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":89}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let reply = reply_of(stream).expect("a reply");
        assert_eq!(reply.text.as_deref(), Some("Let me look."));
        assert_eq!(reply.tool_uses.len(), 1);
        assert_eq!(reply.tool_uses[0].id, "toolu_01");
        assert_eq!(reply.tool_uses[0].name, "bash");
        assert_eq!(reply.tool_uses[0].input, json!({"command": "ls -la"}));
        assert!(reply.end_turn);
        assert_eq!(reply.usage.input_tokens, 1472);
        assert_eq!(reply.usage.output_tokens, 89);
    }

    #[test]
    fn max_tokens_is_a_cut_answer_and_errors_are_classified() {
        let stream = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"Hel\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"lo\"}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"output_tokens\":2}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let reply = reply_of(stream).expect("a reply");
        assert_eq!(reply.text.as_deref(), Some("Hello"));
        assert!(!reply.end_turn);

        let mut translator = Translator::default();
        for (kind, expected) in [
            ("overloaded_error", ErrorKind::RateLimit),
            ("rate_limit_error", ErrorKind::RateLimit),
            ("api_error", ErrorKind::Network),
            ("invalid_request_error", ErrorKind::InvalidRequest),
            ("authentication_error", ErrorKind::Auth),
        ] {
            let data =
                json!({"type": "error", "error": {"type": kind, "message": "no"}}).to_string();
            let failure = translator.event("error", &data).expect_err("a failure");
            assert_eq!(failure.kind, expected, "{kind}");
            assert!(failure.message.contains(kind));
        }
        assert_eq!(status_failure(529, b"{}", None).kind, ErrorKind::RateLimit);
        assert_eq!(status_failure(401, b"{}", None).kind, ErrorKind::Auth);
    }

    /// The request: the system prompt and the last message are cache breakpoints, tool
    /// results are user blocks with is_error, images are base64 blocks, errors are not sent.
    #[test]
    fn the_request_is_in_anthropics_form() {
        let history = [
            MessageContent::User {
                text: "look".into(),
                images: vec![ImageRef {
                    id: "img1".into(),
                    media_type: "image/png".into(),
                }],
            },
            MessageContent::Agent {
                text: Some(String::new()),
                tool_uses: vec![ToolUse {
                    id: "toolu_1".into(),
                    name: "bash".into(),
                    input: Value::String("{not json".into()),
                    extra: None,
                }],
                reasoning: None,
            },
            MessageContent::Error {
                text: "not sent".into(),
            },
            MessageContent::Tool(ToolResult {
                tool_use_id: "toolu_1".into(),
                name: "bash".into(),
                ok: false,
                output: "no such file".into(),
                cancelled: false,
            }),
        ];
        let pieces: Vec<Wire> = history.iter().map(wire).collect();
        let loader = |_: &str| Some(("image/png".to_owned(), vec![1u8, 2, 3]));
        let converted = images(&pieces, &loader).expect("images");
        let ctx = RequestContext {
            model: "claude-x",
            cwd: "/w",
            system_prompt: Some("Be brief."),
            is_sub_agent: false,
            only_submit: false,
            no_tools: false,
            mcp_tools: &[],
            client_tools: &[],
            tools: None,
            max_output_tokens: 1000,
            echo_reasoning: true,
        };
        let body =
            serde_json::to_value(body(&ctx, &pieces, &converted).expect("a body")).expect("JSON");
        assert_eq!(body["max_tokens"], 1000);
        assert_eq!(body["stream"], true);
        assert_eq!(body["system"][0]["cache_control"]["type"], "ephemeral");
        assert!(
            body["system"][0]["text"]
                .as_str()
                .is_some_and(|t| t.ends_with("Be brief."))
        );
        assert!(body["tools"][0]["input_schema"].is_object());
        let messages = body["messages"].as_array().expect("messages");
        assert_eq!(messages.len(), 3);
        assert_eq!(messages[0]["content"][0]["type"], "image");
        assert_eq!(messages[0]["content"][0]["source"]["data"], "AQID");
        assert_eq!(messages[0]["content"][1]["text"], "look");
        assert_eq!(
            messages[1]["content"],
            json!([{"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"invalid_arguments": "{not json"}}])
        );
        assert_eq!(
            messages[2]["content"][0],
            json!({"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such file", "is_error": true, "cache_control": {"type": "ephemeral"}})
        );
        assert!(messages[0]["content"][1].get("cache_control").is_none());
    }
}
