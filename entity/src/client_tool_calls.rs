//! Calls of a conversation's client tools, each answered once by its client.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "client_tool_calls")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub conversation_id: String,
    /// The LLM's id of the call; its tool result carries it.
    pub tool_use_id: String,
    /// The call's turn, LLM step and tool_use id: one call per key.
    pub call_key: String,
    pub name: String,
    /// The call's input, JSON text.
    pub input: String,
    /// `pending`, `answered`, `expired` or `cancelled`.
    pub status: String,
    pub output: Option<String>,
    pub is_error: Option<bool>,
    pub timeout_ms: i64,
    /// RFC 3339.
    pub expires_at: String,
    pub created_at: String,
    pub resolved_at: Option<String>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
