//! Requests from the server to a client (confirm, prompt, select, custom) and approvals.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "client_requests")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub id: String,
    pub conversation_id: String,
    pub tool_use_id: Option<String>,
    /// The contract's `request_type` object.
    pub request_type: Json,
    /// `pending`, `answered`, `expired` or `cancelled`.
    pub status: String,
    pub response: Option<Json>,
    pub timeout_ms: i64,
    pub expires_at: DateTimeUtc,
    pub created_at: DateTimeUtc,
    pub resolved_at: Option<DateTimeUtc>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
