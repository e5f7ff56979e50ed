//! Builds the chat-completions request of one LLM step from the stored history.
//!
//! The backend is sent the whole history at every step, so each message is turned into its
//! wire JSON once ([`wire`]), kept with the gateway's history, and a request's body is those
//! pieces written one after the other into the sender's buffer ([`Body`]): a step costs one
//! copy of the history, not its conversion and serialization. Messages with images are
//! converted per request ([`images`]; their data URLs are not kept in memory).

use async_openai::types::chat::{
    ChatCompletionMessageToolCall, ChatCompletionMessageToolCalls,
    ChatCompletionRequestAssistantMessage, ChatCompletionRequestAssistantMessageContent,
    ChatCompletionRequestMessage, ChatCompletionRequestMessageContentPartImage,
    ChatCompletionRequestMessageContentPartText, ChatCompletionRequestSystemMessage,
    ChatCompletionRequestSystemMessageContent, ChatCompletionRequestToolMessage,
    ChatCompletionRequestToolMessageContent, ChatCompletionRequestUserMessage,
    ChatCompletionRequestUserMessageContent, ChatCompletionRequestUserMessageContentPart,
    ChatCompletionStreamOptions, ChatCompletionTool, ChatCompletionTools, FunctionCall,
    FunctionObject, ImageUrl,
};
use base64::Engine;
use serde::ser::SerializeSeq as _;
use serde_json::value::RawValue;

use crate::state_machine::MessageContent;
use crate::tools::ToolDefinition;

/// What the request is built from besides the history.
#[derive(Clone, Debug)]
pub struct RequestContext<'a> {
    pub model: &'a str,
    pub cwd: &'a str,
    pub system_prompt: Option<&'a str>,
    pub is_sub_agent: bool,
    /// A sub-agent's grace turn: submit_result is the only tool offered.
    pub only_submit: bool,
    /// No tool may be called (the summary request).
    pub no_tools: bool,
    /// The conversation's tools of its tenant's MCP servers, offered after the built-in ones.
    pub mcp_tools: &'a [crate::model::McpTool],
    /// The built-in tools its agent allows (`None`: all of them).
    pub tools: Option<&'a [String]>,
    /// The tools its client runs, offered after the MCP ones.
    pub client_tools: &'a [crate::model::ClientTool],
    pub max_output_tokens: u32,
    /// Send the turn's reasoning back (`[models] echo_reasoning`).
    pub echo_reasoning: bool,
}

/// An image's bytes, by attachment id.
pub type ImageLoader<'a> = &'a dyn Fn(&str) -> Option<(String, Vec<u8>)>;

/// The system prompt: what the agent is and where it works, then the conversation's own.
pub fn system_prompt(ctx: &RequestContext<'_>) -> String {
    let role = if ctx.is_sub_agent {
        "You are a sub-agent: you were given one task by another agent. Work on it with the tools, then call submit_result exactly once with your result."
    } else {
        "You are an agent that works for the user with the tools you are given."
    };
    let mut prompt = format!(
        "{role}\nYour working directory is {}. Every tool starts there; tools run one at a time, in the order you ask for them.",
        ctx.cwd
    );
    if let Some(own) = ctx.system_prompt.filter(|p| !p.trim().is_empty()) {
        prompt.push_str("\n\n");
        prompt.push_str(own);
    }
    prompt
}

/// One stored message as the backend gets it.
#[derive(Debug)]
pub enum Wire {
    /// Not sent (errors are for the user; an empty agent turn says nothing).
    Skip,
    /// Its JSON, made once.
    Json(Box<RawValue>),
    /// An agent message with the model's reasoning: its JSON without it, and with it in the
    /// field the backend sent it in (sent while its turn is in progress).
    Thought {
        plain: Box<RawValue>,
        with_reasoning: Box<RawValue>,
    },
    /// A user message with images: converted per request.
    Images(MessageContent),
}

