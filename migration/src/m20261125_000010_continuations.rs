//! Context continuation (docs/api.md, "Context continuation"): a conversation started from
//! another's summary records where it came from.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &["ALTER TABLE conversations ADD COLUMN continued_from_id TEXT NULL"];
const POSTGRES_UP: &[&str] = &["ALTER TABLE conversations ADD COLUMN continued_from_id text NULL"];
const DOWN: &[&str] = &["ALTER TABLE conversations DROP COLUMN continued_from_id"];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (DOWN, DOWN),
}
