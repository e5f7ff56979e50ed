//! The conversation's state: what it is doing now, and what the current turn has used.
//!
//! Plain data only. Everything here is serialisable because the store keeps the whole state
//! (as JSON) in the conversation's row, in the same transaction as the messages it implies.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The most LLM attempts made for one step of a turn (the first try plus two retries).
pub const MAX_LLM_ATTEMPTS: u32 = 3;

/// Identifies one user turn. Minted outside the core (a UUIDv7 in production) and carried in
/// every event that answers work of that turn, so a late answer for cancelled work is known.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TurnId(pub String);

impl TurnId {
    /// Wraps an id made elsewhere.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }
}

impl std::fmt::Display for TurnId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A tool call the LLM asked for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolUse {
    /// The LLM's id for the call; its tool result must carry the same id.
    pub id: String,
    /// The tool's name, e.g. `bash`.
    pub name: String,
    /// The arguments, already validated as JSON by the gateway.
    pub input: Value,
    /// What the provider sent with the call to have it back with the call (Gemini's thought
    /// signature, its `extra_content`); opaque here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra: Option<Value>,
}

impl ToolUse {
    /// A call with nothing of the provider's to send back.
    pub fn new(id: impl Into<String>, name: impl Into<String>, input: Value) -> Self {
        Self {
            id: id.into(),
            name: name.into(),
            input,
            extra: None,
        }
    }
}

/// The result of a background (long-running) tool, reported after its tool call returned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackgroundResult {
    pub task_id: String,
    pub tool_name: String,
    pub ok: bool,
    pub output: String,
}

impl BackgroundResult {
    /// The text of the system message that carries this result into the LLM's history.
    pub fn system_text(&self) -> String {
        let outcome = if self.ok { "completed" } else { "failed" };
        format!(
            "[[SYSTEM: background task {} ({}) {outcome}]]\n{}",
            self.task_id, self.tool_name, self.output
        )
    }
}

/// An image attached to a user message, already stored as an attachment (REQ-BED-013).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRef {
    pub id: String,
    pub media_type: String,
}

/// A message that arrived while a turn ran: it waits for the turn to end (`if_busy=enqueue`)
/// or for the turn's next LLM request (`if_busy=steer`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Queued {
    /// The id of the turn it starts (of a steering message, its own id).
    pub id: TurnId,
    pub text: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<ImageRef>,
}

/// What one user turn has used so far, and what waits for its next LLM request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Turn {
    pub id: TurnId,
    /// LLM steps started in this turn. Retries of a step do not count as new steps.
    pub llm_steps: u32,
    /// Tool calls accepted in this turn.
    pub tool_calls: u32,
    /// Background results that arrived while the turn was busy, in arrival order. They are
    /// persisted before the next LLM request, or when the turn ends, whichever comes first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<BackgroundResult>,
    /// A sub-agent that ended its turn without submit_result has been reminded once.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reminded: bool,
    /// A sub-agent that reached one of its limits is in its grace turn: one LLM step with
    /// only submit_result offered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace: Option<SubAgentLimit>,
    /// The context passed the continuation threshold (or the user asked to continue): the
    /// turn's next LLM step is the summary request.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub summary_due: bool,
    /// The turn's LLM step in flight is the summary request: no tools, and its answer ends
    /// the conversation in `ContextExhausted`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub summarizing: bool,
    /// Messages that start the next turns, in arrival order, when this one ends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queued: Vec<Queued>,
    /// Messages that join this turn at its next LLM step (stored then, after the tool results
    /// that are due); if it ends first, they start the next turn, before the queued ones.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steering: Vec<Queued>,
}

impl Turn {
    /// A fresh turn with nothing used.
    pub fn new(id: TurnId) -> Self {
        Self {
            id,
            llm_steps: 0,
            tool_calls: 0,
            held: Vec::new(),
            reminded: false,
            grace: None,
            summary_due: false,
            summarizing: false,
            queued: Vec::new(),
            steering: Vec::new(),
        }
    }

    /// How many messages wait in it.
    pub fn waiting(&self) -> usize {
        self.queued.len() + self.steering.len()
    }

    /// The text of the messages that wait in it, in bytes.
    pub fn waiting_bytes(&self) -> u64 {
        self.queued
            .iter()
            .chain(&self.steering)
            .map(|message| message.text.len() as u64)
            .sum()
    }
}

/// A limit of a sub-agent's work; reaching one starts its grace turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "limit", rename_all = "snake_case")]
pub enum SubAgentLimit {
    /// LLM steps of its turn.
    Steps { max_steps: u32 },
    /// Wall time since it started.
    Time { timeout_ms: u64 },
}

impl std::fmt::Display for SubAgentLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubAgentLimit::Steps { max_steps: 1 } => f.write_str("limit of 1 LLM step"),
            SubAgentLimit::Steps { max_steps } => write!(f, "limit of {max_steps} LLM steps"),
            SubAgentLimit::Time { timeout_ms } => {
                write!(f, "time limit of {}", seconds(*timeout_ms))
            }
        }
    }
}

