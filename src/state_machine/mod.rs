//! The pure core: every decision about a conversation, with no I/O.
//!
//! `transition(&state, &ctx, event)` returns the next state and the effects the runtime must
//! carry out. This module must not import tokio, ractor, axum, sea-orm, async-openai or
//! reqwest, read a clock or make ids: time and fresh ids come in through events and the
//! context (`boundary_the_core_imports_no_io_crate` in tests/it/architecture.rs checks the
//! imports). Everything in the seeds' transition matrix is a unit test in `tests`, the
//! invariants are properties in `properties`.

mod chain;
mod context;
mod effect;
mod event;
mod message;
mod names;
mod permissions;
mod plan;
mod state;
mod transition;

#[cfg(test)]
mod properties;
/// The model of the runtime the properties (and the fuzz target `transition`) drive.
#[cfg(any(test, feature = "sim"))]
#[doc(hidden)]
pub mod sim;
#[cfg(test)]
mod tests;

pub use chain::{ChainError, fork_points, is_fork_point, last_fork_point, validate_chain};
pub use context::{ConvContext, TurnLimits};
pub use effect::{Effect, SubAgentTask};
pub use event::{
    Event, IfBusy, Interruption, LlmFailure, LlmReply, LlmRequestTag, ToolOutcome, Usage,
};
pub use message::{ImageRef, MessageContent, MessageType, Reasoning, ToolResult};
pub use permissions::{Permission, PermissionAction, PermissionRule, decide as decide_permission};
pub use plan::{
    ASK_USER, Question, QuestionKind, ToolAction, ToolPlan, WORKSPACE_TOOLS, plan as plan_tool,
};
pub use state::{
    BackgroundResult, ConvState, ErrorKind, MAX_LLM_ATTEMPTS, Queued, SubAgentLimit,
    SubAgentOutcome, SubAgentSlot, ToolUse, Turn, TurnId,
};
pub use transition::{
    CANCELLED_BY_USER, GRACE_SKIPPED, InvalidTransition, RETRY_AFTER_CAP_MS, RETRY_BASE_DELAY_MS,
    RETRY_DELAY_CAP_MS, Rejection, SKIPPED_BY_CANCEL, SPAWN_SUB_AGENTS, SUBMIT_REMINDER,
    SUBMIT_RESULT, SUMMARY_REQUEST, TransitionResult, TurnEnd, TurnOutcome, retry_delay_ms,
    transition,
};
