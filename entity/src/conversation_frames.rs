//! The durable frames of a conversation, one row per commit: the frames with event ids
//! `first_event_id..=last_event_id`, as a JSON array of items (`{"m": sequence_id}` for a
//! message's frame, `{"s": state}` for a state frame, `{"f": frame}` for any other). What a
//! reconnecting client replays. A row names its conversation by the conversation's
//! `internal_key`. The replay log's steps of the commit ride on its last row (migration 19:
//! `first_step`, `last_step`, `steps`, packed since migration 21 in `packed_steps`); they
//! are read by raw statements (src/store/steps.rs), not through this model.

use sea_orm::entity::prelude::*;

#[derive(Clone, Debug, PartialEq, DeriveEntityModel)]
#[sea_orm(table_name = "conversation_frames")]
pub struct Model {
    #[sea_orm(primary_key, auto_increment = false)]
    pub conversation_key: i64,
    #[sea_orm(primary_key, auto_increment = false)]
    pub last_event_id: i64,
    pub first_event_id: i64,
    /// The frames' items, JSON text; on a row written since migration 21 (issue 40) they are
    /// in `packed_frames` (src/store/packed.rs), and this is `''` (SQLite) or NULL.
    pub frames: Option<String>,
    /// The frames' items packed (migration 21).
    pub packed_frames: Option<Vec<u8>>,
    /// Makes a client's event idempotent: one frame per key and conversation.
    pub dedup_key: Option<String>,
    /// Milliseconds since the Unix epoch.
    pub created_at: i64,
}

#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
