//! The contract's JSON shapes (../shared/api.md): states, messages, usage and frames.
//!
//! Everything that leaves the process as JSON is built here, and so is the JSON of message
//! contents and durable frames that the store keeps (they are stored as they are sent).

use serde_json::{Value, json};

use crate::model::{ConversationRecord, MessageRecord};
use crate::state_machine::{
    ConvState, ImageRef, MessageContent, MessageType, ToolResult, ToolUse, Usage,
};

/// The contract's `State` object.
pub fn state(state: &ConvState) -> Value {
    match state {
        ConvState::Idle => json!({"kind": "idle"}),
        ConvState::AwaitingLlm { .. } => json!({"kind": "awaiting_llm"}),
        ConvState::LlmRequesting { attempt, .. } => {
            json!({"kind": "llm_requesting", "attempt": attempt})
        }
        ConvState::ToolExecuting {
            current,
            remaining,
            completed,
            ..
        } => json!({
            "kind": "tool_executing",
            "current_tool_id": current.id,
            "current_tool_name": current.name,
            "remaining_tool_ids": remaining.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(),
            "completed": completed,
        }),
        ConvState::Cancelling { .. } => json!({"kind": "cancelling"}),
        ConvState::AwaitingSubAgents { agents, .. } => json!({
            "kind": "awaiting_sub_agents",
            "pending_ids": state.pending_agent_ids(),
            "completed": agents.iter().filter(|slot| slot.outcome.is_some()).count(),
        }),
        ConvState::Error {
            message,
            error_kind,
        } => json!({"kind": "error", "message": message, "error_kind": error_kind.as_str()}),
        ConvState::Completed => json!({"kind": "completed"}),
    }
}

/// The contract's `Usage` object.
pub fn usage(input_tokens: u64, output_tokens: u64, context_tokens: u64, window: u64) -> Value {
    json!({
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "context_tokens": context_tokens,
        "context_window": window,
    })
}

/// The contract's `Conversation` object.
pub fn conversation(conv: &ConversationRecord, context_window: u64) -> Value {
    json!({
        "id": conv.id,
        "slug": conv.slug,
        "cwd": conv.cwd,
        "model": conv.model,
        "system_prompt": conv.system_prompt,
        "parent_id": conv.parent_id,
        "user_initiated": conv.user_initiated,
        "require_approval": conv.require_approval,
        "network": conv.network,
        "archived": conv.archived,
        "state": state(&conv.state),
        "usage": usage(
            conv.usage.input_tokens,
            conv.usage.output_tokens,
            conv.usage.context_tokens,
            context_window,
        ),
        "created_at": conv.created_at.to_rfc3339(),
        "updated_at": conv.updated_at.to_rfc3339(),
    })
}

/// The contract's `Message` object.
pub fn message(message: &MessageRecord, context_window: u64) -> Value {
    let mut value = json!({
        "id": message.id,
        "conversation_id": message.conversation_id,
        "sequence_id": message.sequence_id,
        "message_type": message.content.message_type().as_str(),
        "content": content(&message.content),
        "usage": message.usage.map(|u| usage(u.input_tokens, u.output_tokens, u.context_tokens(), context_window)),
        "created_at": message.created_at.to_rfc3339(),
    });
    if let (Some(key), Some(object)) = (&message.client_message_id, value.as_object_mut()) {
        object.insert("message_id".into(), Value::String(key.clone()));
    }
    value
}

/// A message's `content` object, by type.
pub fn content(content: &MessageContent) -> Value {
    match content {
        MessageContent::User { text, images } => json!({"text": text, "images": images
            .iter()
            .map(|image| json!({"id": image.id, "media_type": image.media_type}))
            .collect::<Vec<_>>()}),
        MessageContent::Agent { text, tool_uses } => json!({
            "text": text,
            "tool_uses": tool_uses
                .iter()
                .map(|tool| json!({"id": tool.id, "name": tool.name, "input": tool.input}))
                .collect::<Vec<_>>(),
        }),
        MessageContent::Tool(result) => json!({
            "tool_use_id": result.tool_use_id,
            "name": result.name,
            "ok": result.ok,
            "output": result.output,
            "cancelled": result.cancelled,
        }),
        MessageContent::System { text } | MessageContent::Error { text } => json!({"text": text}),
    }
}

/// Reads back a stored `content` object of the given type.
pub fn parse_content(kind: &str, value: &Value) -> Result<MessageContent, String> {
    let text = |key: &str| -> Result<String, String> {
        value
            .get(key)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| format!("{kind} content lacks a string `{key}`"))
    };
    let kind_enum = match kind {
        "user" => MessageType::User,
        "agent" => MessageType::Agent,
        "tool" => MessageType::Tool,
        "system" => MessageType::System,
        "error" => MessageType::Error,
        other => return Err(format!("unknown message type {other:?}")),
    };
    Ok(match kind_enum {
        MessageType::User => MessageContent::User {
            text: text("text")?,
            images: serde_json::from_value::<Vec<ImageRef>>(
                value.get("images").cloned().unwrap_or(Value::Array(vec![])),
            )
            .map_err(|e| format!("user content images: {e}"))?,
        },
        MessageType::Agent => MessageContent::Agent {
            text: value.get("text").and_then(Value::as_str).map(str::to_owned),
            tool_uses: serde_json::from_value::<Vec<ToolUse>>(
                value
                    .get("tool_uses")
                    .cloned()
                    .unwrap_or(Value::Array(vec![])),
            )
            .map_err(|e| format!("agent content tool_uses: {e}"))?,
        },
        MessageType::Tool => MessageContent::Tool(
            serde_json::from_value::<ToolResult>(value.clone())
                .map_err(|e| format!("tool content: {e}"))?,
        ),
        MessageType::System => MessageContent::System {
            text: text("text")?,
        },
        MessageType::Error => MessageContent::Error {
            text: text("text")?,
        },
    })
}

/// Usage as stored with a message.
pub fn stored_usage(usage: &Usage) -> Value {
    json!({"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens})
}

/// Reads back [`stored_usage`].
pub fn parse_stored_usage(value: &Value) -> Option<Usage> {
    Some(Usage {
        input_tokens: value.get("input_tokens")?.as_u64()?,
        output_tokens: value.get("output_tokens")?.as_u64()?,
    })
}

/// A background task as listed on its conversation.
pub fn background_task(task: &crate::model::BackgroundTask) -> Value {
    json!({
        "task_id": task.id,
        "tool_use_id": task.tool_use_id,
        "tool_name": task.tool_name,
        "command": task.command,
        "status": task.status,
        "exit_code": task.exit_code,
        "output": task.output,
        "created_at": task.created_at.to_rfc3339(),
        "finished_at": task.finished_at.map(|t| t.to_rfc3339()),
    })
}
