//! Durable frames stored compactly: one row per commit (`conversation_frames`) instead of
//! one per frame (`conversation_events`). A row holds its frames as a JSON array of items:
//! `{"m": sequence_id}` for a message's frame (the message is in `messages`, not copied),
//! `{"s": state}` for a state frame, `{"f": frame}` for any other frame as it was sent. The
//! frames' event ids run from `first_event_id` to `last_event_id`. `messages.event_id` is the
//! event id of each message's frame, so messages can stand in for frames that retention
//! removed. Existing frames are converted (one row each); the old table is dropped. On
//! Postgres, `bedrock_commit` is dropped here and made again by m7. (The index by age that retention needs is
//! the store's to make, only where retention is configured.)

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "CREATE TABLE conversation_frames (
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        last_event_id INTEGER NOT NULL,
        first_event_id INTEGER NOT NULL,
        frames TEXT NOT NULL,
        dedup_key TEXT,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (conversation_id, last_event_id)
    ) WITHOUT ROWID",
    "CREATE UNIQUE INDEX conversation_frames_dedup ON conversation_frames (conversation_id, dedup_key)
        WHERE dedup_key IS NOT NULL",
    "ALTER TABLE messages ADD COLUMN event_id INTEGER",
    "INSERT INTO conversation_frames
        (conversation_id, last_event_id, first_event_id, frames, dedup_key, created_at)
     SELECT conversation_id, event_id, event_id,
        CASE WHEN event_type = 'message'
                  AND json_extract(payload, '$.message.sequence_id') IS NOT NULL
             THEN json_array(json_object('m', json_extract(payload, '$.message.sequence_id')))
             WHEN event_type = 'state' AND json_extract(payload, '$.state') IS NOT NULL
             THEN json_array(json_object('s', json_extract(payload, '$.state')))
             ELSE json_array(json_object('f', json(payload))) END,
        dedup_key,
        CAST(ROUND((julianday(created_at) - 2440587.5) * 86400000) AS INTEGER)
     FROM conversation_events",
    // Each message's frame, found once through an index rather than searched per message.
    // (A table, not a temporary one: the migration's statements may run on different
    // connections of the pool.)
    "CREATE TABLE migration_message_frames AS
     SELECT conversation_id, json_extract(payload, '$.message.sequence_id') AS sequence_id, event_id
     FROM conversation_events WHERE event_type = 'message'",
    "CREATE INDEX migration_message_frames_key
        ON migration_message_frames (conversation_id, sequence_id)",
    "UPDATE messages SET event_id = (
        SELECT f.event_id FROM migration_message_frames f
        WHERE f.conversation_id = messages.conversation_id AND f.sequence_id = messages.sequence_id)",
    "DROP TABLE migration_message_frames",
    "DROP TABLE conversation_events",
];

const POSTGRES_UP: &[&str] = &[
    "CREATE TABLE conversation_frames (
        conversation_id text NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        last_event_id bigint NOT NULL,
        first_event_id bigint NOT NULL,
        frames json NOT NULL,
        dedup_key text,
        created_at bigint NOT NULL,
        PRIMARY KEY (conversation_id, last_event_id)
    )",
    "CREATE UNIQUE INDEX conversation_frames_dedup ON conversation_frames (conversation_id, dedup_key)
        WHERE dedup_key IS NOT NULL",
    "ALTER TABLE messages ADD COLUMN event_id bigint",
    "INSERT INTO conversation_frames
        (conversation_id, last_event_id, first_event_id, frames, dedup_key, created_at)
     SELECT conversation_id, event_id, event_id,
        CASE WHEN event_type = 'message' AND payload -> 'message' ->> 'sequence_id' IS NOT NULL
             THEN json_build_array(json_build_object('m', (payload -> 'message' ->> 'sequence_id')::bigint))
             WHEN event_type = 'state' AND payload -> 'state' IS NOT NULL
             THEN json_build_array(json_build_object('s', payload -> 'state'))
             ELSE json_build_array(json_build_object('f', payload)) END,
        dedup_key,
        (extract(epoch FROM created_at) * 1000)::bigint
     FROM conversation_events",
    "UPDATE messages m SET event_id = e.event_id FROM conversation_events e
     WHERE e.conversation_id = m.conversation_id AND e.event_type = 'message'
       AND (e.payload -> 'message' ->> 'sequence_id')::bigint = m.sequence_id",
    "DROP TABLE conversation_events",
    // The group commit's function wrote the old table; m7 makes it again for the new rows
    // (m5 to m7 ship together: no server runs between them).
    "DROP FUNCTION IF EXISTS bedrock_commit(json, json, json)",
];

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        crate::run_statements(manager, SQLITE_UP, POSTGRES_UP).await
    }

    async fn down(&self, _manager: &SchemaManager) -> Result<(), DbErr> {
        Err(DbErr::Migration(
            "compact frames cannot be turned back into one row per frame".into(),
        ))
    }
}
