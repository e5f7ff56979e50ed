//! Forks (docs/api.md, "Conversation control"). A fork records where it came from
//! (`forked_from_id`, `forked_from_sequence`); its history is a copy of the source's
//! messages up to that point. Images are not copied: the fork is given a share of each
//! attachment its copied messages show (`attachment_shares`). An attachment still belongs
//! to one conversation; deleting that conversation hands each shared attachment to one of
//! the conversations it is shared with instead of deleting it (the store's
//! `delete_conversation`), so a fork never loses an image it shows.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "ALTER TABLE conversations ADD COLUMN forked_from_id TEXT NULL",
    "ALTER TABLE conversations ADD COLUMN forked_from_sequence INTEGER NULL",
    "CREATE TABLE attachment_shares (
        attachment_id TEXT NOT NULL REFERENCES attachments (id) ON DELETE CASCADE,
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        PRIMARY KEY (attachment_id, conversation_id)
    ) WITHOUT ROWID",
    "CREATE INDEX attachment_shares_conversation ON attachment_shares (conversation_id)",
];

const POSTGRES_UP: &[&str] = &[
    "ALTER TABLE conversations ADD COLUMN forked_from_id text NULL,
        ADD COLUMN forked_from_sequence bigint NULL",
    "CREATE TABLE attachment_shares (
        attachment_id text NOT NULL REFERENCES attachments (id) ON DELETE CASCADE,
        conversation_id text NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        PRIMARY KEY (attachment_id, conversation_id)
    )",
    "CREATE INDEX attachment_shares_conversation ON attachment_shares (conversation_id)",
];

const SQLITE_DOWN: &[&str] = &[
    "DROP TABLE attachment_shares",
    "ALTER TABLE conversations DROP COLUMN forked_from_sequence",
    "ALTER TABLE conversations DROP COLUMN forked_from_id",
];

const POSTGRES_DOWN: &[&str] = &[
    "DROP TABLE attachment_shares",
    "ALTER TABLE conversations DROP COLUMN forked_from_sequence, DROP COLUMN forked_from_id",
];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (SQLITE_DOWN, POSTGRES_DOWN),
}
