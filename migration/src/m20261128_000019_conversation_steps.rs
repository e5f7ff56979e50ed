//! The replay log (issue 40): every event a conversation's core received, with the context
//! it saw, written in the commit of the transition it caused (src/replay). A commit's steps
//! (a JSON array, numbered `first_step..=last_step` in their conversation) ride on its last
//! row of `conversation_frames`, three columns more in a row the commit writes anyway; the
//! steps of a commit without frames get a row of `conversation_steps`, keyed like a row of
//! frames. Conversations older than this migration start their log at their next step. The
//! steps go with their conversation and with the frames' retention window (`[events]
//! retain`). On Postgres `bedrock_commit` writes the new columns (m7's function otherwise).

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "ALTER TABLE conversation_frames ADD COLUMN first_step INTEGER",
    "ALTER TABLE conversation_frames ADD COLUMN last_step INTEGER",
    "ALTER TABLE conversation_frames ADD COLUMN steps TEXT",
    "CREATE TABLE conversation_steps (
        conversation_key INTEGER NOT NULL
            REFERENCES conversations (internal_key) ON DELETE CASCADE,
        last_step INTEGER NOT NULL,
        first_step INTEGER NOT NULL,
        steps TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (conversation_key, last_step)
    ) WITHOUT ROWID",
];

const POSTGRES_UP: &[&str] = &[
    "ALTER TABLE conversation_frames ADD COLUMN first_step bigint,
        ADD COLUMN last_step bigint, ADD COLUMN steps text",
    "CREATE TABLE conversation_steps (
        conversation_key bigint NOT NULL
            REFERENCES conversations (internal_key) ON DELETE CASCADE,
        last_step bigint NOT NULL,
        first_step bigint NOT NULL,
        steps text NOT NULL,
        created_at bigint NOT NULL,
        PRIMARY KEY (conversation_key, last_step)
    )",
    COMMIT_FUNCTION,
];

/// `bedrock_commit` of m7 with the frames' step columns.
pub(crate) const COMMIT_FUNCTION: &str = r#"
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
        created_at, frames, dedup_key, first_step, last_step, steps)
    SELECT k.internal_key, f.last_event_id, f.first_event_id, f.created_at, f.frames, f.dedup_key,
        f.first_step, f.last_step, f.steps
    FROM json_to_recordset(doc_frames) AS f(
        conversation_id text, last_event_id bigint, first_event_id bigint, frames json,
        dedup_key text, created_at bigint, first_step bigint, last_step bigint, steps text)
    JOIN conversations k ON k.id = f.conversation_id;
END
$$
"#;

const SQLITE_DOWN: &[&str] = &[
    "DROP TABLE conversation_steps",
    "ALTER TABLE conversation_frames DROP COLUMN steps",
    "ALTER TABLE conversation_frames DROP COLUMN last_step",
    "ALTER TABLE conversation_frames DROP COLUMN first_step",
];

const POSTGRES_DOWN: &[&str] = &[
    crate::m20261125_000007_cluster::COMMIT_FUNCTION,
    "DROP TABLE conversation_steps",
    "ALTER TABLE conversation_frames DROP COLUMN steps, DROP COLUMN last_step,
        DROP COLUMN first_step",
];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (SQLITE_DOWN, POSTGRES_DOWN),
}
