//! Everything that can happen to a conversation, as plain data.
//!
//! Events that answer earlier work carry the tag of that work (the turn, and for the LLM the
//! step and attempt), so an answer that arrives after a cancel is recognised and ignored.

use serde::{Deserialize, Serialize};

use super::message::ImageRef;
use super::state::{BackgroundResult, ErrorKind, SubAgentOutcome, ToolUse, TurnId};

/// Names one LLM request: its turn, the step within the turn (from 1) and the attempt (1..=3).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LlmRequestTag {
    pub turn: TurnId,
    pub step: u32,
    pub attempt: u32,
}

/// Token counts of one LLM response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl Usage {
    /// What the conversation occupies of the context window after this response.
    pub fn context_tokens(self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }
}

/// A completed LLM response.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LlmReply {
    pub text: Option<String>,
    /// Tool calls in the order the LLM gave them.
    pub tool_uses: Vec<ToolUse>,
    /// False when the model stopped before it was done (e.g. it hit its output limit).
    pub end_turn: bool,
    pub usage: Usage,
    /// The model's thinking, when the backend streamed it.
    pub reasoning: Option<super::Reasoning>,
}

/// A failed LLM request, classified by the gateway.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LlmFailure {
    pub kind: ErrorKind,
    pub message: String,
    /// The backend's Retry-After, when it sent one.
    pub retry_after_ms: Option<u64>,
}

/// What a finished tool run reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolOutcome {
    pub ok: bool,
    pub output: String,
}

impl ToolOutcome {
    /// A failed run whose result is `output` (the reason).
    pub fn failed(output: impl Into<String>) -> ToolOutcome {
        ToolOutcome {
            ok: false,
            output: output.into(),
        }
    }
}

/// Why work in flight was cut off without a cancel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Interruption {
    /// The process died; found at the next start (REQ-BED-007).
    Restart,
    /// The server is shutting down gracefully.
    Shutdown,
}

impl Interruption {
    /// The output of the synthetic tool results it leaves behind.
    pub fn tool_output(self) -> &'static str {
        match self {
            Interruption::Restart => "interrupted by server restart",
            Interruption::Shutdown => "interrupted by server shutdown",
        }
    }
}

/// What a user message does when a turn is running.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IfBusy {
    /// Refused with `agent_busy` (the seeds' rule).
    #[default]
    Reject,
    /// The running turn is cancelled as by a cancel and the message starts the next turn, in
    /// one step. `running` is the turn the sender saw running when it sent (`None`: none):
    /// of concurrent interrupting sends, which all saw the same turn, only the first finds
    /// it still running; the others are refused with `agent_busy`.
    Interrupt { running: Option<TurnId> },
    /// The message waits for the running turn to end and starts the next one, in arrival
    /// order (a conversation at rest takes it at once).
    Enqueue,
    /// The message joins the running turn: stored at its next LLM step, after the tool
    /// results that are due, without stopping what runs (at rest: a plain send).
    Steer,
}

/// An input to [`transition`](super::transition). Serialisable: the replay log keeps every
/// event a conversation's core received (src/replay).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// REQ-BED-002/013. `turn` is the id the new turn gets if the message is accepted.
    UserMessage {
        turn: TurnId,
        text: String,
        images: Vec<ImageRef>,
        if_busy: IfBusy,
    },
    /// REQ-BED-005.
    UserCancel,
    /// The user asked to continue in a new conversation (`POST .../continue`) while idle:
    /// the summary is asked for first. `turn` is the id of the turn that asks.
    SummaryRequested { turn: TurnId },
    /// The runtime's follow-up to [`Effect::Continue`](super::Effect::Continue): start the
    /// next LLM step of `turn`.
    Continue { turn: TurnId },
    LlmResponse {
        request: LlmRequestTag,
        reply: LlmReply,
    },
    LlmError {
        request: LlmRequestTag,
        error: LlmFailure,
    },
    /// The gateway confirms that an aborted request is gone (after `AbortLlm`).
    LlmAborted { request: LlmRequestTag },
    /// The backoff timer of a retry fired.
    RetryTimeout { request: LlmRequestTag },
    ToolComplete {
        turn: TurnId,
        tool_use_id: String,
        outcome: ToolOutcome,
    },
    /// The runtime created the sub-agents of a spawn_sub_agents call, one id per task.
    SubAgentsSpawned {
        turn: TurnId,
        tool_use_id: String,
        agent_ids: Vec<String>,
    },
    /// A sub-agent finished: its submit_result, or a failure entry (crash, error, timeout).
    SubAgentResult {
        agent_id: String,
        outcome: SubAgentOutcome,
    },
    /// A background task finished. With `wake`, an idle conversation starts a new turn with
    /// that id so the LLM can act on the result.
    BackgroundResult {
        result: BackgroundResult,
        wake: Option<TurnId>,
    },
    /// Work in flight was cut off by a restart or a shutdown.
    Interrupted(Interruption),
    /// A sub-agent's wall-time limit passed: the first time it starts the grace turn, in
    /// the grace turn it ends the sub-agent as failed.
    TimeLimit { timeout_ms: u64 },
    /// The user takes back a waiting message (`None`: every one).
    Dequeue { id: Option<TurnId> },
}

impl Event {
    /// A short name for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Event::UserMessage { .. } => "user_message",
            Event::UserCancel => "user_cancel",
            Event::SummaryRequested { .. } => "summary_requested",
            Event::Continue { .. } => "continue",
            Event::LlmResponse { .. } => "llm_response",
            Event::LlmError { .. } => "llm_error",
            Event::LlmAborted { .. } => "llm_aborted",
            Event::RetryTimeout { .. } => "retry_timeout",
            Event::ToolComplete { .. } => "tool_complete",
            Event::SubAgentsSpawned { .. } => "sub_agents_spawned",
            Event::SubAgentResult { .. } => "sub_agent_result",
            Event::BackgroundResult { .. } => "background_result",
            Event::Interrupted(_) => "interrupted",
            Event::TimeLimit { .. } => "time_limit",
            Event::Dequeue { .. } => "dequeue",
        }
    }
}
