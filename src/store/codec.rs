//! How the store keeps a message's content and usage (its type is the core's
//! `MessageType::as_str`): JSON of its own, written and read
//! only here. It is not the wire's `Message` (src/wire.rs), though it began as a copy of
//! its `content`: rows written by every earlier version read back, so a field may be added
//! here but never renamed, and the wire may change without touching a stored row.
//!
//! - user: `{"text", "images": [{"id", "media_type"}]}`
//! - agent: `{"text", "tool_uses": [{"id", "name", "input", ...}], "reasoning"?, "reasoning_field"?}`
//! - tool: `{"tool_use_id", "name", "ok", "output", "cancelled"?}` (absent: false)
//! - system, error: `{"text"}`
//! - usage: `[input_tokens, output_tokens]` (rows before it: an object of the two)

use serde_json::{Map, Value, json};

use crate::state_machine::{ImageRef, MessageContent, Reasoning, ToolResult, ToolUse};

/// A message's content as stored: what it says, and for an agent message what the backend
/// wants back (the field its reasoning came in, the provider's data on tool calls).
pub(super) fn content(content: &MessageContent) -> Value {
    match content {
        MessageContent::User { text, images } => json!({
            "text": text,
            "images": images
                .iter()
                .map(|image| json!({"id": image.id, "media_type": image.media_type}))
                .collect::<Vec<_>>(),
        }),
        MessageContent::Agent {
            text,
            tool_uses,
            reasoning,
        } => {
            let mut stored = Map::new();
            stored.insert("text".into(), json!(text));
            stored.insert("tool_uses".into(), json!(tool_uses));
            if let Some(reasoning) = reasoning {
                stored.insert("reasoning".into(), Value::String(reasoning.text.clone()));
                stored.insert(
                    "reasoning_field".into(),
                    Value::String(reasoning.field.clone()),
                );
            }
            Value::Object(stored)
        }
        MessageContent::Tool(result) => {
            let mut stored = json!({
                "tool_use_id": result.tool_use_id,
                "name": result.name,
                "ok": result.ok,
                "output": result.output,
            });
            if result.cancelled
                && let Some(object) = stored.as_object_mut()
            {
                object.insert("cancelled".into(), Value::Bool(true));
            }
            stored
        }
        MessageContent::System { text } | MessageContent::Error { text } => json!({"text": text}),
    }
}

/// Reads back a stored content of the given type.
pub(super) fn parse_content(kind: &str, value: &Value) -> Result<MessageContent, String> {
    let text = |key: &str| -> Result<String, String> {
        value
            .get(key)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| format!("{kind} content lacks a string `{key}`"))
    };
    let list = |key: &str| value.get(key).cloned().unwrap_or(Value::Array(vec![]));
    Ok(match kind {
        "user" => MessageContent::User {
            text: text("text")?,
            images: serde_json::from_value::<Vec<ImageRef>>(list("images"))
                .map_err(|e| format!("user content images: {e}"))?,
        },
        "agent" => MessageContent::Agent {
            text: value.get("text").and_then(Value::as_str).map(str::to_owned),
            tool_uses: serde_json::from_value::<Vec<ToolUse>>(list("tool_uses"))
                .map_err(|e| format!("agent content tool_uses: {e}"))?,
            reasoning: value
                .get("reasoning")
                .and_then(Value::as_str)
                .map(|text| Reasoning {
                    text: text.to_owned(),
                    field: value
                        .get("reasoning_field")
                        .and_then(Value::as_str)
                        .unwrap_or("reasoning_content")
                        .to_owned(),
                }),
        },
        "tool" => MessageContent::Tool(
            serde_json::from_value::<ToolResult>(value.clone())
                .map_err(|e| format!("tool content: {e}"))?,
        ),
        "system" => MessageContent::System {
            text: text("text")?,
        },
        "error" => MessageContent::Error {
            text: text("text")?,
        },
        other => return Err(format!("unknown message type {other:?}")),
    })
}

/// A message's usage as stored: `[input_tokens, output_tokens]`.
pub(super) fn usage(usage: &crate::state_machine::Usage) -> Value {
    json!([usage.input_tokens, usage.output_tokens])
}

/// Reads back [`usage`] (and the object rows stored before it).
pub(super) fn parse_usage(value: &Value) -> Option<crate::state_machine::Usage> {
    let (input, output) = match value {
        Value::Array(counts) => (counts.first()?, counts.get(1)?),
        Value::Object(counts) => (counts.get("input_tokens")?, counts.get("output_tokens")?),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => return None,
    };
    Some(crate::state_machine::Usage {
        input_tokens: input.as_u64()?,
        output_tokens: output.as_u64()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows as earlier versions wrote them (the wire's `content` then) read back whole.
    #[test]
    fn rows_written_before_read_back() {
        let rows = [
            (
                "user",
                json!({"text": "hi", "images": [{"id": "a1", "media_type": "image/png"}]}),
            ),
            (
                "agent",
                json!({"text": null, "tool_uses": [{"id": "t1", "name": "bash", "input": {"command": "ls"}}], "reasoning": "hm", "reasoning_field": "reasoning"}),
            ),
            (
                "tool",
                json!({"tool_use_id": "t1", "name": "bash", "ok": true, "output": "x"}),
            ),
            (
                "tool",
                json!({"tool_use_id": "t1", "name": "bash", "ok": false, "output": "", "cancelled": true}),
            ),
            ("system", json!({"text": "s"})),
            ("error", json!({"text": "e"})),
        ];
        for (kind, row) in rows {
            let parsed = parse_content(kind, &row).expect("reads");
            assert_eq!(parsed.message_type().as_str(), kind);
            assert_eq!(content(&parsed), row, "{kind} writes back as it was");
        }
        assert!(parse_content("robot", &json!({})).is_err());
        assert!(parse_content("user", &json!({"images": []})).is_err());
    }

    #[test]
    fn usage_reads_both_shapes() {
        let usage = crate::state_machine::Usage {
            input_tokens: 7,
            output_tokens: 3,
        };
        assert_eq!(parse_usage(&super::usage(&usage)), Some(usage));
        assert_eq!(
            parse_usage(&json!({"input_tokens": 7, "output_tokens": 3})),
            Some(usage)
        );
        assert_eq!(parse_usage(&json!("7,3")), None);
    }
}
