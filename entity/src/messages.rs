//! The messages of a conversation, numbered by `sequence_id` from 1 with no gaps. A message
//! names its conversation by the conversation's `internal_key` (a small integer), and is
//! keyed by it and its sequence id.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "messages")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub conversation_key: i64,
    #[sea_orm(primary_key, auto_increment = false)]
    pub sequence_id: i64,
    pub id: String,
    /// `user`, `agent`, `tool`, `system` or `error`.
    pub message_type: String,
    pub content: Json,
    pub usage_data: Option<Json>,
    /// The client's idempotency key of a user message.
    pub client_message_id: Option<String>,
    pub created_at: DateTimeUtc,
    /// The event id of the message's frame (none for messages stored before frames
    /// referred to them and never framed).
    pub event_id: Option<i64>,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
