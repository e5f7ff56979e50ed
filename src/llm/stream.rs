//! Accumulates a streamed chat completion into one reply: text and reasoning deltas in
//! order, tool calls assembled from their fragments, usage from the last report. Tool
//! arguments are validated as JSON only once the stream is complete
//! (desi-gateway-design.md).
//!
//! Servers bend the stream in different ways (docs/backends.md), so calls are assembled by
//! what the fragments mean, not by their index alone:
//! - a fragment without `index` stands at its position in the delta;
//! - a tool's name is set once: a fragment that repeats the name so far (or restates it
//!   whole) adds nothing, one that is new extends it;
//! - a new id at an index whose call already has another id starts a new call (parallel
//!   calls all sent at index 0);
//! - a call without an id gets one made from the request, the same for the same request;
//!   a provider's own ids are kept verbatim;
//! - whether tools were called is decided by the calls assembled, not by `finish_reason`;
//!   `finish_reason` is the last one sent, and content in its chunk is kept;
//! - usage is the last report with counts in it, never a sum.
//!
//! An error inside the stream (a top-level `error`, `finish_reason: "error"`), or a stream
//! that ends with nothing in it, fails the reply with the provider's words.

use serde_json::Value;

use super::Failure;
use super::chunk::Chunk;
use crate::state_machine::{ErrorKind, LlmReply, Reasoning, ToolUse, Usage};

#[derive(Debug, Default)]
struct Call {
    /// The stream index the call was sent at.
    index: u64,
    id: Option<String>,
    name: String,
    arguments: String,
    extra: Option<Value>,
}

/// What one chunk adds, to forward to clients live.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Added {
    pub text: Option<String>,
    pub reasoning: Option<String>,
}

/// The state of one streamed response.
#[derive(Debug)]
pub struct Accumulator {
    max_tool_args_bytes: usize,
    /// Made into the ids of calls that come without one.
    id_prefix: String,
    text: String,
    reasoning: String,
    /// The field the reasoning came in (`reasoning_content` or `reasoning`).
    reasoning_field: Option<&'static str>,
    calls: Vec<Call>,
    finish: Option<String>,
    usage: Option<Usage>,
    error: Option<Failure>,
}

impl Accumulator {
    /// `id_prefix` names this request (the same for the same request): generated call ids
    /// are made from it.
    pub fn new(max_tool_args_bytes: usize, id_prefix: String) -> Self {
        Self {
            max_tool_args_bytes,
            id_prefix,
            text: String::new(),
            reasoning: String::new(),
            reasoning_field: None,
            calls: Vec::new(),
            finish: None,
            usage: None,
            error: None,
        }
    }

    /// Takes one chunk; returns what it adds to forward to clients live.
    pub fn push(&mut self, chunk: Chunk) -> Result<Added, Failure> {
        if let Some(error) = &chunk.error {
            self.error.get_or_insert_with(|| stream_error(error));
        }
        let reported = chunk
            .usage
            .as_ref()
            .or(chunk.x_groq.as_ref().and_then(|x| x.usage.as_ref()));
        if let Some(usage) = reported
            && (usage.prompt_tokens.is_some() || usage.completion_tokens.is_some())
        {
            self.usage = Some(Usage {
                input_tokens: usage.prompt_tokens.unwrap_or(0),
                output_tokens: usage.completion_tokens.unwrap_or(0),
            });
        }
        let mut added = Added::default();
        // We ask for one choice; others, if a backend sends them, are not ours.
        for choice in chunk
            .choices
            .into_iter()
            .filter(|c| c.index.unwrap_or(0) == 0)
        {
            if let Some(reason) = choice.finish_reason {
                self.finish = Some(reason);
            }
            let delta = choice.delta;
            if let Some(text) = delta.content {
                self.text.push_str(&text);
                added.text.get_or_insert_with(String::new).push_str(&text);
            }
            for (field, reasoning) in [
                ("reasoning_content", delta.reasoning_content),
                ("reasoning", delta.reasoning),
            ] {
                if let Some(reasoning) = reasoning {
                    self.reasoning_field.get_or_insert(field);
                    self.reasoning.push_str(&reasoning);
                    added
                        .reasoning
                        .get_or_insert_with(String::new)
                        .push_str(&reasoning);
                }
            }
            for (position, fragment) in delta.tool_calls.into_iter().enumerate() {
                let index = fragment.index.unwrap_or(position as u64);
                let arguments = fragment.function.arguments_text();
                let call = self.call_for(index, fragment.id);
                if let Some(name) = fragment.function.name {
                    merge_name(&mut call.name, &name);
                }
                if let Some(extra) = fragment.extra_content {
                    call.extra = Some(extra);
                }
                if let Some(arguments) = arguments {
                    call.arguments.push_str(&arguments);
                    if call.arguments.len() > self.max_tool_args_bytes {
                        return Err(Failure::new(
                            ErrorKind::Limit,
                            format!(
                                "the arguments of tool call {index} exceed the limit of {} bytes",
                                self.max_tool_args_bytes
                            ),
                        ));
                    }
                }
            }
        }
        Ok(added)
    }

