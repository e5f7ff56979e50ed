//! The messages a transition asks the store to append to the conversation's history.

use serde::{Deserialize, Serialize};

use super::state::ToolUse;

/// The contract's `message_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageType {
    User,
    Agent,
    Tool,
    System,
    Error,
}

impl MessageType {
    /// The contract's snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            MessageType::User => "user",
            MessageType::Agent => "agent",
            MessageType::Tool => "tool",
            MessageType::System => "system",
            MessageType::Error => "error",
        }
    }
}

pub use super::state::ImageRef;

/// A message's content; its variant is its `message_type`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageContent {
    User {
        text: String,
        images: Vec<ImageRef>,
    },
    Agent {
        text: Option<String>,
        tool_uses: Vec<ToolUse>,
        /// The model's thinking, when the backend streamed it.
        reasoning: Option<Reasoning>,
    },
    Tool(ToolResult),
    /// Injected context the LLM sees (background results, reminders).
    System {
        text: String,
    },
    /// Shown to the user; never sent to the LLM.
    Error {
        text: String,
    },
}

/// A model's thinking, and the request field the backend sent it in (`reasoning_content` or
/// `reasoning`): the field it is sent back in, to backends that want it back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reasoning {
    pub text: String,
    pub field: String,
}

/// The one result of one tool call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolResult {
    pub tool_use_id: String,
    pub name: String,
    pub ok: bool,
    pub output: String,
    /// True for synthetic results of work that never finished (cancel, restart, shutdown).
    #[serde(default)]
    pub cancelled: bool,
}

impl MessageContent {
    /// The contract's `message_type` of this content.
    pub fn message_type(&self) -> MessageType {
        match self {
            MessageContent::User { .. } => MessageType::User,
            MessageContent::Agent { .. } => MessageType::Agent,
            MessageContent::Tool(_) => MessageType::Tool,
            MessageContent::System { .. } => MessageType::System,
            MessageContent::Error { .. } => MessageType::Error,
        }
    }

    /// A tool result for `tool`.
    pub fn tool_result(
        tool: &ToolUse,
        ok: bool,
        output: impl Into<String>,
        cancelled: bool,
    ) -> Self {
        MessageContent::Tool(ToolResult {
            tool_use_id: tool.id.clone(),
            name: tool.name.clone(),
            ok,
            output: output.into(),
            cancelled,
        })
    }
}
