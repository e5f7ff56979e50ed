//! The replay log (issue 40): every event a conversation's core received, with the context
//! it saw, written in the commit of the transition it caused. One row per commit that has
//! steps, like `conversation_frames`: its steps (a JSON array, src/replay) numbered
//! `first_step..=last_step` in their conversation. Conversations older than this migration
//! start their log at their next step. Removed with their conversation, and by the frames'
//! retention window (`[events] retain`).

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &["CREATE TABLE conversation_steps (
        conversation_key INTEGER NOT NULL
            REFERENCES conversations (internal_key) ON DELETE CASCADE,
        last_step INTEGER NOT NULL,
        first_step INTEGER NOT NULL,
        steps TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (conversation_key, last_step)
    ) WITHOUT ROWID"];

const POSTGRES_UP: &[&str] = &["CREATE TABLE conversation_steps (
        conversation_key bigint NOT NULL
            REFERENCES conversations (internal_key) ON DELETE CASCADE,
        last_step bigint NOT NULL,
        first_step bigint NOT NULL,
        steps text NOT NULL,
        created_at bigint NOT NULL,
        PRIMARY KEY (conversation_key, last_step)
    )"];

const DOWN: &[&str] = &["DROP TABLE conversation_steps"];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (DOWN, DOWN),
}
