//! Accumulates a streamed chat completion: text deltas in order, tool-call fragments by their
//! stream index, usage from the final chunk. Tool arguments are validated as JSON only once
//! the stream is complete (desi-gateway-design.md).

use std::collections::BTreeMap;

use async_openai::types::chat::{CreateChatCompletionStreamResponse, FinishReason};
use serde_json::Value;

use super::Failure;
use crate::state_machine::{ErrorKind, LlmReply, ToolUse, Usage};

#[derive(Debug, Default)]
struct ToolFragments {
    id: String,
    name: String,
    arguments: String,
}

/// The state of one streamed response.
#[derive(Debug)]
pub struct Accumulator {
    max_tool_args_bytes: usize,
    text: String,
    tools: BTreeMap<u32, ToolFragments>,
    finish: Option<FinishReason>,
    usage: Option<Usage>,
}

impl Accumulator {
    pub fn new(max_tool_args_bytes: usize) -> Self {
        Self {
            max_tool_args_bytes,
            text: String::new(),
            tools: BTreeMap::new(),
            finish: None,
            usage: None,
        }
    }

    /// Takes one chunk; returns the text it adds, to forward to clients live.
    pub fn push(
        &mut self,
        chunk: CreateChatCompletionStreamResponse,
    ) -> Result<Option<String>, Failure> {
        if let Some(usage) = chunk.usage {
            self.usage = Some(Usage {
                input_tokens: u64::from(usage.prompt_tokens),
                output_tokens: u64::from(usage.completion_tokens),
            });
        }
        let mut added: Option<String> = None;
        // We ask for one choice; others, if a backend sends them, are not ours.
        for choice in chunk.choices.into_iter().filter(|c| c.index == 0) {
            if let Some(reason) = choice.finish_reason {
                self.finish = Some(reason);
            }
            if let Some(text) = choice.delta.content.filter(|t| !t.is_empty()) {
                self.text.push_str(&text);
                added.get_or_insert_with(String::new).push_str(&text);
            }
            for fragment in choice.delta.tool_calls.unwrap_or_default() {
                let entry = self.tools.entry(fragment.index).or_default();
                if let Some(id) = fragment.id.filter(|id| !id.is_empty()) {
                    entry.id = id;
                }
                if let Some(function) = fragment.function {
                    if let Some(name) = function.name {
                        entry.name.push_str(&name);
                    }
                    if let Some(arguments) = function.arguments {
                        entry.arguments.push_str(&arguments);
                        if entry.arguments.len() > self.max_tool_args_bytes {
                            return Err(Failure::new(
                                ErrorKind::Limit,
                                format!(
                                    "the arguments of tool call {} exceed the limit of {} bytes",
                                    fragment.index, self.max_tool_args_bytes
                                ),
                            ));
                        }
                    }
                }
            }
        }
        Ok(added)
    }

    /// The complete reply, once the stream has ended.
    pub fn finish(self) -> Result<LlmReply, Failure> {
        let Some(reason) = self.finish else {
            return Err(Failure::new(
                ErrorKind::Network,
                "the stream ended before the model finished (no finish_reason): truncated",
            ));
        };
        let mut tool_uses = Vec::with_capacity(self.tools.len());
        for (index, tool) in self.tools {
            if tool.id.is_empty() || tool.name.is_empty() {
                return Err(Failure::new(
                    ErrorKind::Unknown,
                    format!("the model sent tool call {index} without an id or a name"),
                ));
            }
            let input = if tool.arguments.trim().is_empty() {
                Value::Object(Default::default())
            } else {
                // Arguments that are not JSON reach the tool as a string; the tool refuses
                // them with a message the model can act on.
                serde_json::from_str(&tool.arguments).unwrap_or(Value::String(tool.arguments))
            };
            tool_uses.push(ToolUse {
                id: tool.id,
                name: tool.name,
                input,
            });
        }
        Ok(LlmReply {
            text: (!self.text.is_empty()).then_some(self.text),
            tool_uses,
            end_turn: !matches!(reason, FinishReason::Length),
            usage: self.usage.unwrap_or_default(),
        })
    }
}
