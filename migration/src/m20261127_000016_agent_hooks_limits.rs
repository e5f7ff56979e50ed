//! An agent's pre-tool-use hook and its limits (docs/api.md, "Agents"; issue 38), kept by
//! each conversation created from it: `hooks` (JSON: the hook's URL, secret, timeout and
//! failure policy) and `limits` (JSON: its turn and sub-agent bounds within the node's).

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "ALTER TABLE conversations ADD COLUMN hooks TEXT NULL",
    "ALTER TABLE conversations ADD COLUMN limits TEXT NULL",
];

const POSTGRES_UP: &[&str] = &[
    "ALTER TABLE conversations ADD COLUMN hooks text NULL",
    "ALTER TABLE conversations ADD COLUMN limits text NULL",
];

const DOWN: &[&str] = &[
    "ALTER TABLE conversations DROP COLUMN limits",
    "ALTER TABLE conversations DROP COLUMN hooks",
];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (DOWN, DOWN),
}
