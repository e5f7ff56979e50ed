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
        let mut tool_uses: Vec<ToolUse> = Vec::with_capacity(self.calls.len());
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
            // Every call needs an id of its own: its result is matched to it by id, and a
            // late result must never be taken for another call's (found by fuzzing: a
            // backend that sends one id twice). A missing, empty or repeated id is made.
            let taken = |id: &str| tool_uses.iter().any(|tool| tool.id == id);
            let id = match call.id.filter(|id| !id.is_empty() && !taken(id)) {
                Some(id) => id,
                None => {
                    let mut id = format!("{}_{n}", self.id_prefix);
                    while taken(&id) {
                        id.push('_');
                    }
                    id
                }
            };
            tool_uses.push(ToolUse {
                id,
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// The reply the `data:` payloads make, the stream ended by `[DONE]`.
    fn assemble(payloads: &[Value]) -> Result<LlmReply, Failure> {
        assemble_with(payloads, true)
    }

    fn assemble_with(payloads: &[Value], saw_done: bool) -> Result<LlmReply, Failure> {
        let mut accumulator = Accumulator::new(1024, "call_gen".into());
        for payload in payloads {
            let chunk: Chunk = serde_json::from_value(payload.clone()).expect("a chunk reads");
            accumulator.push(chunk)?;
        }
        accumulator.finish(saw_done)
    }

    fn delta(delta: Value) -> Value {
        json!({"choices": [{"index": 0, "delta": delta, "finish_reason": null}]})
    }

    fn calls(calls: Value) -> Value {
        delta(json!({"tool_calls": calls}))
    }

    fn finish(reason: &str) -> Value {
        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})
    }

    /// `(id, name, input)` of each call of a reply.
    fn tools(reply: &LlmReply) -> Vec<(String, String, Value)> {
        reply
            .tool_uses
            .iter()
            .map(|t| (t.id.clone(), t.name.clone(), t.input.clone()))
            .collect()
    }

    fn tool(id: &str, name: &str, input: Value) -> (String, String, Value) {
        (id.to_owned(), name.to_owned(), input)
    }

    /// A case: what it is, the payloads, the calls they make.
    type Case = (&'static str, Vec<Value>, Vec<(String, String, Value)>);

    /// Found by fuzzing: a backend that gives two calls one id (or an empty one) must not
    /// make two tool_uses that share an id; the repeat gets an id of its own.
    #[test]
    fn repeated_or_empty_call_ids_are_made_unique() {
        let reply = assemble(&[
            calls(json!([{"index": 0, "id": "call_2", "function": {"name": "bash", "arguments": "{}"}}])),
            calls(json!([{"index": 1, "id": "call_2", "function": {"name": "think", "arguments": "{}"}}])),
            calls(json!([{"index": 2, "id": "", "function": {"name": "think", "arguments": "{}"}}])),
            calls(json!([{"index": 3, "id": "call_gen_1", "function": {"name": "think", "arguments": "{}"}}])),
            finish("tool_calls"),
        ])
        .expect("a reply");
        let ids: Vec<&str> = reply.tool_uses.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(ids, ["call_2", "call_gen_1", "call_gen_2", "call_gen_3"]);
    }

    /// The assembly rules, one case each: the fragments as a server sends them, and the calls
    /// they make.
    #[test]
    fn tool_calls_are_assembled_by_meaning() {
        let cases: Vec<Case> = vec![
            (
                "OpenAI: name once, arguments in fragments",
                vec![
                    calls(
                        json!([{"index": 0, "id": "c1", "type": "function", "function": {"name": "think", "arguments": ""}}]),
                    ),
                    calls(json!([{"index": 0, "function": {"arguments": "{\"thoughts\""}}])),
                    calls(json!([{"index": 0, "function": {"arguments": ": \"x\"}"}}])),
                    finish("tool_calls"),
                ],
                vec![tool("c1", "think", json!({"thoughts": "x"}))],
            ),
            (
                "the name repeated in every fragment (GPT-5, MiniMax via NIM, vLLM)",
                vec![
                    calls(
                        json!([{"index": 0, "id": "c1", "function": {"name": "think", "arguments": "{\"thou"}}]),
                    ),
                    calls(
                        json!([{"index": 0, "function": {"name": "think", "arguments": "ghts\": 1}"}}]),
                    ),
                    calls(
                        json!([{"index": 0, "id": "c1", "function": {"name": "think", "arguments": ""}}]),
                    ),
                    finish("tool_calls"),
                ],
                vec![tool("c1", "think", json!({"thoughts": 1}))],
            ),
            (
                "a name streamed in pieces",
                vec![
                    calls(json!([{"index": 0, "id": "c1", "function": {"name": "thi"}}])),
                    calls(json!([{"index": 0, "function": {"name": "nk", "arguments": "{}"}}])),
                    finish("tool_calls"),
                ],
                vec![tool("c1", "think", json!({}))],
            ),
            (
                "parallel calls all at index 0 with their own ids (Ollama)",
                vec![
                    calls(
                        json!([{"index": 0, "id": "a", "function": {"name": "think", "arguments": "{\"thoughts\": \"one\"}"}}]),
                    ),
                    calls(
                        json!([{"index": 0, "id": "b", "function": {"name": "think", "arguments": "{\"thoughts\": \"two\"}"}}]),
                    ),
                    finish("stop"),
                ],
                vec![
                    tool("a", "think", json!({"thoughts": "one"})),
                    tool("b", "think", json!({"thoughts": "two"})),
                ],
            ),
            (
                "no index: the call's position in the delta (Gemini, Mistral)",
                vec![
                    calls(json!([
                        {"id": "a", "function": {"name": "think", "arguments": "{\"thoughts\": \"one\"}"}},
                        {"id": "b", "function": {"name": "patch", "arguments": "{\"path\": \"p\"}"}}
                    ])),
                    calls(json!([{"id": "c", "function": {"name": "think", "arguments": "{}"}}])),
                    finish("stop"),
                ],
                vec![
                    tool("a", "think", json!({"thoughts": "one"})),
                    tool("b", "patch", json!({"path": "p"})),
                    tool("c", "think", json!({})),
                ],
            ),
            (
                "no id, or an empty one (vLLM, StepFun): one is made from the request",
                vec![
                    calls(
                        json!([{"index": 0, "id": "", "type": "", "function": {"name": "think", "arguments": ""}}]),
                    ),
                    calls(json!([{"index": 0, "function": {"arguments": "{}"}}])),
                    calls(json!([{"index": 1, "function": {"name": "think", "arguments": "{}"}}])),
                    finish("tool_calls"),
                ],
                vec![
                    tool("call_gen_0", "think", json!({})),
                    tool("call_gen_1", "think", json!({})),
                ],
            ),
            (
                "arguments as a JSON object (llama.cpp, early 2026)",
                vec![
                    calls(
                        json!([{"index": 0, "id": "c1", "function": {"name": "think", "arguments": {"thoughts": "x"}}}]),
                    ),
                    finish("tool_calls"),
                ],
                vec![tool("c1", "think", json!({"thoughts": "x"}))],
            ),
            (
                "noise: tool_calls [] and null, content null, role on every chunk",
                vec![
                    delta(json!({"role": "assistant", "content": null, "tool_calls": []})),
                    delta(json!({"role": "assistant", "tool_calls": null})),
                    calls(
                        json!([{"index": 0, "id": "c1", "function": {"name": "think", "arguments": "{}"}}]),
                    ),
                    delta(json!({"role": "assistant", "content": ""})),
                    finish("tool_calls"),
                ],
                vec![tool("c1", "think", json!({}))],
            ),
        ];
        for (what, payloads, expected) in cases {
            let reply = assemble(&payloads).unwrap_or_else(|e| panic!("{what}: {e:?}"));
            assert_eq!(tools(&reply), expected, "{what}");
            assert!(reply.end_turn, "{what}");
        }
    }

    /// Finish reasons: unknown ones are kept and end the turn, `""` is none, the last wins,
    /// content in the finish chunk is kept, and only `length` leaves the turn unfinished.
    #[test]
    fn finish_reasons_are_read_as_sent() {
        let text = |reply: &LlmReply| reply.text.clone().unwrap_or_default();
        for reason in ["stop", "eos", "end_turn", "tool_calls", "STOP"] {
            let reply = assemble(&[delta(json!({"content": "hi"})), finish(reason)])
                .unwrap_or_else(|e| panic!("{reason}: {e:?}"));
            assert_eq!(
                (text(&reply), reply.end_turn),
                ("hi".into(), true),
                "{reason}"
            );
        }
        // `""` on every chunk (a proxy, Ollama), the real reason last.
        let empty = |content: &str| json!({"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": ""}]});
        let reply = assemble(&[empty("a"), empty("b"), finish("stop")]).expect("complete");
        assert_eq!(text(&reply), "ab");
        // Content in the chunk that finishes (Mistral), and the last reason wins.
        let last = json!({"choices": [{"index": 0, "delta": {"content": "c"}, "finish_reason": "length"}]});
        let reply =
            assemble(&[finish("stop"), delta(json!({"content": "ab"})), last]).expect("complete");
        assert_eq!((text(&reply), reply.end_turn), ("abc".into(), false));
        // No finish reason at all, but [DONE] after an answer: complete.
        let reply = assemble(&[delta(json!({"content": "x"}))]).expect("complete");
        assert_eq!(text(&reply), "x");
        // Without [DONE] it was cut.
        let cut = assemble_with(&[delta(json!({"content": "x"}))], false).expect_err("cut");
        assert_eq!(cut.kind, ErrorKind::Network);
        assert!(cut.message.contains("truncated"), "{}", cut.message);
    }

    /// Usage is the last report with counts in it: `{}` (MiniMax) and counts under other
    /// names report nothing, cumulative reports (Gemini) and repeated ones (Groq) are not
    /// summed, Groq's `x_groq` counts.
    #[test]
    fn usage_is_the_last_report() {
        let usage = |prompt: u64, completion: u64| json!({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}});
        let reply = assemble(&[
            delta(json!({"content": "a"})),
            usage(10, 1),
            usage(10, 2),
            json!({"choices": [], "usage": {}}),
            json!({"choices": [], "usage": {"total_tokens": 0, "total_characters": 0}}),
            finish("stop"),
        ])
        .expect("complete");
        assert_eq!(
            reply.usage,
            Usage {
                input_tokens: 10,
                output_tokens: 2
            }
        );
        let groq = json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "x_groq": {"id": "req_1", "usage": {"queue_time": 0.07, "prompt_tokens": 23, "completion_tokens": 19}}});
        let reply = assemble(&[delta(json!({"content": "a"})), groq]).expect("complete");
        assert_eq!(
            reply.usage,
            Usage {
                input_tokens: 23,
                output_tokens: 19
            }
        );
        let tier = json!({"choices": [], "service_tier": "on_demand",
            "usage": {"queue_time": 0.2, "prompt_tokens": 5.0, "completion_tokens": "7"}});
        let reply =
            assemble(&[delta(json!({"content": "a"})), finish("stop"), tier]).expect("complete");
        assert_eq!(
            reply.usage,
            Usage {
                input_tokens: 5,
                output_tokens: 7
            }
        );
    }

    /// Errors in the stream fail the reply with the provider's words, classified.
    #[test]
    fn errors_in_the_stream_are_failures() {
        let openrouter = json!({"id": "cmpl-abc123", "object": "chat.completion.chunk",
            "error": {"code": "server_error", "message": "Provider disconnected"},
            "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]});
        let failure = assemble(&[delta(json!({"content": "par"})), openrouter]).expect_err("fails");
        assert_eq!(failure.kind, ErrorKind::Network);
        assert!(
            failure.message.contains("Provider disconnected"),
            "{}",
            failure.message
        );
        let failure =
            assemble(&[delta(json!({"content": "x"})), finish("error")]).expect_err("fails");
        assert!(failure.message.contains("\"error\""), "{}", failure.message);
        let failure = assemble(&[]).expect_err("nothing before [DONE]");
        assert_eq!(failure.kind, ErrorKind::Network);
        assert!(
            failure.message.contains("without an answer"),
            "{}",
            failure.message
        );
        let failure =
            assemble(&[json!({"error": "rate limit exceeded, retry later"})]).expect_err("fails");
        assert_eq!(failure.kind, ErrorKind::RateLimit);
    }

    /// The kinds errors in streams are given: context overflows are not retried, overloads
    /// and server errors are.
    #[test]
    fn stream_errors_are_classified() {
        let cases = [
            (
                json!({"code": 400, "message": "the request exceeds the available context size. try increasing the context size or enable context shift", "type": "invalid_request_error"}),
                ErrorKind::InvalidRequest,
            ),
            (
                json!({"code": 429, "message": "slow down"}),
                ErrorKind::RateLimit,
            ),
            (
                json!({"type": "overloaded_error", "message": "Overloaded"}),
                ErrorKind::RateLimit,
            ),
            (
                json!({"code": 529, "message": "busy"}),
                ErrorKind::RateLimit,
            ),
            (json!({"code": 401, "message": "bad key"}), ErrorKind::Auth),
            (
                json!({"code": 502, "message": "Bad gateway"}),
                ErrorKind::Network,
            ),
            (
                json!({"code": "server_error", "message": "Provider disconnected"}),
                ErrorKind::Network,
            ),
            (
                json!({"message": "The reasoning_content in the thinking mode must be passed back to the API.", "type": "invalid_request_error"}),
                ErrorKind::InvalidRequest,
            ),
            (json!("something odd happened"), ErrorKind::Unknown),
        ];
        for (error, kind) in cases {
            let failure = stream_error(&error);
            assert_eq!(failure.kind, kind, "{error}");
            let words = error.as_str().map_or_else(
                || error["message"].as_str().unwrap_or_default().to_owned(),
                str::to_owned,
            );
            assert!(failure.message.contains(&words), "{}", failure.message);
        }
    }

    /// Reasoning, in either field, is kept apart from the text, with the field it came in;
    /// the provider's data on a call is kept; other choices are not ours; a non-streamed
    /// completion's `message` reads as the delta.
    #[test]
    fn reasoning_provider_data_and_whole_completions() {
        let reply = assemble(&[
            delta(json!({"reasoning_content": "Let me "})),
            delta(json!({"reasoning_content": "think."})),
            delta(json!({"content": "Done."})),
            json!({"choices": [{"index": 1, "delta": {"content": "other choice"}}]}),
            finish("stop"),
        ])
        .expect("complete");
        assert_eq!(reply.text.as_deref(), Some("Done."));
        assert_eq!(
            reply.reasoning,
            Some(Reasoning {
                text: "Let me think.".into(),
                field: "reasoning_content".into()
            })
        );
        let reply =
            assemble(&[delta(json!({"reasoning": "hm"})), finish("stop")]).expect("complete");
        assert_eq!(reply.reasoning.map(|r| r.field), Some("reasoning".into()));
        let signature = json!({"google": {"thought_signature": "sig"}});
        let reply = assemble(&[
            calls(json!([{"extra_content": signature, "function": {"arguments": "{}", "name": "think"}, "id": "g1", "type": "function"}])),
            finish("stop"),
        ])
        .expect("complete");
        assert_eq!(reply.tool_uses[0].extra, Some(signature));
        let whole = json!({"id": "x", "object": "chat.completion", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": "whole", "tool_calls": [
                {"id": "w1", "type": "function", "function": {"name": "think", "arguments": "{}"}}]},
            "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 3, "completion_tokens": 4}});
        let reply = assemble(&[whole]).expect("complete");
        assert_eq!(reply.text.as_deref(), Some("whole"));
        assert_eq!(tools(&reply), vec![tool("w1", "think", json!({}))]);
        assert_eq!(
            reply.usage,
            Usage {
                input_tokens: 3,
                output_tokens: 4
            }
        );
    }

    /// Tolerance loosens no limit: arguments over the cap fail, whatever their shape.
    #[test]
    fn the_argument_cap_holds() {
        let big = "x".repeat(2000);
        for arguments in [json!(big), json!({"thoughts": big})] {
            let failure = assemble(&[calls(json!([{"index": 0, "id": "c", "function": {"name": "think", "arguments": arguments}}]))])
                .expect_err("over the cap");
            assert_eq!(failure.kind, ErrorKind::Limit);
        }
    }
}
