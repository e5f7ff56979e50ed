//! The fake's Anthropic side: the same scripted replies as Anthropic's Messages API streams
//! them (`event:` and `data:` lines, message_start, content blocks, input_json_delta,
//! message_delta with the stop reason and usage, message_stop), with pings and comments
//! between events, and the bytes cut into pieces of odd sizes, as a network may cut them.

use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};

use super::{
    Keys, Reply, Shared, error_response, pieces, raw_response, stream_paced, stream_response,
};

fn event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

fn start(prompt: u64) -> String {
    event(
        "message_start",
        &json!({"type": "message_start", "message": {
            "id": "msg_fake", "type": "message", "role": "assistant", "content": [],
            "model": "fake", "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": 1},
        }}),
    )
}

fn text_block(out: &mut Vec<String>, index: usize, parts: impl IntoIterator<Item = String>) {
    out.push(event(
        "content_block_start",
        &json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}),
    ));
    out.push(event("ping", &json!({"type": "ping"})));
    for part in parts {
        out.push(event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": part}}),
        ));
    }
    out.push(event(
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": index}),
    ));
}

fn tool_block(
    out: &mut Vec<String>,
    index: usize,
    id: &str,
    name: &str,
    fragments: impl IntoIterator<Item = String>,
) {
    out.push(event(
        "content_block_start",
        &json!({"type": "content_block_start", "index": index, "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
    ));
    for fragment in fragments {
        out.push(event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": fragment}}),
        ));
    }
    out.push(event(
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": index}),
    ));
}

fn end(out: &mut Vec<String>, stop_reason: &str, completion: u64) {
    out.push(event(
        "message_delta",
        &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null}, "usage": {"output_tokens": completion}}),
    ));
    out.push(event("message_stop", &json!({"type": "message_stop"})));
}

/// The events as one byte string, cut in pieces of 1 to 13 bytes: events, lines and
/// UTF-8 characters are split anywhere.
fn cut(events: &[String]) -> Vec<Bytes> {
    let mut whole = String::from(": a comment, which clients skip\n\n");
    for e in events {
        whole.push_str(e);
    }
    let bytes = whole.into_bytes();
    let mut out = Vec::new();
    let mut at = 0;
    let mut size = 1;
    while at < bytes.len() {
        let to = (at + size).min(bytes.len());
        out.push(Bytes::copy_from_slice(&bytes[at..to]));
        at = to;
        size = size % 13 + 1;
    }
    out
}

/// Anthropic's error body for a status.
fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

pub(super) fn reply_with(
    reply: Reply,
    prompt: u64,
    completion: u64,
    shared: Arc<Shared>,
) -> Response {
    let mut out = vec![start(prompt)];
    match reply {
        Reply::Text { text, finish } => {
            text_block(&mut out, 0, pieces(&text));
            let reason = if finish == "length" {
                "max_tokens"
            } else {
                "end_turn"
            };
            end(&mut out, reason, completion);
            stream_response(cut(&out), false, shared)
        }
        Reply::Tools { text, calls } => {
            let mut index = 0;
            if let Some(text) = text {
                text_block(&mut out, 0, pieces(&text));
                index = 1;
            }
            for (id, name, args) in calls {
                tool_block(&mut out, index, &id, &name, pieces(&args.to_string()));
                index += 1;
            }
            end(&mut out, "tool_use", completion);
            stream_response(cut(&out), false, shared)
        }
        Reply::RawToolCall {
            id,
            name,
            arguments,
        } => {
            let fragments = arguments
                .as_bytes()
                .chunks(4096)
                .map(|piece| String::from_utf8_lossy(piece).into_owned());
            tool_block(&mut out, 0, &id, &name, fragments);
            end(&mut out, "tool_use", completion);
            stream_response(cut(&out), false, shared)
        }
        Reply::Status {
            status,
            message,
            retry_after_secs,
        } => error_response(status, &error_body(status, &message), retry_after_secs),
        Reply::Raw {
            content_type,
            pieces,
        } => raw_response(&content_type, pieces, shared),
        Reply::Stall => stream_response(Vec::new(), true, shared),
        Reply::StallAfterFirstChunk => {
            text_block(&mut out, 0, ["partial".to_owned()]);
            out.pop(); // the block never ends
            stream_response(cut(&out), true, shared)
        }
        Reply::Truncated => {
            text_block(&mut out, 0, ["cut".to_owned()]);
            stream_response(cut(&out), false, shared)
        }
        Reply::Forward { .. } => StatusCode::NOT_IMPLEMENTED.into_response(),
        Reply::Huge { size } => {
            let piece = "x".repeat(1024);
            text_block(&mut out, 0, (0..size.div_ceil(1024)).map(|_| piece.clone()));
            end(&mut out, "end_turn", completion);
            stream_response(out.into_iter().map(Bytes::from).collect(), false, shared)
        }
        Reply::Paced { text, pause } => {
            text_block(
                &mut out,
                0,
                text.split_inclusive(' ')
                    .map(str::to_owned)
                    .collect::<Vec<_>>(),
            );
            end(&mut out, "end_turn", completion);
            stream_paced(
                out.into_iter().map(Bytes::from).collect(),
                false,
                pause,
                shared,
            )
        }
    }
}

