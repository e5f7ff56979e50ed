//! Several nodes on one Postgres (docs/operations.md, "Scaling"). `nodes` has a row per
//! incarnation of a node (a fresh id per process start) with its address and heartbeat. A
//! conversation's lease is `lease_owner` (the incarnation holding it) and `lease_epoch`. A
//! lease is live while its incarnation's heartbeat is younger than the TTL, so one statement
//! per heartbeat renews all of a node's leases; a node restarted under the same id retires
//! the incarnation before it, whose leases end at once. A dead incarnation's row stays until
//! its conversations with work in flight are taken over and the others released: the
//! takeover pass finds them through it (by `lease_owner`), never by scanning conversations.
//! No index covers the columns a commit updates (state, counters), so those updates stay
//! heap-only (HOT). Taking a lease adds one to
//! the epoch, the fencing token: `bedrock_commit` updates a conversation only while the epoch
//! its commit carries is still current, in the same guarded `UPDATE` as the counters, so a
//! node that lost a lease (paused, partitioned, slow) can never write for that conversation
//! again. (Other nodes' live streams are woken after the commit, not in it: see the
//! cluster's `frames` module.)
//!
//! This migration makes `bedrock_commit` for the tables of m5 and m6 (which dropped the one
//! of m4); the three ship together. SQLite is one node: nothing changes there.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const POSTGRES_UP: &[&str] = &[
    "CREATE TABLE nodes (
        incarnation text PRIMARY KEY,
        id text NOT NULL,
        advertise text NOT NULL,
        started_at timestamptz NOT NULL DEFAULT now(),
        heartbeat_at timestamptz NOT NULL DEFAULT now()
    )",
    "ALTER TABLE conversations ADD COLUMN lease_owner text NULL,
        ADD COLUMN lease_epoch bigint NOT NULL DEFAULT 0",
    "CREATE INDEX conversations_lease_owner ON conversations (lease_owner)
        WHERE lease_owner IS NOT NULL",
    // What the takeover pass looks for besides turns in flight: tasks running.
    "CREATE INDEX background_tasks_running ON background_tasks (conversation_id)
        WHERE status = 'running'",
    COMMIT_FUNCTION,
];

/// The group commit of a batch (see the store's `postgres` module): the guarded updates of
/// its conversations (counters, and the lease's epoch when the commit carries one), its
/// messages with their frames' event ids, its rows of frames. Rows name their conversation
/// by id; the inserts find its key. One UPDATE per conversation, by its primary key: a join
/// with the document's rows was planned for 100 of them (json_to_recordset's estimate) and
/// scanned the whole table.
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
        created_at, frames, dedup_key)
    SELECT k.internal_key, f.last_event_id, f.first_event_id, f.created_at, f.frames, f.dedup_key
    FROM json_to_recordset(doc_frames) AS f(
        conversation_id text, last_event_id bigint, first_event_id bigint, frames json,
        dedup_key text, created_at bigint)
    JOIN conversations k ON k.id = f.conversation_id;
END
$$
"#;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    fn use_transaction(&self) -> Option<bool> {
        Some(true)
    }

    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        crate::run_statements(manager, &[], POSTGRES_UP).await
    }

    async fn down(&self, _manager: &SchemaManager) -> Result<(), DbErr> {
        Err(DbErr::Migration(
            "leases and nodes are not turned back (a cluster needs them)".into(),
        ))
    }
}