/// `90 s`, `1.5 s`: milliseconds as a person reads them.
fn seconds(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

/// Why an LLM request (or a turn) failed. The names are the contract's `error_kind` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// 401/403: the backend refused the credentials. Not retried.
    Auth,
    /// 429: retried with backoff.
    RateLimit,
    /// 5xx, timeouts, connection resets, truncated streams: retried with backoff.
    Network,
    /// 400: the request itself is wrong. Not retried.
    InvalidRequest,
    /// A bound of the turn or of the gateway was reached. Not retried.
    Limit,
    /// The tenant's or the conversation's token budget is spent: no request was sent. Not
    /// retried (the budget resets with its period, or is raised).
    Budget,
    /// Anything else. Not retried.
    Unknown,
}

impl ErrorKind {
    /// Whether an LLM failure of this kind is worth another attempt.
    pub fn is_retryable(self) -> bool {
        match self {
            ErrorKind::RateLimit | ErrorKind::Network => true,
            ErrorKind::Auth
            | ErrorKind::InvalidRequest
            | ErrorKind::Limit
            | ErrorKind::Budget
            | ErrorKind::Unknown => false,
        }
    }

    /// The contract's snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Auth => "auth",
            ErrorKind::RateLimit => "rate_limit",
            ErrorKind::Network => "network",
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::Limit => "limit",
            ErrorKind::Budget => "budget",
            ErrorKind::Unknown => "unknown",
        }
    }
}

/// One sub-agent of a spawn_sub_agents call, in task order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubAgentSlot {
    pub agent_id: String,
    /// `None` while the sub-agent is still working.
    pub outcome: Option<SubAgentOutcome>,
}

/// What a sub-agent handed back: its submit_result, or a failure entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubAgentOutcome {
    pub success: bool,
    pub result: String,
}

/// Where a conversation is. Busy states carry the [`Turn`] they belong to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ConvState {
    /// Ready for user input; nothing pending.
    Idle,
    /// The user message (or the last tool result) is stored; the next LLM step is due.
    AwaitingLlm { turn: Turn },
    /// An LLM request of this turn's current step is in flight, or waits for its retry.
    LlmRequesting { turn: Turn, attempt: u32 },
    /// Tools run one at a time in the order the LLM asked for them (REQ-BED-004).
    ToolExecuting {
        turn: Turn,
        current: ToolUse,
        remaining: Vec<ToolUse>,
        /// Tool results of this LLM response already stored.
        completed: u32,
    },
    /// The user cancelled an LLM request; waiting for the gateway to confirm the abort.
    Cancelling { turn: Turn },
    /// A spawn_sub_agents call waits for its sub-agents (REQ-BED-008).
    AwaitingSubAgents {
        turn: Turn,
        /// The spawn_sub_agents call; its tool result is the aggregate.
        spawn: ToolUse,
        /// One slot per task, in task order.
        agents: Vec<SubAgentSlot>,
        /// Tool calls of the same LLM response after the spawn call.
        remaining: Vec<ToolUse>,
        completed: u32,
    },
    /// The last turn failed; a new user message recovers (REQ-BED-006).
    Error {
        message: String,
        error_kind: ErrorKind,
    },
    /// A sub-agent that called submit_result. Terminal.
    Completed,
    /// The context filled up and the LLM summarised the conversation: it takes no more
    /// messages and goes on in a new conversation seeded with the summary
    /// (`POST /conversations/{id}/continue`).
    ContextExhausted { summary: String },
}

impl ConvState {
    /// The contract's `kind` name of this state.
    pub fn kind(&self) -> &'static str {
        match self {
            ConvState::Idle => "idle",
            ConvState::AwaitingLlm { .. } => "awaiting_llm",
            ConvState::LlmRequesting { .. } => "llm_requesting",
            ConvState::ToolExecuting { .. } => "tool_executing",
            ConvState::Cancelling { .. } => "cancelling",
            ConvState::AwaitingSubAgents { .. } => "awaiting_sub_agents",
            ConvState::Error { .. } => "error",
            ConvState::Completed => "completed",
            ConvState::ContextExhausted { .. } => "context_exhausted",
        }
    }

    /// The turn in progress, if the conversation is busy.
    pub fn turn(&self) -> Option<&Turn> {
        match self {
            ConvState::AwaitingLlm { turn }
            | ConvState::LlmRequesting { turn, .. }
            | ConvState::ToolExecuting { turn, .. }
            | ConvState::Cancelling { turn }
            | ConvState::AwaitingSubAgents { turn, .. } => Some(turn),
            ConvState::Idle
            | ConvState::Error { .. }
            | ConvState::Completed
            | ConvState::ContextExhausted { .. } => None,
        }
    }

    /// Whether a turn is in progress (a user message would be rejected).
    pub fn is_busy(&self) -> bool {
        self.turn().is_some()
    }

    /// The ids of the sub-agents still working, in task order.
    pub fn pending_agent_ids(&self) -> Vec<&str> {
        match self {
            ConvState::AwaitingSubAgents { agents, .. } => agents
                .iter()
                .filter(|slot| slot.outcome.is_none())
                .map(|slot| slot.agent_id.as_str())
                .collect(),
            ConvState::Idle
            | ConvState::AwaitingLlm { .. }
            | ConvState::LlmRequesting { .. }
            | ConvState::ToolExecuting { .. }
            | ConvState::Cancelling { .. }
            | ConvState::Error { .. }
            | ConvState::Completed
            | ConvState::ContextExhausted { .. } => Vec::new(),
        }
    }
}