impl Wire {
    /// The bytes the piece holds (a message with images holds its references only).
    pub fn bytes(&self) -> usize {
        match self {
            Wire::Skip => 0,
            Wire::Json(json) => json.get().len(),
            Wire::Thought {
                plain,
                with_reasoning,
            } => plain.get().len() + with_reasoning.get().len(),
            Wire::Images(content) => match content {
                MessageContent::User { text, images } => text.len() + images.len() * 64,
                MessageContent::Agent { .. }
                | MessageContent::Tool(_)
                | MessageContent::System { .. }
                | MessageContent::Error { .. } => 0,
            },
        }
    }
}

/// The wire form of a stored message.
pub fn wire(content: &MessageContent) -> Wire {
    if matches!(content, MessageContent::User { images, .. } if !images.is_empty()) {
        return Wire::Images(content.clone());
    }
    let Some(message) = convert(content, &|_| None) else {
        return Wire::Skip;
    };
    let made = match content {
        MessageContent::Agent {
            tool_uses,
            reasoning,
            ..
        } if reasoning.is_some() || tool_uses.iter().any(|t| t.extra.is_some()) => {
            agent_wire(message, tool_uses, reasoning.as_ref())
        }
        MessageContent::User { .. }
        | MessageContent::Agent { .. }
        | MessageContent::Tool(_)
        | MessageContent::System { .. }
        | MessageContent::Error { .. } => serde_json::value::to_raw_value(&message).map(Wire::Json),
    };
    // Not expected for these types; converting per request still works.
    made.unwrap_or_else(|_| Wire::Images(content.clone()))
}

/// Whether a stored message starts a turn as the backend sees it (a user-role message).
pub fn starts_turn(content: &MessageContent) -> bool {
    match content {
        MessageContent::User { .. } | MessageContent::System { .. } => true,
        MessageContent::Agent { .. } | MessageContent::Tool(_) | MessageContent::Error { .. } => {
            false
        }
    }
}

/// An agent message with what the provider wants back: each tool call's `extra_content`
/// (Gemini's thought signature), and the reasoning in its field (kept apart, for the turn
/// it belongs to).
fn agent_wire(
    message: ChatCompletionRequestMessage,
    tool_uses: &[crate::state_machine::ToolUse],
    reasoning: Option<&crate::state_machine::Reasoning>,
) -> serde_json::Result<Wire> {
    let mut value = serde_json::to_value(&message)?;
    if let Some(calls) = value
        .get_mut("tool_calls")
        .and_then(serde_json::Value::as_array_mut)
    {
        for (call, tool) in calls.iter_mut().zip(tool_uses) {
            if let (Some(extra), Some(call)) = (&tool.extra, call.as_object_mut()) {
                call.insert("extra_content".into(), extra.clone());
            }
        }
    }
    let plain = serde_json::value::to_raw_value(&value)?;
    let Some(reasoning) = reasoning else {
        return Ok(Wire::Json(plain));
    };
    if let Some(object) = value.as_object_mut() {
        object.insert(
            reasoning.field.clone(),
            serde_json::Value::String(reasoning.text.clone()),
        );
    }
    Ok(Wire::Thought {
        plain,
        with_reasoning: serde_json::value::to_raw_value(&value)?,
    })
}

/// The JSON of the request's `tools`, made once per kind of agent (the tools an agent gets
/// depend only on whether it is a sub-agent, and whether it is in its grace turn).
fn tools_json(is_sub_agent: bool, only_submit: bool) -> serde_json::Result<&'static RawValue> {
    static CACHE: ToolsCache = ToolsCache::new();
    CACHE.get(is_sub_agent, only_submit, tool_list)
}

/// A request's built-in tools as JSON, made once per kind of agent: a user conversation, a
/// sub-agent, a sub-agent in its grace turn (submit_result alone).
#[derive(Debug, Default)]
pub struct ToolsCache([std::sync::OnceLock<Box<RawValue>>; 3]);

impl ToolsCache {
    pub const fn new() -> Self {
        Self([
            std::sync::OnceLock::new(),
            std::sync::OnceLock::new(),
            std::sync::OnceLock::new(),
        ])
    }

