//! Webhooks (docs/api.md, "Webhooks"; issue 39): a tenant's endpoints, told of its
//! conversations' events, signed as Standard Webhooks sign.
//!
//! - `webhooks`: the endpoints, their signing secret (and the previous one for a day after
//!   a rotation), whether they are enabled and why not, and since when they fail.
//! - `webhook_outbox`: the transactional outbox. An event's row is written in the same
//!   commit as the state change that caused it (a turn's end in the group commit, a request
//!   to the client with the request's row), so a crash between the change and the delivery
//!   loses nothing and sends nothing for a change that was not stored. `seq` orders them.
//! - `webhook_deliveries`: one row per event and subscribed endpoint, its id the
//!   `webhook-id` (stable across retries), claimed by one node at a time (`claimed_by`,
//!   `claimed_until`: a dead node's claim runs out), retried until `expires_at`, its
//!   attempts kept (`attempts_log`, the last few, with a short excerpt of each answer).

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "CREATE TABLE webhooks (
        id TEXT NOT NULL PRIMARY KEY,
        tenant_id TEXT NOT NULL,
        url TEXT NOT NULL,
        events TEXT NOT NULL,
        description TEXT NULL,
        enabled BOOLEAN NOT NULL,
        disabled_reason TEXT NULL,
        secret TEXT NOT NULL,
        previous_secret TEXT NULL,
        previous_secret_until BIGINT NULL,
        failing_since BIGINT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL
    )",
    "CREATE INDEX webhooks_tenant ON webhooks (tenant_id)",
    "CREATE TABLE webhook_outbox (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        tenant_id TEXT NOT NULL,
        conversation_id TEXT NOT NULL,
        event_type TEXT NOT NULL,
        payload TEXT NOT NULL,
        created_at BIGINT NOT NULL
    )",
    "CREATE TABLE webhook_deliveries (
        id TEXT NOT NULL PRIMARY KEY,
        webhook_id TEXT NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
        tenant_id TEXT NOT NULL,
        conversation_id TEXT NOT NULL,
        event_seq BIGINT NOT NULL,
        event_type TEXT NOT NULL,
        payload TEXT NOT NULL,
        status TEXT NOT NULL,
        attempts INTEGER NOT NULL,
        next_attempt_at BIGINT NOT NULL,
        expires_at BIGINT NOT NULL,
        claimed_by TEXT NULL,
        claimed_until BIGINT NULL,
        last_status INTEGER NULL,
        last_error TEXT NULL,
        last_latency_ms BIGINT NULL,
        attempts_log TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL
    )",
    "CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending'",
    "CREATE INDEX webhook_deliveries_order ON webhook_deliveries (webhook_id, conversation_id, event_seq) WHERE status = 'pending'",
    "CREATE INDEX webhook_deliveries_listed ON webhook_deliveries (webhook_id, created_at)",
];

const POSTGRES_UP: &[&str] = &[
    "CREATE TABLE webhooks (
        id text NOT NULL PRIMARY KEY,
        tenant_id text NOT NULL,
        url text NOT NULL,
        events text NOT NULL,
        description text NULL,
        enabled boolean NOT NULL,
        disabled_reason text NULL,
        secret text NOT NULL,
        previous_secret text NULL,
        previous_secret_until bigint NULL,
        failing_since bigint NULL,
        created_at bigint NOT NULL,
        updated_at bigint NOT NULL
    )",
    "CREATE INDEX webhooks_tenant ON webhooks (tenant_id)",
    "CREATE TABLE webhook_outbox (
        seq bigserial PRIMARY KEY,
        tenant_id text NOT NULL,
        conversation_id text NOT NULL,
        event_type text NOT NULL,
        payload text NOT NULL,
        created_at bigint NOT NULL
    )",
    "CREATE TABLE webhook_deliveries (
        id text NOT NULL PRIMARY KEY,
        webhook_id text NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
        tenant_id text NOT NULL,
        conversation_id text NOT NULL,
        event_seq bigint NOT NULL,
        event_type text NOT NULL,
        payload text NOT NULL,
        status text NOT NULL,
        attempts integer NOT NULL,
        next_attempt_at bigint NOT NULL,
        expires_at bigint NOT NULL,
        claimed_by text NULL,
        claimed_until bigint NULL,
        last_status integer NULL,
        last_error text NULL,
        last_latency_ms bigint NULL,
        attempts_log text NOT NULL,
        created_at bigint NOT NULL,
        updated_at bigint NOT NULL
    )",
    "CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending'",
    "CREATE INDEX webhook_deliveries_order ON webhook_deliveries (webhook_id, conversation_id, event_seq) WHERE status = 'pending'",
    "CREATE INDEX webhook_deliveries_listed ON webhook_deliveries (webhook_id, created_at)",
];

const DOWN: &[&str] = &[
    "DROP TABLE webhook_deliveries",
    "DROP TABLE webhook_outbox",
    "DROP TABLE webhooks",
];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (DOWN, DOWN),
}
