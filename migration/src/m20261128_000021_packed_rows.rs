//! Packed rows (issue 40): a row of frames keeps its frames, and the replay log's steps on
//! it or on a row of `conversation_steps`, as zstd compressed with a shared dictionary
//! (src/store/packed.rs) in the new `packed_frames` and `packed_steps` columns, not as JSON
//! text. Rows written before keep their text and read as they did. Postgres's text columns
//! may now be NULL (a packed row leaves them so); SQLite's `NOT NULL` ones get `''` on a
//! packed row (a table rebuild to drop the constraint would copy every row). On Postgres
//! `bedrock_commit` takes the packed columns, base64 in its JSON document.
//!
//! Down: the packed rows are deleted (frames and steps are kept for a retention window;
//! SQL cannot unpack them), then the columns.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "ALTER TABLE conversation_frames ADD COLUMN packed_frames BLOB",
    "ALTER TABLE conversation_frames ADD COLUMN packed_steps BLOB",
    "ALTER TABLE conversation_steps ADD COLUMN packed_steps BLOB",
];

const POSTGRES_UP: &[&str] = &[
    "ALTER TABLE conversation_frames ALTER COLUMN frames DROP NOT NULL,
        ADD COLUMN packed_frames bytea, ADD COLUMN packed_steps bytea",
    "ALTER TABLE conversation_steps ALTER COLUMN steps DROP NOT NULL,
        ADD COLUMN packed_steps bytea",
    COMMIT_FUNCTION,
];

/// `bedrock_commit` of m19 with the packed columns.
const COMMIT_FUNCTION: &str = r#"
CREATE OR REPLACE FUNCTION bedrock_commit(doc_conversations json, doc_messages json, doc_frames json)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    c record;
BEGIN
    FOR c IN SELECT * FROM json_to_recordset(doc_conversations) AS v(
        id text, exp_seq bigint, exp_evt bigint, next_seq bigint, next_evt bigint,
        updated_at timestamptz, state text, state_data json, state_at timestamptz,
        input_tokens bigint, output_tokens bigint, context_tokens bigint, epoch bigint)
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
            AND conversations.next_event_id = c.exp_evt
            AND (c.epoch IS NULL OR conversations.lease_epoch = c.epoch);
        IF NOT FOUND THEN
            RAISE EXCEPTION 'conversation % was deleted, changed by another writer, or its lease moved', c.id
                USING ERRCODE = 'BR409';
        END IF;
    END LOOP;
    INSERT INTO messages (conversation_key, sequence_id, event_id, created_at, id,
        message_type, content, usage_data, client_message_id)
    SELECT k.internal_key, m.sequence_id, m.event_id, m.created_at, m.id, m.message_type,
        m.content, m.usage_data, m.client_message_id
    FROM json_to_recordset(doc_messages) AS m(
        id text, conversation_id text, sequence_id bigint, message_type text, content json,
        usage_data json, client_message_id text, created_at timestamptz, event_id bigint)
    JOIN conversations k ON k.id = m.conversation_id;
    INSERT INTO conversation_frames (conversation_key, last_event_id, first_event_id,
        created_at, frames, dedup_key, first_step, last_step, steps, packed_frames, packed_steps)
    SELECT k.internal_key, f.last_event_id, f.first_event_id, f.created_at, f.frames, f.dedup_key,
        f.first_step, f.last_step, f.steps, decode(f.packed_frames, 'base64'),
        decode(f.packed_steps, 'base64')
    FROM json_to_recordset(doc_frames) AS f(
        conversation_id text, last_event_id bigint, first_event_id bigint, frames json,
        dedup_key text, created_at bigint, first_step bigint, last_step bigint, steps text,
        packed_frames text, packed_steps text)
    JOIN conversations k ON k.id = f.conversation_id;
END
$$
"#;

const SQLITE_DOWN: &[&str] = &[
    "DELETE FROM conversation_frames WHERE packed_frames IS NOT NULL",
    "DELETE FROM conversation_steps WHERE packed_steps IS NOT NULL",
    "ALTER TABLE conversation_steps DROP COLUMN packed_steps",
    "ALTER TABLE conversation_frames DROP COLUMN packed_steps",
    "ALTER TABLE conversation_frames DROP COLUMN packed_frames",
];

const POSTGRES_DOWN: &[&str] = &[
    crate::m20261128_000019_conversation_steps::COMMIT_FUNCTION,
    "DELETE FROM conversation_frames WHERE packed_frames IS NOT NULL",
    "DELETE FROM conversation_steps WHERE packed_steps IS NOT NULL",
    "ALTER TABLE conversation_steps DROP COLUMN packed_steps, ALTER COLUMN steps SET NOT NULL",
    "ALTER TABLE conversation_frames DROP COLUMN packed_steps, DROP COLUMN packed_frames,
        ALTER COLUMN frames SET NOT NULL",
];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (SQLITE_DOWN, POSTGRES_DOWN),
}