    /// The JSON for that kind of agent, made by `render` the first time.
    pub fn get<T: serde::Serialize>(
        &'static self,
        is_sub_agent: bool,
        only_submit: bool,
        render: impl FnOnce(&[ToolDefinition]) -> T,
    ) -> serde_json::Result<&'static RawValue> {
        let only_submit = is_sub_agent && only_submit;
        let slot = &self.0[usize::from(is_sub_agent) + usize::from(only_submit)];
        if let Some(json) = slot.get() {
            return Ok(json);
        }
        let mut tools = crate::tools::definitions(is_sub_agent);
        if only_submit {
            tools.retain(|tool| tool.name == crate::state_machine::SUBMIT_RESULT);
        }
        let json = serde_json::value::to_raw_value(&render(&tools))?;
        Ok(slot.get_or_init(|| json))
    }
}

fn tool_list(tools: &[ToolDefinition]) -> Vec<ChatCompletionTools> {
    tools
        .iter()
        .map(|tool| {
            ChatCompletionTools::Function(ChatCompletionTool {
                function: FunctionObject {
                    name: tool.name.to_owned(),
                    description: Some(tool.description.to_owned()),
                    parameters: Some(tool.parameters.clone()),
                    strict: None,
                },
            })
        })
        .collect()
}

/// A request's `tools`: the cached JSON of the built-in ones, or that and the conversation's
/// MCP tools.
#[derive(Debug, serde::Serialize)]
#[serde(untagged)]
pub enum Tools<'a> {
    Cached(&'a RawValue),
    Own(Box<RawValue>),
}

impl Tools<'_> {
    /// None at all (an agent that allows no built-in tool and has no MCP tools): the
    /// request then leaves `tools` out, as backends refuse an empty list.
    pub fn is_empty(&self) -> bool {
        match self {
            Tools::Cached(raw) => raw.get() == "[]",
            Tools::Own(raw) => raw.get() == "[]",
        }
    }
}

/// The built-in tools' JSON (`cached`), less those the agent does not allow, with the
/// conversation's MCP tools and then its client tools after them, each made by `entry` from
/// its name, description and input schema (not in a sub-agent's grace turn, which offers
/// submit_result alone).
pub fn with_mcp<'a, T: serde::Serialize>(
    cached: &'a RawValue,
    ctx: &RequestContext<'_>,
    entry: impl Fn(&str, &str, &serde_json::Value) -> T,
) -> serde_json::Result<Tools<'a>> {
    if (ctx.mcp_tools.is_empty() && ctx.tools.is_none() && ctx.client_tools.is_empty())
        || (ctx.is_sub_agent && ctx.only_submit)
    {
        return Ok(Tools::Cached(cached));
    }
    // `cached` holds the built-in tools in the order `tools::definitions` gives them.
    let names = crate::tools::names(ctx.is_sub_agent);
    let allowed = |name: &str| {
        (ctx.is_sub_agent && name == crate::state_machine::SUBMIT_RESULT)
            || ctx
                .tools
                .is_none_or(|tools| tools.iter().any(|tool| tool == name))
    };
    let mut all: Vec<Box<RawValue>> = serde_json::from_str::<Vec<&RawValue>>(cached.get())?
        .into_iter()
        .zip(names.iter().copied())
        .filter(|(_, name)| allowed(name))
        .map(|(t, _)| t.to_owned())
        .collect();
    for tool in ctx.mcp_tools {
        all.push(serde_json::value::to_raw_value(&entry(
            &tool.name,
            &tool.description,
            &tool.input_schema,
        ))?);
    }
    for tool in ctx.client_tools {
        all.push(serde_json::value::to_raw_value(&entry(
            &tool.name,
            &tool.description,
            &tool.input_schema,
        ))?);
    }
    serde_json::value::to_raw_value(&all).map(Tools::Own)
}

/// The request's `messages`: the system prompt, then the history.
#[derive(Debug)]
struct Messages<'a> {
    system: ChatCompletionRequestMessage,
    history: &'a [Wire],
    /// The messages with images, converted, in the order they come in `history`.
    images: &'a [Box<RawValue>],
    /// Where the turn in progress starts in `history`: its agent messages carry their
    /// reasoning (`None`: no message does).
    reasoning_from: Option<usize>,
}