    /// The call a fragment at `index` with `id` belongs to: the latest at that index,
    /// unless the fragment names another id than that call has (a new call).
    fn call_for(&mut self, index: u64, id: Option<String>) -> &mut Call {
        let current = self.calls.iter().rposition(|call| call.index == index);
        let position = match (current, &id) {
            (Some(at), Some(id)) if self.calls[at].id.as_ref().is_some_and(|known| known != id) => {
                None
            }
            (current, _) => current,
        };
        let at = position.unwrap_or_else(|| {
            self.calls.push(Call {
                index,
                ..Call::default()
            });
            self.calls.len() - 1
        });
        let call = &mut self.calls[at];
        if call.id.is_none() {
            call.id = id;
        }
        call
    }

    /// The complete reply, once the stream has ended; `saw_done` whether `data: [DONE]`
    /// ended it.
    pub fn finish(self, saw_done: bool) -> Result<LlmReply, Failure> {
        if let Some(error) = self.error {
            return Err(error);
        }
        if self.finish.as_deref() == Some("error") {
            return Err(Failure::new(
                ErrorKind::Network,
                "the backend ended the answer with finish_reason \"error\" and no message",
            ));
        }
        if self.finish.is_none() {
            if !saw_done {
                return Err(Failure::new(
                    ErrorKind::Network,
                    "the stream ended before the model finished (no finish_reason): truncated",
                ));
            }
            // Some servers send no finish_reason; [DONE] after an answer ends it as well.
            if self.text.is_empty() && self.reasoning.is_empty() && self.calls.is_empty() {
                return Err(Failure::new(
                    ErrorKind::Network,
                    "the backend ended the stream without an answer (nothing before [DONE])",
                ));
            }
        }
        let mut tool_uses = Vec::with_capacity(self.calls.len());
        for (n, call) in self.calls.into_iter().enumerate() {
            if call.name.is_empty() {
                return Err(Failure::new(
                    ErrorKind::Unknown,
                    format!(
                        "the model sent tool call {} without a name",
                        call.id.as_deref().unwrap_or("(no id)")
                    ),
                ));
            }
            let input = if call.arguments.trim().is_empty() {
                Value::Object(Default::default())
            } else {
                // Arguments that are not JSON reach the tool as a string; the tool refuses
                // them with a message the model can act on.
                serde_json::from_str(&call.arguments).unwrap_or(Value::String(call.arguments))
            };
            tool_uses.push(ToolUse {
                id: call.id.unwrap_or_else(|| format!("{}_{n}", self.id_prefix)),
                name: call.name,
                input,
                extra: call.extra,
            });
        }
        Ok(LlmReply {
            text: (!self.text.is_empty()).then_some(self.text),
            tool_uses,
            end_turn: self.finish.as_deref() != Some("length"),
            usage: self.usage.unwrap_or_default(),
            reasoning: self.reasoning_field.map(|field| Reasoning {
                text: self.reasoning,
                field: field.to_owned(),
            }),
        })
    }
}

/// A tool name from one more fragment: a repeat of the name so far, or the name so far
/// restated whole, replaces it; anything else extends it.
fn merge_name(name: &mut String, fragment: &str) {
    if fragment.is_empty() || fragment == name {
        return;
    }
    if name.is_empty() || fragment.starts_with(name.as_str()) {
        fragment.clone_into(name);
    } else {
        name.push_str(fragment);
    }
}

/// The failure an error inside a stream means, in the provider's words: a string, or an
/// object with `message` (and `code`, `type`, `status`), as a `data:` payload's `error` or
/// an `error:` SSE field.
pub fn stream_error(error: &Value) -> Failure {
    let message = match error.as_str() {
        Some(text) => text.to_owned(),
        None => error
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| error.to_string(), str::to_owned),
    };
    let field = |key: &str| -> String {
        match error.get(key) {
            Some(Value::String(text)) => text.to_lowercase(),
            Some(Value::Number(n)) => n.to_string(),
            Some(Value::Null | Value::Bool(_) | Value::Array(_) | Value::Object(_)) | None => {
                String::new()
            }
        }
    };
    let (code, kind_name) = (
        field("code"),
        format!("{} {}", field("type"), field("status")),
    );
    let text = message.to_lowercase();
    let has = |words: &[&str]| {
        words
            .iter()
            .any(|w| text.contains(w) || kind_name.contains(w) || code.contains(w))
    };
    let kind = if has(&["context", "too long", "too many tokens", "maximum length"]) {
        // A request too large for the model will be as large when retried.
        ErrorKind::InvalidRequest
    } else if code == "429"
        || code == "529"
        || has(&[
            "rate limit",
            "rate_limit",
            "overloaded",
            "quota",
            "too many requests",
        ])
    {
        ErrorKind::RateLimit
    } else if code == "401"
        || code == "403"
        || has(&["unauthorized", "authentication", "permission", "forbidden"])
    {
        ErrorKind::Auth
    } else if code == "400"
        || code == "404"
        || code == "422"
        || has(&["invalid_request", "invalid request", "bad request"])
    {
        ErrorKind::InvalidRequest
    } else if code.starts_with('5')
        || has(&[
            "server_error",
            "internal",
            "unavailable",
            "timeout",
            "timed out",
        ])
    {
        ErrorKind::Network
    } else {
        ErrorKind::Unknown
    };
    Failure::new(
        kind,
        format!(
            "the backend reported an error in its stream: {}",
            crate::tools::preview(&message, 500)
        ),
    )
}
