//! Client tools (docs/api.md, "Client tools"; issue 38): tools a conversation's client runs.
//!
//! A conversation keeps the client tools it was given (its agent's, or its create request's)
//! as JSON. `client_tool_calls` holds each call of one while the client runs it: one row per
//! tool call, keyed by `call_key` (its turn, LLM step and tool_use id: a backend may reuse
//! a tool_use id in a later step), answered once by a conditional update from `pending`. Unlike a request to the client, a pending call outlives a restart: the client
//! may be a backend that takes minutes, and answers the same call afterwards.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "CREATE TABLE client_tool_calls (
        id TEXT NOT NULL PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        tool_use_id TEXT NOT NULL,
        call_key TEXT NOT NULL,
        name TEXT NOT NULL,
        input TEXT NOT NULL,
        status TEXT NOT NULL,
        output TEXT NULL,
        is_error BOOLEAN NULL,
        timeout_ms BIGINT NOT NULL,
        expires_at TEXT NOT NULL,
        created_at TEXT NOT NULL,
        resolved_at TEXT NULL,
        UNIQUE (conversation_id, call_key)
    )",
    "ALTER TABLE conversations ADD COLUMN client_tools TEXT NULL",
];

const POSTGRES_UP: &[&str] = &[
    "CREATE TABLE client_tool_calls (
        id text NOT NULL PRIMARY KEY,
        conversation_id text NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        tool_use_id text NOT NULL,
        call_key text NOT NULL,
        name text NOT NULL,
        input text NOT NULL,
        status text NOT NULL,
        output text NULL,
        is_error boolean NULL,
        timeout_ms bigint NOT NULL,
        expires_at text NOT NULL,
        created_at text NOT NULL,
        resolved_at text NULL,
        UNIQUE (conversation_id, call_key)
    )",
    "ALTER TABLE conversations ADD COLUMN client_tools text NULL",
];

const DOWN: &[&str] = &[
    "ALTER TABLE conversations DROP COLUMN client_tools",
    "DROP TABLE client_tool_calls",
];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (DOWN, DOWN),
}