/// What routing needs of an Anthropic request: a user message is one without tool_result
/// blocks; its text is its text blocks joined.
pub(super) fn route_keys(body: &[u8]) -> Keys {
    #[derive(serde::Deserialize, Default)]
    struct Request {
        #[serde(default)]
        messages: Vec<Message>,
    }
    #[derive(serde::Deserialize)]
    struct Message {
        role: String,
        #[serde(default)]
        content: Value,
    }
    let request: Request = serde_json::from_slice(body).unwrap_or_default();
    let is_result = |m: &Message| {
        m.role == "user"
            && m.content.as_array().is_some_and(|blocks| {
                blocks
                    .iter()
                    .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
            })
    };
    let text = |m: &Message| {
        if let Some(text) = m.content.as_str() {
            return text.to_owned();
        }
        m.content
            .as_array()
            .map(|blocks| {
                blocks
                    .iter()
                    .filter_map(|b| b.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default()
    };
    let mut users = request
        .messages
        .iter()
        .filter(|m| m.role == "user" && !is_result(m));
    let first_user = users.next().map(&text).unwrap_or_default();
    let last_user = users
        .next_back()
        .map(&text)
        .unwrap_or_else(|| first_user.clone());
    Keys {
        first_user,
        last_user,
        last_is_tool: request.messages.last().is_some_and(is_result),
    }
}

/// What Anthropic's API checks of a request before it answers, and refuses with its words:
/// the key and version headers; roles that alternate, starting with the user; every
/// tool_use answered by a tool_result in the very next message, tool_result blocks first;
/// tools defined when the history has tool blocks; a final assistant text without trailing
/// whitespace.
pub(super) fn check(headers: &HeaderMap, body: &[u8]) -> Result<(), (u16, String)> {
    let bad = |message: String| Err((400, message));
    if headers.get("x-api-key").is_none() {
        return Err((401, "x-api-key header is required".into()));
    }
    if headers.get("anthropic-version").is_none() {
        return bad("anthropic-version: header is required".into());
    }
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return bad("the request body is not JSON".into());
    };
    let messages = request["messages"].as_array().cloned().unwrap_or_default();
    let blocks = |m: &Value| m["content"].as_array().cloned().unwrap_or_default();
    let kind = |b: &Value| b["type"].as_str().unwrap_or_default().to_owned();
    let mut has_tool_blocks = false;
    for (i, message) in messages.iter().enumerate() {
        let role = message["role"].as_str().unwrap_or_default();
        let expected = if i % 2 == 0 { "user" } else { "assistant" };
        if role != expected {
            return bad(format!(
                "messages: roles must alternate between \"user\" and \"assistant\", starting with \"user\" (messages.{i} is {role:?})"
            ));
        }
        let uses: Vec<String> = blocks(message)
            .iter()
            .filter(|b| kind(b) == "tool_use")
            .map(|b| b["id"].as_str().unwrap_or_default().to_owned())
            .collect();
        has_tool_blocks |= blocks(message)
            .iter()
            .any(|b| matches!(kind(b).as_str(), "tool_use" | "tool_result"));
        if uses.is_empty() {
            continue;
        }
        let next = messages.get(i + 1).map(blocks).unwrap_or_default();
        let answered: Vec<String> = next
            .iter()
            .take_while(|b| kind(b) == "tool_result")
            .map(|b| b["tool_use_id"].as_str().unwrap_or_default().to_owned())
            .collect();
        if let Some(missing) = uses.iter().find(|id| !answered.contains(id)) {
            return bad(format!(
                "messages.{}: `tool_use` ids were found without `tool_result` blocks immediately after: {missing}. Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
                i
            ));
        }
    }
    if has_tool_blocks && request["tools"].as_array().is_none_or(Vec::is_empty) {
        return bad(
            "Requests which include `tool_use` or `tool_result` blocks must define tools.".into(),
        );
    }
    if let Some(last) = messages.last()
        && last["role"] == "assistant"
        && let Some(text) = blocks(last)
            .last()
            .and_then(|b| b["text"].as_str().map(str::to_owned))
        && text.ends_with(char::is_whitespace)
    {
        return bad("final assistant content cannot end with trailing whitespace".into());
    }
    Ok(())
}