impl serde::Serialize for Messages<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(None)?;
        seq.serialize_element(&self.system)?;
        let mut images = self.images.iter();
        // The run of assistant messages in a row not yet written (see `merged`).
        let mut run: Vec<&RawValue> = Vec::new();
        for (at, message) in self.history.iter().enumerate() {
            let json: &RawValue = match message {
                Wire::Skip => continue,
                Wire::Json(json) => json,
                Wire::Thought {
                    plain,
                    with_reasoning,
                } => {
                    if self.reasoning_from.is_some_and(|from| at >= from) {
                        with_reasoning
                    } else {
                        plain
                    }
                }
                Wire::Images(_) => match images.next() {
                    Some(json) => json,
                    None => continue,
                },
            };
            if is_assistant(json) {
                run.push(json);
                continue;
            }
            write_run(&mut seq, &mut run)?;
            seq.serialize_element(json)?;
        }
        write_run(&mut seq, &mut run)?;
        seq.end()
    }
}

/// Whether a message's JSON is an assistant message (serde writes the role, the tag of
/// async-openai's message type, first).
fn is_assistant(json: &RawValue) -> bool {
    json.get().starts_with(r#"{"role":"assistant""#)
}

/// Writes a run of assistant messages in a row as one, and empties it.
fn write_run<S: serde::ser::SerializeSeq>(
    seq: &mut S,
    run: &mut Vec<&RawValue>,
) -> Result<(), S::Error> {
    match run.as_slice() {
        [] => {}
        [one] => seq.serialize_element(one)?,
        several => seq.serialize_element(&merged(several))?,
    }
    run.clear();
    Ok(())
}

/// Assistant messages in a row as the one message every backend accepts: an answer
/// continued after `max_output_tokens` is stored a part at a time, and llama-server refuses
/// a request that ends with two assistant messages ("Cannot have 2 or more assistant
/// messages at the end of the list"), as chat templates that want the roles to alternate
/// do anywhere. Texts are joined as they came (the parts of one answer), tool calls follow
/// one another, and a reasoning field is joined like the text.
fn merged(run: &[&RawValue]) -> serde_json::Value {
    use serde_json::Value;
    let mut out = serde_json::Map::new();
    for json in run {
        let Ok(Value::Object(message)) = serde_json::from_str::<Value>(json.get()) else {
            continue;
        };
        for (field, value) in message {
            match (out.get_mut(&field), value) {
                (None | Some(Value::Null), value) => {
                    out.insert(field, value);
                }
                (Some(_), Value::Null) => {}
                (Some(Value::String(text)), Value::String(more)) if field != "role" => {
                    text.push_str(&more);
                }
                (Some(Value::Array(list)), Value::Array(more)) => list.extend(more),
                (Some(_), _) => {}
            }
        }
    }
    Value::Object(out)
}

/// The body of a streaming chat-completions request: the system prompt, the history, the
/// tools, `stream` with usage in the last chunk, and the output token limit. It borrows the
/// history and is serialised by whoever sends it.
#[derive(Debug, serde::Serialize)]
pub struct Body<'a> {
    model: &'a str,
    messages: Messages<'a>,
    #[serde(skip_serializing_if = "Tools::is_empty")]
    tools: Tools<'a>,
    /// `"none"` for the summary request: the tools stay defined (the history uses them),
    /// but none may be called.
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<&'static str>,
    stream: bool,
    stream_options: ChatCompletionStreamOptions,
    max_completion_tokens: u32,
}

/// The messages of `history` that carry images, converted (data URLs and all), in order:
/// what [`body`] takes for them.
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

