//! Tenants' own MCP tool servers (docs/api.md, "MCP"): each tenant's registered servers, and
//! the MCP tools a conversation was given at its creation (JSON: server, name, tool,
//! description, input_schema), fixed from then on.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "CREATE TABLE mcp_servers (
        tenant_id TEXT NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        url TEXT NOT NULL,
        headers TEXT NOT NULL DEFAULT '{}',
        created_at TEXT NOT NULL,
        PRIMARY KEY (tenant_id, name)
    ) WITHOUT ROWID",
    "ALTER TABLE conversations ADD COLUMN mcp_tools TEXT NULL",
];

const POSTGRES_UP: &[&str] = &[
    "CREATE TABLE mcp_servers (
        tenant_id text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
        name text NOT NULL,
        url text NOT NULL,
        headers text NOT NULL DEFAULT '{}',
        created_at text NOT NULL,
        PRIMARY KEY (tenant_id, name)
    )",
    "ALTER TABLE conversations ADD COLUMN mcp_tools text NULL",
];

const DOWN: &[&str] = &[
    "ALTER TABLE conversations DROP COLUMN mcp_tools",
    "DROP TABLE mcp_servers",
];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (DOWN, DOWN),
}
