//! What the core knows about a conversation besides its state: its fixed settings and limits.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Bounds of one user turn (desi-gateway-design.md: bounded runs). Exceeding one ends the
/// turn in `Error { error_kind: Limit }` with the message chain still valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TurnLimits {
    /// LLM steps (requests, not counting retries) per user turn. A sub-agent's is its
    /// `max_steps`; reaching it starts its grace turn instead of failing.
    pub max_llm_steps: u32,
    /// Tool calls per user turn.
    pub max_tool_calls: u32,
    /// Tasks in one spawn_sub_agents call.
    pub max_sub_agents: u32,
    /// A sub-agent's LLM steps: the default and the most a task may ask for.
    pub sub_agent_max_steps: u32,
    /// A sub-agent's wall time in ms: the default and the most a task may ask for.
    pub sub_agent_timeout_ms: u64,
    /// Messages that may wait in a busy conversation (queued and steering together).
    pub max_queued: u32,
    /// Their text in bytes, all together.
    pub max_queued_bytes: u64,
}

impl Default for TurnLimits {
    fn default() -> Self {
        Self {
            max_llm_steps: 50,
            max_tool_calls: 200,
            max_sub_agents: 8,
            sub_agent_max_steps: 30,
            sub_agent_timeout_ms: 600_000,
            max_queued: 100,
            max_queued_bytes: 262_144,
        }
    }
}

/// The conversation's settings, handed to every transition by the runtime.
/// Kept in the replay log (src/replay): a field added later reads as its default from a log
/// written before it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConvContext {
    pub conversation_id: String,
    /// REQ-BED-010: fixed at creation; every tool starts here.
    pub working_dir: PathBuf,
    pub model_id: String,
    /// REQ-BED-009: sub-agents get submit_result and never spawn_sub_agents.
    pub is_sub_agent: bool,
    pub limits: TurnLimits,
    /// The model's context window in tokens (0 when unknown: no warnings).
    pub context_window: u64,
    /// Tokens the conversation occupied after the last LLM response (REQ-BED-012).
    pub context_tokens: u64,
    /// Per mille of the window at which the conversation is summarised and continued
    /// elsewhere (`continuation_threshold`; 0: never).
    pub continuation_permille: u32,
    /// The tools the client approves before each run (the conversation's `require_approval`).
    pub require_approval: Vec<String>,
    /// The names of the conversation's tools of its tenant's MCP servers.
    pub mcp_tools: Vec<String>,
    /// The built-in tools it may use (its agent's `tools`; `None`: all of them). A call of
    /// any other is refused without running.
    pub tools: Option<Vec<String>>,
    /// Its agent's permission rules, in order (`permissions.rs`).
    pub permissions: Vec<super::permissions::PermissionRule>,
    /// The names of the tools its client runs: a call of one waits for the client's answer,
    /// and a restart keeps it waiting.
    pub client_tools: Vec<String>,
}

impl ConvContext {
    /// Whether the conversation may call `name`: one of its MCP or client tools, a built-in
    /// tool its agent allows, or (a sub-agent's) submit_result, which ends its task.
    pub fn offers(&self, name: &str) -> bool {
        self.mcp_tools.iter().any(|tool| tool == name)
            || self.is_client_tool(name)
            || (self.is_sub_agent && name == super::names::SUBMIT_RESULT)
            || self
                .tools
                .as_ref()
                .is_none_or(|tools| tools.iter().any(|tool| tool == name))
    }

    /// Whether `name` is one of the tools its client runs.
    pub fn is_client_tool(&self, name: &str) -> bool {
        self.client_tools.iter().any(|tool| tool == name)
    }
}