/// The body of the streaming request for `history`, with its messages with images
/// converted by [`images`]; the turn in progress starts at `turn_from` in `history`.
pub fn body<'a>(
    ctx: &RequestContext<'a>,
    history: &'a [Wire],
    turn_from: usize,
    images: &'a [Box<RawValue>],
) -> serde_json::Result<Body<'a>> {
    let tools = with_mcp(
        tools_json(ctx.is_sub_agent, ctx.only_submit)?,
        ctx,
        |name, description, schema| {
            ChatCompletionTools::Function(ChatCompletionTool {
                function: FunctionObject {
                    name: name.to_owned(),
                    description: Some(description.to_owned()),
                    parameters: Some(schema.clone()),
                    strict: None,
                },
            })
        },
    )?;
    Ok(Body {
        model: ctx.model,
        messages: Messages {
            system: ChatCompletionRequestMessage::System(ChatCompletionRequestSystemMessage {
                content: ChatCompletionRequestSystemMessageContent::Text(system_prompt(ctx)),
                name: None,
            }),
            history,
            images,
            reasoning_from: ctx.echo_reasoning.then_some(turn_from),
        },
        tool_choice: (ctx.no_tools && !tools.is_empty()).then_some("none"),
        tools,
        stream: true,
        stream_options: ChatCompletionStreamOptions {
            include_usage: Some(true),
            include_obfuscation: None,
        },
        max_completion_tokens: ctx.max_output_tokens,
    })
}

impl Body<'_> {
    /// The size of the body's JSON, counted without making it: the history's pieces are
    /// only measured.
    pub fn size(&self) -> serde_json::Result<usize> {
        json_size(self)
    }

    /// A bound the body's JSON never exceeds, from the lengths of its history's pieces (none
    /// is serialised): what is sent is the pieces one after the other, a run of assistant
    /// messages merged into one no longer than its parts, the system prompt, and the model's
    /// name, which escaping makes at most six times as long. A body under the limit by this
    /// bound needs no count.
    pub fn size_at_most(&self) -> usize {
        /// The fields and punctuation around the pieces, with room to spare.
        const FRAME: usize = 512;
        let escaped = |text: &str| text.len() * 6;
        // The system prompt is short: counted.
        let system = json_size(&self.messages.system).unwrap_or(usize::MAX / 4);
        let history: usize = self
            .messages
            .history
            .iter()
            .map(|piece| match piece {
                Wire::Skip | Wire::Images(_) => 1,
                Wire::Json(json) => json.get().len() + 1,
                Wire::Thought {
                    plain,
                    with_reasoning,
                } => plain.get().len().max(with_reasoning.get().len()) + 1,
            })
            .sum();
        let images: usize = self.messages.images.iter().map(|i| i.get().len() + 1).sum();
        let tools = match &self.tools {
            Tools::Cached(raw) => raw.get().len(),
            Tools::Own(raw) => raw.get().len(),
        };
        FRAME + escaped(self.model) + system + history + images + tools
    }
}

/// The size of `value`'s JSON, counted without making it.
pub fn json_size(value: &impl serde::Serialize) -> serde_json::Result<usize> {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, value)?;
    Ok(count.0)
}

fn user_text(text: String) -> ChatCompletionRequestMessage {
    ChatCompletionRequestMessage::User(ChatCompletionRequestUserMessage {
        content: ChatCompletionRequestUserMessageContent::Text(text),
        name: None,
    })
}

