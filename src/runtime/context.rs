//! The core's view of a conversation's settings, made from the node's configuration and the
//! conversation's row.

use crate::model::ConversationRecord;
use crate::state_machine::ConvContext;

use crate::config::Settings;

/// The core's view of the conversation's settings.
pub fn context(settings: &Settings, record: &ConversationRecord) -> ConvContext {
    let model = settings.model(&record.model);
    ConvContext {
        conversation_id: record.id.clone(),
        working_dir: record.cwd.clone().into(),
        model_id: record.model.clone(),
        is_sub_agent: record.parent_id.is_some(),
        limits: bounded(settings.turn_limits(), &record.bounds),
        context_window: model.context_window,
        context_tokens: record.usage.context_tokens,
        continuation_permille: (model.continuation_threshold * 1000.0).round() as u32,
        require_approval: record.require_approval.clone(),
        mcp_tools: record.mcp_tools.iter().map(|t| t.name.clone()).collect(),
        tools: record.tools.clone(),
        permissions: record.permissions.clone(),
        client_tools: record.client_tools.iter().map(|t| t.name.clone()).collect(),
    }
}

/// The node's turn limits, lowered where the conversation's agent bounds them lower.
fn bounded(
    mut limits: crate::state_machine::TurnLimits,
    bounds: &crate::model::Bounds,
) -> crate::state_machine::TurnLimits {
    if let Some(turn) = &bounds.limits {
        if let Some(steps) = turn.max_llm_steps {
            limits.max_llm_steps = limits.max_llm_steps.min(steps);
        }
        if let Some(calls) = turn.max_tool_calls {
            limits.max_tool_calls = limits.max_tool_calls.min(calls);
        }
    }
    if let Some(sub) = &bounds.sub_agents {
        if let Some(tasks) = sub.max_tasks {
            limits.max_sub_agents = limits.max_sub_agents.min(tasks);
        }
        if let Some(steps) = sub.max_steps {
            limits.sub_agent_max_steps = limits.sub_agent_max_steps.min(steps);
        }
        if let Some(ms) = sub.timeout_ms {
            limits.sub_agent_timeout_ms = limits.sub_agent_timeout_ms.min(ms);
        }
    }
    limits
}
