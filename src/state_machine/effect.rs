//! What a transition asks the outside world to do, as a closed enum of plain data.
//!
//! The runtime stores the new state together with every `PersistMessage`, `RecordUsage`,
//! `NotifyRetrying` and `WarnContext` of a transition in one transaction, and dispatches the
//! other effects only after that commit (REQ-BED-007).

use serde::Serialize;

use super::event::{LlmRequestTag, Usage};
use super::message::MessageContent;
use super::plan::ToolPlan;
use super::state::{ErrorKind, SubAgentOutcome, ToolUse, TurnId};

/// One task of a spawn_sub_agents call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SubAgentTask {
    pub prompt: String,
    /// `None`: the parent's model.
    pub model: Option<String>,
    /// LLM steps before the grace turn: the task's `max_steps` within the configured bound.
    pub max_steps: u32,
    /// Wall time before the grace turn: the task's `timeout_ms` within the configured bound.
    pub timeout_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Effect {
    /// Append a message to the history (durable, in the transition's transaction).
    PersistMessage(MessageContent),
    /// Add an LLM response's token counts to the conversation's totals (durable).
    RecordUsage { usage: Usage },
    /// Tell clients a retry is scheduled (durable `retrying` frame).
    NotifyRetrying {
        attempt: u32,
        delay_ms: u64,
        error_kind: ErrorKind,
    },
    /// Tell clients the context crossed a warning threshold (durable `context_warning` frame).
    WarnContext {
        context_tokens: u64,
        context_window: u64,
        ratio: f64,
    },
    /// Feed `Event::Continue { turn }` back to this conversation once this transition is stored.
    Continue { turn: TurnId },
    /// Send the history to the LLM. The answer comes back tagged with `request`.
    RequestLlm {
        request: LlmRequestTag,
        model: String,
        /// A sub-agent's grace turn: submit_result is the only tool offered.
        only_submit: bool,
        /// The summary request: no tools are offered.
        summary: bool,
    },
    /// Abort the request (or its pending retry) at once; the gateway answers `LlmAborted`.
    AbortLlm { request: LlmRequestTag },
    /// Deliver `RetryTimeout { request }` after `delay_ms`.
    ScheduleRetry {
        request: LlmRequestTag,
        delay_ms: u64,
    },
    /// Run one tool in the conversation's cwd as `plan` says; it answers `ToolComplete`.
    ExecuteTool {
        turn: TurnId,
        tool: ToolUse,
        plan: ToolPlan,
    },
    /// Stop the running tool (its whole process group, or the spawn in progress).
    CancelTool { turn: TurnId, tool_use_id: String },
    /// Start one sub-agent per task; the runtime answers `SubAgentsSpawned`.
    SpawnSubAgents {
        turn: TurnId,
        tool_use_id: String,
        tasks: Vec<SubAgentTask>,
    },
    /// Stop these sub-agents (the parent was cancelled).
    StopSubAgents { agent_ids: Vec<String> },
    /// A sub-agent hands its outcome to its parent.
    ReportToParent { outcome: SubAgentOutcome },
    /// A sub-agent's grace turn began: the runtime bounds it by `[sub_agents] grace_ms` and
    /// then delivers `TimeLimit`, which fails it.
    GraceTurnStarted,
}

impl Effect {
    /// Whether the effect is part of the transition's transaction rather than dispatched
    /// after it.
    pub fn is_durable(&self) -> bool {
        match self {
            Effect::PersistMessage(_)
            | Effect::RecordUsage { .. }
            | Effect::NotifyRetrying { .. }
            | Effect::WarnContext { .. } => true,
            Effect::Continue { .. }
            | Effect::RequestLlm { .. }
            | Effect::AbortLlm { .. }
            | Effect::ScheduleRetry { .. }
            | Effect::ExecuteTool { .. }
            | Effect::CancelTool { .. }
            | Effect::SpawnSubAgents { .. }
            | Effect::StopSubAgents { .. }
            | Effect::ReportToParent { .. }
            | Effect::GraceTurnStarted => false,
        }
    }
}
