//! Builds the chat-completions request of one LLM step from the stored history.

use async_openai::types::chat::{
    ChatCompletionMessageToolCall, ChatCompletionMessageToolCalls,
    ChatCompletionRequestAssistantMessage, ChatCompletionRequestAssistantMessageContent,
    ChatCompletionRequestMessage, ChatCompletionRequestMessageContentPartImage,
    ChatCompletionRequestMessageContentPartText, ChatCompletionRequestSystemMessage,
    ChatCompletionRequestSystemMessageContent, ChatCompletionRequestToolMessage,
    ChatCompletionRequestToolMessageContent, ChatCompletionRequestUserMessage,
    ChatCompletionRequestUserMessageContent, ChatCompletionRequestUserMessageContentPart,
    ChatCompletionStreamOptions, ChatCompletionTool, ChatCompletionTools,
    CreateChatCompletionRequest, FunctionCall, FunctionObject, ImageUrl,
};
use base64::Engine;

use crate::model::MessageRecord;
use crate::state_machine::MessageContent;
use crate::tools::ToolDefinition;

/// What the request is built from besides the history.
#[derive(Clone, Debug)]
pub struct RequestContext<'a> {
    pub model: &'a str,
    pub cwd: &'a str,
    pub system_prompt: Option<&'a str>,
    pub is_sub_agent: bool,
    pub max_output_tokens: u32,
    pub tools: &'a [ToolDefinition],
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

/// The request for `history`.
pub fn build(
    ctx: &RequestContext<'_>,
    history: &[MessageRecord],
    images: ImageLoader<'_>,
) -> CreateChatCompletionRequest {
    let mut messages = Vec::with_capacity(history.len() + 1);
    messages.push(ChatCompletionRequestMessage::System(
        ChatCompletionRequestSystemMessage {
            content: ChatCompletionRequestSystemMessageContent::Text(system_prompt(ctx)),
            name: None,
        },
    ));
    for record in history {
        if let Some(message) = convert(&record.content, images) {
            messages.push(message);
        }
    }
    let tools = ctx
        .tools
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
        .collect();
    CreateChatCompletionRequest {
        messages,
        model: ctx.model.to_owned(),
        tools: Some(tools),
        stream: Some(true),
        stream_options: Some(ChatCompletionStreamOptions {
            include_usage: Some(true),
            include_obfuscation: None,
        }),
        max_completion_tokens: Some(ctx.max_output_tokens),
        ..Default::default()
    }
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
        MessageContent::Agent { text, tool_uses } => {
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
                                // Arguments that were not JSON are sent back as they came.
                                arguments: tool
                                    .input
                                    .as_str()
                                    .map_or_else(|| tool.input.to_string(), str::to_owned),
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
