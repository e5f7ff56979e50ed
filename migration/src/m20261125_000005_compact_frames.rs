//! Durable frames stored compactly: one row per commit (`conversation_frames`) instead of
//! one per frame (`conversation_events`). A row holds its frames as a JSON array of items:
//! `{"m": sequence_id}` for a message's frame (the message is in `messages`, not copied),
//! `{"s": state}` for a state frame, `{"f": frame}` for any other frame as it was sent. The
//! frames' event ids run from `first_event_id` to `last_event_id`. `messages.event_id` is the
//! event id of each message's frame, so messages can stand in for frames that retention
//! removed. Existing frames are converted (one row each); the old table is dropped. On
//! Postgres, `bedrock_commit` writes the new rows. (The index by age that retention needs is
//! the store's to make, only where retention is configured.)

use sea_orm::DbBackend;
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
    COMMIT_FUNCTION,
];

/// The group commit of a batch (see the store's `postgres` module): the guarded updates of
/// its conversations, its messages with their frames' event ids, its rows of frames.
const COMMIT_FUNCTION: &str = r#"
CREATE OR REPLACE FUNCTION bedrock_commit(doc_conversations json, doc_messages json, doc_frames json)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    c record;
BEGIN
    -- One UPDATE per conversation, by its primary key: a join with the document's rows was
    -- planned for 100 of them (json_to_recordset's estimate) and scanned the whole table.
    FOR c IN SELECT * FROM json_to_recordset(doc_conversations) AS v(
        id text, exp_seq bigint, exp_evt bigint, next_seq bigint, next_evt bigint,
        updated_at timestamptz, state text, state_data json, state_at timestamptz,
        input_tokens bigint, output_tokens bigint, context_tokens bigint)
    LOOP
        UPDATE conversations SET
            next_sequence_id = c.next_seq, next_event_id = c.next_evt, updated_at = c.updated_at,
            state = COALESCE(c.state, conversations.state),
            state_data = COALESCE(c.state_data, conversations.state_data),
            state_updated_at = COALESCE(c.state_at, conversations.state_updated_at),
            input_tokens = COALESCE(c.input_tokens, conversations.input_tokens),
            output_tokens = COALESCE(c.output_tokens, conversations.output_tokens),
            context_tokens = COALESCE(c.context_tokens, conversations.context_tokens)
        WHERE conversations.id = c.id
            AND conversations.next_sequence_id = c.exp_seq
            AND conversations.next_event_id = c.exp_evt;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'conversation % was deleted or changed by another writer', c.id
                USING ERRCODE = 'BR409';
        END IF;
    END LOOP;
    INSERT INTO messages (id, conversation_id, sequence_id, message_type, content, usage_data,
        client_message_id, created_at, event_id)
    SELECT * FROM json_to_recordset(doc_messages) AS m(
        id text, conversation_id text, sequence_id bigint, message_type text, content json,
        usage_data json, client_message_id text, created_at timestamptz, event_id bigint);
    INSERT INTO conversation_frames (conversation_id, last_event_id, first_event_id, frames,
        dedup_key, created_at)
    SELECT * FROM json_to_recordset(doc_frames) AS f(
        conversation_id text, last_event_id bigint, first_event_id bigint, frames json,
        dedup_key text, created_at bigint);
END
$$
"#;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let backend = manager.get_database_backend();
        let statements = if backend == DbBackend::Sqlite {
            SQLITE_UP
        } else if backend == DbBackend::Postgres {
            POSTGRES_UP
        } else {
            return Err(DbErr::Migration(format!(
                "Bedrock runs on SQLite or Postgres, not {backend:?}"
            )));
        };
        let connection = manager.get_connection();
        for statement in statements {
            connection.execute_unprepared(statement).await?;
        }
        Ok(())
    }

    async fn down(&self, _manager: &SchemaManager) -> Result<(), DbErr> {
        Err(DbErr::Migration(
            "compact frames cannot be turned back into one row per frame".into(),
        ))
    }
}
