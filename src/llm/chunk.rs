//! The chat-completions stream chunk as OpenAI-compatible servers really send it: every
//! field optional where some server omits it, values some server bends (a finish reason
//! it made up, `arguments` as an object, `usage: {}`, `null` for a list) read rather than
//! refused, fields the gateway does not use ignored. async-openai's `byot` calls
//! deserialise into this instead of its own strict types, so one odd chunk never fails a
//! reply (docs/backends.md lists what each server sends).
//!
//! A non-streamed completion (what a server answers when it ignores `stream: true`) reads
//! as one chunk too: its `message` stands for the delta.

use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// One `data:` payload of the stream.
#[derive(Debug, Default, Deserialize)]
pub struct Chunk {
    #[serde(default, deserialize_with = "null_as_default")]
    pub choices: Vec<Choice>,
    #[serde(default)]
    pub usage: Option<UsageIn>,
    /// Groq's usage report in older streams.
    #[serde(default)]
    pub x_groq: Option<XGroq>,
    /// An error inside a 200 stream (OpenRouter, vLLM, LiteLLM): a string or an object.
    #[serde(default)]
    pub error: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
pub struct XGroq {
    #[serde(default)]
    pub usage: Option<UsageIn>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Choice {
    /// Absent on some servers; the gateway asks for one choice.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub index: Option<u64>,
    /// A non-streamed completion's `message` is read as the delta.
    #[serde(default, alias = "message", deserialize_with = "null_as_default")]
    pub delta: Delta,
    /// Kept as the server spelled it; `""` counts as none.
    #[serde(default, deserialize_with = "lenient_string")]
    pub finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Delta {
    #[serde(default, deserialize_with = "lenient_string")]
    pub content: Option<String>,
    /// DeepSeek's thinking.
    #[serde(default, deserialize_with = "lenient_string")]
    pub reasoning_content: Option<String>,
    /// vLLM's, OpenRouter's, Ollama's and Groq's thinking.
    #[serde(default, deserialize_with = "lenient_string")]
    pub reasoning: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub tool_calls: Vec<ToolCallDelta>,
}

/// A fragment of a tool call.
#[derive(Debug, Default, Deserialize)]
pub struct ToolCallDelta {
    /// Absent on Gemini's endpoint: the call's position is taken instead.
    #[serde(default, deserialize_with = "lenient_u64")]
    pub index: Option<u64>,
    /// `""` counts as none.
    #[serde(default, deserialize_with = "lenient_string")]
    pub id: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub function: FunctionDelta,
    /// Provider data to send back with the call (Gemini's thought signature).
    #[serde(default)]
    pub extra_content: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
pub struct FunctionDelta {
    #[serde(default, deserialize_with = "lenient_string")]
    pub name: Option<String>,
    /// A fragment of the arguments' JSON text, or (llama.cpp, early 2026) the arguments as
    /// a JSON value.
    #[serde(default)]
    pub arguments: Option<Value>,
}

impl FunctionDelta {
    /// The arguments as JSON text: a string as it is, any other value serialised.
    pub fn arguments_text(&self) -> Option<String> {
        match self.arguments.as_ref()? {
            Value::Null => None,
            Value::String(text) => Some(text.clone()),
            other @ (Value::Bool(_) | Value::Number(_) | Value::Array(_) | Value::Object(_)) => {
                Some(other.to_string())
            }
        }
    }
}

/// Token counts, when a server reports them; `{}` reports nothing.
#[derive(Debug, Default, Deserialize)]
pub struct UsageIn {
    #[serde(default, deserialize_with = "lenient_u64")]
    pub prompt_tokens: Option<u64>,
    #[serde(default, deserialize_with = "lenient_u64")]
    pub completion_tokens: Option<u64>,
}

/// `null` as the type's default (an empty list, an empty delta).
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// A string; `""`, `null` and values of other types count as none.
fn lenient_string<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    Ok(match Value::deserialize(deserializer)? {
        Value::String(text) if !text.is_empty() => Some(text),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => None,
        Value::Array(_) | Value::Object(_) => None,
    })
}

/// A count: an integer, a float with nothing after the point, or such a number as a string.
fn lenient_u64<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    Ok(match Value::deserialize(deserializer)? {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 0.0)
                .map(|f| f as u64)
        }),
        Value::String(text) => text.trim().parse().ok(),
        Value::Null | Value::Bool(_) | Value::Array(_) | Value::Object(_) => None,
    })
}
