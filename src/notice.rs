//! What a conversation tells its clients, before any format: the notices the runtime and
//! the gateway emit (a message stored, a state entered, a request to the client, a system
//! event, a delta of text), and the port through which they become frames.
//!
//! The runtime names no wire type. The API's format (src/wire.rs) implements [`Encode`],
//! and the composition root (src/app.rs) hands that encoder to the runtime, which encodes
//! each durable frame once, at its commit, so that the bytes stored and the bytes sent live
//! are the same. The system bus's events and the server's requests to the client are
//! defined here because the runtime makes them; the OpenAPI document describes them as
//! they are.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::model::{BackgroundTask, MessageRecord, RequestStatus};
use crate::state_machine::{ConvState, ErrorKind};

/// A request from the server to the client, by kind.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RequestType {
    Confirm {
        message: String,
        #[serde(default)]
        default: Option<bool>,
    },
    Prompt {
        message: String,
        #[serde(default)]
        default: Option<String>,
        #[serde(default)]
        placeholder: Option<String>,
    },
    Select {
        message: String,
        options: Vec<SelectOption>,
        #[serde(default)]
        multi_select: bool,
    },
    Custom {
        /// What the client should show.
        type_name: String,
        /// A JSON Schema of the expected answer.
        #[serde(default)]
        schema: Value,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SelectOption {
    pub value: String,
    pub label: String,
    #[serde(default)]
    pub description: Option<String>,
}

/// A system event (system-bus-plan.md): `type` plus the fields of that type. Clients may
/// post `user_request`, `user_response` and `approval_response`; the others are the
/// server's. Fields beyond those listed are kept and passed on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SystemEvent {
    /// `system_notice`, `system_error`, `tool_progress`, `tool_result`, `user_request`,
    /// `user_response`, `approval_request` or `approval_response`.
    #[serde(rename = "type")]
    pub event_type: String,
    /// The rest of the event: `request_id`, `kind` (user_request: `usage` or `tasks`),
    /// `payload`, `approved` (approval_response), ...
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub fields: serde_json::Map<String, Value>,
}

impl SystemEvent {
    /// An event of `event_type` with these fields (an object; anything else gives none).
    pub fn new(event_type: &str, fields: Value) -> SystemEvent {
        SystemEvent {
            event_type: event_type.to_owned(),
            fields: if let Value::Object(fields) = fields {
                fields
            } else {
                serde_json::Map::new()
            },
        }
    }

    /// A field's value (Null when it is absent).
    pub fn get(&self, key: &str) -> &Value {
        self.fields.get(key).unwrap_or(&Value::Null)
    }
}

