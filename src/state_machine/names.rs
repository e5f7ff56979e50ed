//! The tools the core knows by name and settles itself.

/// Name of the tool that fans work out to sub-agents (user conversations only).
pub const SPAWN_SUB_AGENTS: &str = "spawn_sub_agents";
/// Name of the tool with which a sub-agent hands back its result (sub-agents only).
pub const SUBMIT_RESULT: &str = "submit_result";
