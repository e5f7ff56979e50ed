//! Postgres: `bedrock_commit`, the function a group commit calls to write a whole batch in
//! one statement (see the store's `postgres` module). A guarded update that finds its
//! conversation gone or its counters moved raises SQLSTATE `BR409`, and the whole statement,
//! the inserts included, is undone. SQLite writes its batches another way and gets nothing
//! here.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const CREATE: &str = r#"
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
        client_message_id, created_at)
    SELECT * FROM json_to_recordset(doc_messages) AS m(
        id text, conversation_id text, sequence_id bigint, message_type text, content json,
        usage_data json, client_message_id text, created_at timestamptz);
    INSERT INTO conversation_events (conversation_id, event_id, event_type, payload, dedup_key,
        created_at)
    SELECT * FROM json_to_recordset(doc_frames) AS e(
        conversation_id text, event_id bigint, event_type text, payload json, dedup_key text,
        created_at timestamptz);
END
$$
"#;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() == sea_orm::DbBackend::Postgres {
            manager.get_connection().execute_unprepared(CREATE).await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() == sea_orm::DbBackend::Postgres {
            manager
                .get_connection()
                .execute_unprepared("DROP FUNCTION IF EXISTS bedrock_commit(json, json, json)")
                .await?;
        }
        Ok(())
    }
}