/// One thing a conversation tells its clients.
#[derive(Clone, Copy, Debug)]
pub enum Notice<'a> {
    /// A message was stored.
    Message {
        message: &'a MessageRecord,
        /// Its model's context window (a message's usage says how full it is).
        context_window: u64,
    },
    /// The conversation entered a state.
    State(&'a ConvState),
    /// An LLM request failed and is tried again after a delay.
    Retrying {
        attempt: u32,
        delay_ms: u64,
        error_kind: ErrorKind,
    },
    /// The conversation fills its context window past the warning ratio.
    ContextWarning {
        context_tokens: u64,
        context_window: u64,
        ratio: f64,
    },
    SystemEvent(&'a SystemEvent),
    /// The server asks the client something.
    ClientRequest {
        request_id: &'a str,
        request_type: &'a RequestType,
        timeout_ms: i64,
        tool_use_id: Option<&'a str>,
    },
    /// A request was answered, expired or cancelled.
    ClientRequestResolved {
        request_id: &'a str,
        status: RequestStatus,
    },
    /// The LLM called a tool the client runs: the client answers with its result.
    ClientToolCall {
        call_id: &'a str,
        tool_use_id: &'a str,
        name: &'a str,
        input: &'a Value,
        /// RFC 3339.
        expires_at: &'a str,
    },
    /// A client tool call was answered, expired or cancelled.
    ClientToolResolved {
        call_id: &'a str,
        status: RequestStatus,
    },
    /// A sub-agent changed state or took an LLM step. Not durable.
    SubAgent {
        agent_id: &'a str,
        state: &'a ConvState,
        steps: u32,
        max_steps: u32,
    },
    /// A tool's progress (a background task's output line). Not durable.
    ToolProgress {
        tool_use_id: &'a str,
        tool_name: &'a str,
        task_id: Option<&'a str>,
        stage: &'a str,
        progress: Option<f64>,
        message: &'a str,
    },
    /// Text (and reasoning) the LLM streamed. Not durable.
    Delta {
        text: &'a str,
        reasoning: Option<&'a str>,
    },
}

/// A notice made outside the conversation actor, which numbers it when it stores it.
#[derive(Clone, Debug, PartialEq)]
pub enum Durable {
    SystemEvent(SystemEvent),
    ClientRequest {
        request_id: String,
        request_type: RequestType,
        timeout_ms: i64,
        tool_use_id: Option<String>,
    },
    ClientRequestResolved {
        request_id: String,
        status: RequestStatus,
    },
    ClientToolCall {
        call_id: String,
        tool_use_id: String,
        name: String,
        input: Value,
        expires_at: String,
    },
    ClientToolResolved {
        call_id: String,
        status: RequestStatus,
    },
}

impl Durable {
    pub fn notice(&self) -> Notice<'_> {
        match self {
            Durable::SystemEvent(event) => Notice::SystemEvent(event),
            Durable::ClientRequest {
                request_id,
                request_type,
                timeout_ms,
                tool_use_id,
            } => Notice::ClientRequest {
                request_id,
                request_type,
                timeout_ms: *timeout_ms,
                tool_use_id: tool_use_id.as_deref(),
            },
            Durable::ClientRequestResolved { request_id, status } => {
                Notice::ClientRequestResolved {
                    request_id,
                    status: *status,
                }
            }
            Durable::ClientToolCall {
                call_id,
                tool_use_id,
                name,
                input,
                expires_at,
            } => Notice::ClientToolCall {
                call_id,
                tool_use_id,
                name,
                input,
                expires_at,
            },
            Durable::ClientToolResolved { call_id, status } => Notice::ClientToolResolved {
                call_id,
                status: *status,
            },
        }
    }
}

/// A durable notice with the key that makes it once per conversation (idempotent client
/// events).
#[derive(Clone, Debug, PartialEq)]
pub struct Keyed {
    pub notice: Durable,
    pub dedup_key: Option<String>,
}

impl From<Durable> for Keyed {
    fn from(notice: Durable) -> Keyed {
        Keyed {
            notice,
            dedup_key: None,
        }
    }
}

impl Keyed {
    /// A system event, once per `dedup_key` when it has one.
    pub fn system_event(event: SystemEvent, dedup_key: Option<String>) -> Keyed {
        Keyed {
            notice: Durable::SystemEvent(event),
            dedup_key,
        }
    }
}

/// A notice as clients get it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoded {
    /// The frame's `type`.
    pub kind: &'static str,
    /// The frame, JSON text.
    pub json: String,
}

/// The format notices leave in (src/wire.rs implements it).
pub trait Encode: Send + Sync + std::fmt::Debug {
    /// The frame of `notice`, with its event id when it is durable.
    fn frame(&self, notice: Notice<'_>, event_id: Option<i64>) -> Encoded;
    /// A state alone, as a stored state frame keeps it (the frame is made again from it).
    fn state(&self, state: &ConvState) -> String;
    /// Whether clients see the two states as one (no state frame is sent between them).
    fn same_state(&self, before: &ConvState, after: &ConvState) -> bool;
    /// Background tasks as a client lists them (a `user_request` of kind `tasks`).
    fn tasks(&self, tasks: &[BackgroundTask]) -> Value;
}
