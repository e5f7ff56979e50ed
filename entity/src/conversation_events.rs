//! The durable frames of a conversation, numbered by `event_id` from 1 with no gaps: what a
//! reconnecting client replays.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "conversation_events")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub conversation_id: String,
    #[sea_orm(primary_key, auto_increment = false)]
    pub event_id: i64,
    pub event_type: String,
    /// The whole frame, as sent to clients.
    pub payload: Json,
    /// Makes a client's event idempotent: one frame per key and conversation.
    pub dedup_key: Option<String>,
    pub created_at: DateTimeUtc,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
