//! Each tenant's count of conversations (sub-agents not counted), kept by triggers on
//! `conversations`, so that the `conversations` quota reads one row on every create instead
//! of counting the tenant's conversations (a read that grew with each one: issue 41).

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "CREATE TABLE tenant_conversation_counts (
        tenant_id TEXT PRIMARY KEY NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
        n INTEGER NOT NULL
    ) WITHOUT ROWID",
    "INSERT INTO tenant_conversation_counts (tenant_id, n)
        SELECT tenant_id, COUNT(*) FROM conversations WHERE user_initiated GROUP BY tenant_id",
    "CREATE TRIGGER conversations_counted AFTER INSERT ON conversations
        WHEN NEW.user_initiated
        BEGIN
            INSERT INTO tenant_conversation_counts (tenant_id, n) VALUES (NEW.tenant_id, 1)
                ON CONFLICT (tenant_id) DO UPDATE SET n = n + 1;
        END",
    "CREATE TRIGGER conversations_uncounted AFTER DELETE ON conversations
        WHEN OLD.user_initiated
        BEGIN
            UPDATE tenant_conversation_counts SET n = n - 1 WHERE tenant_id = OLD.tenant_id;
        END",
];

const POSTGRES_UP: &[&str] = &[
    "CREATE TABLE tenant_conversation_counts (
        tenant_id text PRIMARY KEY REFERENCES tenants (id) ON DELETE CASCADE,
        n bigint NOT NULL
    )",
    "INSERT INTO tenant_conversation_counts (tenant_id, n)
        SELECT tenant_id, COUNT(*) FROM conversations WHERE user_initiated GROUP BY tenant_id",
    "CREATE FUNCTION bedrock_count_conversations() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' THEN
            INSERT INTO tenant_conversation_counts (tenant_id, n) VALUES (NEW.tenant_id, 1)
                ON CONFLICT (tenant_id) DO UPDATE SET n = tenant_conversation_counts.n + 1;
            RETURN NEW;
        END IF;
        UPDATE tenant_conversation_counts SET n = n - 1 WHERE tenant_id = OLD.tenant_id;
        RETURN OLD;
    END
    $$",
    "CREATE TRIGGER conversations_counted AFTER INSERT ON conversations
        FOR EACH ROW WHEN (NEW.user_initiated) EXECUTE FUNCTION bedrock_count_conversations()",
    "CREATE TRIGGER conversations_uncounted AFTER DELETE ON conversations
        FOR EACH ROW WHEN (OLD.user_initiated) EXECUTE FUNCTION bedrock_count_conversations()",
];

const SQLITE_DOWN: &[&str] = &[
    "DROP TRIGGER conversations_uncounted",
    "DROP TRIGGER conversations_counted",
    "DROP TABLE tenant_conversation_counts",
];

const POSTGRES_DOWN: &[&str] = &[
    "DROP TRIGGER conversations_uncounted ON conversations",
    "DROP TRIGGER conversations_counted ON conversations",
    "DROP FUNCTION bedrock_count_conversations()",
    "DROP TABLE tenant_conversation_counts",
];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (SQLITE_DOWN, POSTGRES_DOWN),
}