fn convert(
    content: &MessageContent,
    images: ImageLoader<'_>,
) -> Option<ChatCompletionRequestMessage> {
    Some(match content {
        MessageContent::User { text, images: refs } if refs.is_empty() => user_text(text.clone()),
        MessageContent::User { text, images: refs } => {
            let mut parts = vec![ChatCompletionRequestUserMessageContentPart::Text(
                ChatCompletionRequestMessageContentPartText {
                    text: text.clone(),
                    prompt_cache_breakpoint: None,
                },
            )];
            for image in refs {
                // REQ-BED-013: images go as data URLs, already resized when they were stored.
                match images(&image.id) {
                    Some((media_type, bytes)) => {
                        parts.push(ChatCompletionRequestUserMessageContentPart::ImageUrl(
                            ChatCompletionRequestMessageContentPartImage {
                                image_url: ImageUrl {
                                    url: format!(
                                        "data:{media_type};base64,{}",
                                        base64::engine::general_purpose::STANDARD.encode(bytes)
                                    ),
                                    detail: None,
                                },
                                prompt_cache_breakpoint: None,
                            },
                        ))
                    }
                    None => parts.push(ChatCompletionRequestUserMessageContentPart::Text(
                        ChatCompletionRequestMessageContentPartText {
                            text: format!("[image {} is no longer available]", image.id),
                            prompt_cache_breakpoint: None,
                        },
                    )),
                }
            }
            ChatCompletionRequestMessage::User(ChatCompletionRequestUserMessage {
                content: ChatCompletionRequestUserMessageContent::Array(parts),
                name: None,
            })
        }
        MessageContent::Agent {
            text, tool_uses, ..
        } => {
            if text.as_deref().is_none_or(str::is_empty) && tool_uses.is_empty() {
                return None;
            }
            let tool_calls = (!tool_uses.is_empty()).then(|| {
                tool_uses
                    .iter()
                    .map(|tool| {
                        ChatCompletionMessageToolCalls::Function(ChatCompletionMessageToolCall {
                            id: tool.id.clone(),
                            function: FunctionCall {
                                name: tool.name.clone(),
                                // A history must be valid for any backend, whatever one sent
                                // before: arguments that are not a JSON object (a call cut at
                                // the token limit, `{"command":`) go back as an object that
                                // says so, as on the Anthropic path; the stored message keeps
                                // them as they came. (llama-server refuses a whole request
                                // whose past arguments do not parse.)
                                arguments: if tool.input.is_object() {
                                    tool.input.to_string()
                                } else {
                                    serde_json::json!({"invalid_arguments": tool.input}).to_string()
                                },
                            },
                        })
                    })
                    .collect()
            });
            #[allow(deprecated)]
            ChatCompletionRequestMessage::Assistant(ChatCompletionRequestAssistantMessage {
                content: text
                    .clone()
                    .filter(|t| !t.is_empty())
                    .map(ChatCompletionRequestAssistantMessageContent::Text),
                tool_calls,
                ..Default::default()
            })
        }
        MessageContent::Tool(result) => {
            ChatCompletionRequestMessage::Tool(ChatCompletionRequestToolMessage {
                content: ChatCompletionRequestToolMessageContent::Text(if result.ok {
                    result.output.clone()
                } else {
                    format!("[tool failed]\n{}", result.output)
                }),
                tool_call_id: result.tool_use_id.clone(),
            })
        }
        // Injected context (background results, reminders) goes as a user turn: every
        // compatible backend accepts it anywhere in the history.
        MessageContent::System { text } => user_text(text.clone()),
        // Errors are for the user; the model never sees them.
        MessageContent::Error { .. } => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state_machine::{ImageRef, ToolResult, ToolUse};
    use async_openai::types::chat::CreateChatCompletionRequest;

    fn agent(text: &str, tool_uses: Vec<ToolUse>) -> MessageContent {
        MessageContent::Agent {
            text: Some(text.into()),
            tool_uses,
            reasoning: None,
        }
    }

    /// REQ-BED-003: an answer continued after the output limit is stored a part at a time;
    /// the parts go to the backend as one assistant message (issue 42, item 2: llama-server
    /// refuses two assistant messages at the end), tool calls and all, and a message of
    /// another role ends the run.
    #[test]
    fn assistant_messages_in_a_row_go_as_one() {
        let user = |text: &str| MessageContent::User {
            text: text.into(),
            images: vec![],
        };
        let call = ToolUse {
            id: "call_1".into(),
            name: "bash".into(),
            input: serde_json::json!({"command": "ls"}),
            extra: None,
        };
        let history = [
            user("write a long answer"),
            agent("part one, ", vec![]),
            MessageContent::Error {
                text: "not sent".into(),
            },
            agent("part two, ", vec![]),
            agent("part three", vec![call]),
            MessageContent::Tool(ToolResult {
                tool_use_id: "call_1".into(),
                name: "bash".into(),
                ok: true,
                output: "a b".into(),
                cancelled: false,
            }),
            agent("after the tool, ", vec![]),
            agent("continued", vec![]),
        ];
        let ctx = RequestContext {
            model: "m",
            cwd: "/w",
            system_prompt: None,
            is_sub_agent: false,
            only_submit: false,
            no_tools: false,
            mcp_tools: &[],
            client_tools: &[],
            tools: None,
            max_output_tokens: 512,
            echo_reasoning: false,
        };
        let wires: Vec<Wire> = history.iter().map(wire).collect();
        let body = body(&ctx, &wires, 0, &[]).expect("encodes");
        let text = serde_json::to_string(&body).expect("serialises");
        assert_eq!(body.size().expect("counts"), text.len());
        assert!(body.size_at_most() >= text.len(), "the bound holds");
        let sent: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        let messages = sent["messages"].as_array().expect("messages");
        let roles: Vec<&str> = messages.iter().filter_map(|m| m["role"].as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant"]);
        assert_eq!(messages[2]["content"], "part one, part two, part three");
        assert_eq!(messages[2]["tool_calls"][0]["id"], "call_1");
        assert_eq!(messages[2]["tool_calls"].as_array().map(Vec::len), Some(1));
        assert_eq!(messages[4]["content"], "after the tool, continued");
        // One assistant message alone is sent as it was made.
        let one: Vec<Wire> = history[..2].iter().map(wire).collect();
        let sent: serde_json::Value =
            serde_json::to_value(body_of(&ctx, &one)).expect("serialises");
        let Wire::Json(made) = &one[1] else {
            panic!("an agent message is JSON");
        };
        assert_eq!(
            sent["messages"][2],
            serde_json::from_str::<serde_json::Value>(made.get()).expect("JSON")
        );
    }

    fn body_of<'a>(ctx: &RequestContext<'a>, wires: &'a [Wire]) -> Body<'a> {
        body(ctx, wires, 0, &[]).expect("encodes")
    }

    /// The body put together from cached pieces is exactly the typed request async-openai
    /// would send for the same history (REQ-BED-004's chain, REQ-BED-013's images).
    #[test]
    fn the_body_is_the_typed_request() {
        let history = [
            MessageContent::User {
                text: "list the files".into(),
                images: vec![],
            },
            MessageContent::Agent {
                text: Some("Looking.".into()),
                tool_uses: vec![ToolUse {
                    id: "call_1".into(),
                    name: "bash".into(),
                    input: serde_json::json!({"command": "ls \"a b\""}),
                    extra: None,
                }],
                reasoning: None,
            },
            MessageContent::Tool(ToolResult {
                tool_use_id: "call_1".into(),
                name: "bash".into(),
                ok: false,
                output: "no such file".into(),
                cancelled: false,
            }),
            MessageContent::Error {
                text: "not sent".into(),
            },
            MessageContent::Agent {
                text: None,
                tool_uses: vec![],
                reasoning: None,
            },
            MessageContent::System {
                text: "a background task finished".into(),
            },
            MessageContent::User {
                text: "and this picture".into(),
                images: vec![
                    ImageRef {
                        id: "img1".into(),
                        media_type: "image/png".into(),
                    },
                    ImageRef {
                        id: "gone".into(),
                        media_type: "image/png".into(),
                    },
                ],
            },
        ];
        let definitions = crate::tools::definitions(false);
        let ctx = RequestContext {
            model: "m",
            cwd: "/w",
            system_prompt: Some("be brief"),
            is_sub_agent: false,
            only_submit: false,
            no_tools: false,
            mcp_tools: &[],
            client_tools: &[],
            tools: None,
            max_output_tokens: 512,
            echo_reasoning: true,
        };
        let loader = |id: &str| (id == "img1").then(|| ("image/png".to_owned(), vec![1, 2, 3]));
        let wires: Vec<Wire> = history.iter().map(wire).collect();
        assert!(matches!(wires[3], Wire::Skip) && matches!(wires[4], Wire::Skip));
        assert!(matches!(wires[6], Wire::Images(_)));
        let converted = images(&wires, &loader).expect("converts");
        let body = body(&ctx, &wires, 0, &converted).expect("encodes");
        let text = serde_json::to_string(&body).expect("serialises");
        assert_eq!(body.size().expect("counts"), text.len());
        assert!(body.size_at_most() >= text.len(), "the bound holds");
        let sent: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");

        let mut messages = vec![ChatCompletionRequestMessage::System(
            ChatCompletionRequestSystemMessage {
                content: ChatCompletionRequestSystemMessageContent::Text(system_prompt(&ctx)),
                name: None,
            },
        )];
        messages.extend(history.iter().filter_map(|c| convert(c, &loader)));
        let typed = CreateChatCompletionRequest {
            messages,
            model: "m".into(),
            tools: Some(tool_list(&definitions)),
            stream: Some(true),
            stream_options: Some(ChatCompletionStreamOptions {
                include_usage: Some(true),
                include_obfuscation: None,
            }),
            max_completion_tokens: Some(512),
            ..Default::default()
        };
        assert_eq!(sent, serde_json::to_value(&typed).expect("serializes"));
        assert_eq!(sent["messages"].as_array().map(Vec::len), Some(6));
        assert_eq!(
            sent["messages"][5]["content"][1]["image_url"]["url"],
            "data:image/png;base64,AQID"
        );
    }

    /// The reasoning of the turn in progress goes back in the field the backend sent it in,
    /// earlier turns' does not, nor any when the echo is off; a call's provider data goes
    /// back with the call in every turn.
    #[test]
    fn reasoning_goes_back_with_its_turn() {
        use crate::state_machine::Reasoning;
        let agent = |field: &str, signature: &str| MessageContent::Agent {
            text: None,
            tool_uses: vec![ToolUse {
                id: format!("call_{field}"),
                name: "think".into(),
                input: serde_json::json!({}),
                extra: Some(serde_json::json!({"google": {"thought_signature": signature}})),
            }],
            reasoning: Some(Reasoning {
                text: format!("thinking in {field}"),
                field: field.into(),
            }),
        };
        let result = |id: &str| {
            MessageContent::Tool(ToolResult {
                tool_use_id: id.into(),
                name: "think".into(),
                ok: true,
                output: "ok".into(),
                cancelled: false,
            })
        };
        let user = |text: &str| MessageContent::User {
            text: text.into(),
            images: vec![],
        };
        let history = [
            user("first"),
            agent("reasoning", "s1"),
            result("call_reasoning"),
            user("second"),
            agent("reasoning_content", "s2"),
            result("call_reasoning_content"),
        ];
        let wires: Vec<Wire> = history.iter().map(wire).collect();
        let turn_from = history.iter().rposition(starts_turn).map_or(0, |at| at + 1);
        assert_eq!(turn_from, 4);
        for echo in [true, false] {
            let ctx = RequestContext {
                model: "m",
                cwd: "/w",
                system_prompt: None,
                is_sub_agent: false,
                only_submit: false,
                no_tools: false,
                mcp_tools: &[],
                client_tools: &[],
                tools: None,
                max_output_tokens: 512,
                echo_reasoning: echo,
            };
            let body = body(&ctx, &wires, turn_from, &[]).expect("encodes");
            let sent = serde_json::to_value(&body).expect("serialises");
            let messages = &sent["messages"];
            // [system, user, agent, tool, user, agent, tool]
            assert_eq!(
                messages[2]["reasoning"],
                serde_json::Value::Null,
                "an earlier turn"
            );
            let current = &messages[5];
            if echo {
                assert_eq!(
                    current["reasoning_content"],
                    "thinking in reasoning_content"
                );
            } else {
                assert_eq!(current["reasoning_content"], serde_json::Value::Null);
            }
            assert_eq!(current["reasoning"], serde_json::Value::Null);
            for (at, signature) in [(2, "s1"), (5, "s2")] {
                assert_eq!(
                    messages[at]["tool_calls"][0]["extra_content"]["google"]["thought_signature"],
                    signature
                );
            }
        }
    }
}
