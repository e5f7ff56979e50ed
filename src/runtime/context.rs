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
        limits: settings.turn_limits(),
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
