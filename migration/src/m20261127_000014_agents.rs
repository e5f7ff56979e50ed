//! Agents (docs/api.md, "Agents"; issue 38): a tenant's named agent definitions, each change a
//! new immutable version, and the agent version a conversation was created from.
//!
//! `agents` holds one row per name: its latest version and, once deleted, when (no new
//! conversation may use it then; its versions stay for the conversations that run them, and
//! a name created again goes on from its last version, so `name@N` always means one
//! definition). `agent_versions` holds every version's definition (JSON). A conversation
//! keeps its agent version, its built-in tools and its permission rules.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "CREATE TABLE agents (
        tenant_id TEXT NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        latest INTEGER NOT NULL,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        deleted_at TEXT NULL,
        PRIMARY KEY (tenant_id, name)
    ) WITHOUT ROWID",
    "CREATE TABLE agent_versions (
        tenant_id TEXT NOT NULL,
        name TEXT NOT NULL,
        version INTEGER NOT NULL,
        definition TEXT NOT NULL,
        created_at TEXT NOT NULL,
        PRIMARY KEY (tenant_id, name, version),
        FOREIGN KEY (tenant_id, name) REFERENCES agents (tenant_id, name) ON DELETE CASCADE
    ) WITHOUT ROWID",
    "ALTER TABLE conversations ADD COLUMN agent_name TEXT NULL",
    "ALTER TABLE conversations ADD COLUMN agent_version INTEGER NULL",
    "ALTER TABLE conversations ADD COLUMN tools TEXT NULL",
    "ALTER TABLE conversations ADD COLUMN permissions TEXT NULL",
];

const POSTGRES_UP: &[&str] = &[
    "CREATE TABLE agents (
        tenant_id text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
        name text NOT NULL,
        latest bigint NOT NULL,
        created_at text NOT NULL,
        updated_at text NOT NULL,
        deleted_at text NULL,
        PRIMARY KEY (tenant_id, name)
    )",
    "CREATE TABLE agent_versions (
        tenant_id text NOT NULL,
        name text NOT NULL,
        version bigint NOT NULL,
        definition text NOT NULL,
        created_at text NOT NULL,
        PRIMARY KEY (tenant_id, name, version),
        FOREIGN KEY (tenant_id, name) REFERENCES agents (tenant_id, name) ON DELETE CASCADE
    )",
    "ALTER TABLE conversations ADD COLUMN agent_name text NULL",
    "ALTER TABLE conversations ADD COLUMN agent_version bigint NULL",
    "ALTER TABLE conversations ADD COLUMN tools text NULL",
    "ALTER TABLE conversations ADD COLUMN permissions text NULL",
];

const DOWN: &[&str] = &[
    "ALTER TABLE conversations DROP COLUMN permissions",
    "ALTER TABLE conversations DROP COLUMN tools",
    "ALTER TABLE conversations DROP COLUMN agent_version",
    "ALTER TABLE conversations DROP COLUMN agent_name",
    "DROP TABLE agent_versions",
    "DROP TABLE agents",
];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (DOWN, DOWN),
}
