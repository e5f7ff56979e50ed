//! Webhook deliveries written and listed for less (issue 39).
//!
//! - An endpoint's deliveries are listed newest first without sorting them all.
//!   `GET /v1/webhooks/{id}/deliveries` pages by delivery id (a UUIDv7: the order they were
//!   made), but its index was on `(webhook_id, created_at)`: each page read every delivery
//!   the endpoint kept (`keep_for`'s worth) and sorted them in a temporary B-tree to return a
//!   few. On `(webhook_id, id)` a page reads its rows and stops. It still serves the
//!   endpoint's delete (by `webhook_id`).
//! - On SQLite the deliveries' foreign key to their endpoint is gone (the table is made
//!   again without it, its rows copied). Its check made every insert of a batch keep a
//!   statement journal, and it guarded nothing there: SQLite has one writer, whose inserts
//!   take a delivery only while its endpoint is there and enabled, and whose delete of an
//!   endpoint deletes its deliveries in the same transaction. Postgres keeps it: there an
//!   endpoint's delete and a commit's insert run at once in separate transactions, and the
//!   key is what keeps a delivery from outliving its endpoint.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "CREATE TABLE webhook_deliveries_new (
        id TEXT NOT NULL PRIMARY KEY,
        webhook_id TEXT NOT NULL,
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
    "INSERT INTO webhook_deliveries_new (id, webhook_id, tenant_id, conversation_id, event_seq, \
     event_type, payload, status, attempts, next_attempt_at, expires_at, claimed_by, \
     claimed_until, last_status, last_error, last_latency_ms, attempts_log, created_at, updated_at) \
     SELECT id, webhook_id, tenant_id, conversation_id, event_seq, event_type, payload, status, \
     attempts, next_attempt_at, expires_at, claimed_by, claimed_until, last_status, last_error, \
     last_latency_ms, attempts_log, created_at, updated_at FROM webhook_deliveries",
    "DROP TABLE webhook_deliveries",
    "ALTER TABLE webhook_deliveries_new RENAME TO webhook_deliveries",
    "CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE status = 'pending'",
    "CREATE INDEX webhook_deliveries_order ON webhook_deliveries (webhook_id, conversation_id, event_seq) WHERE status = 'pending'",
    "CREATE INDEX webhook_deliveries_listed ON webhook_deliveries (webhook_id, id)",
    "CREATE INDEX webhook_deliveries_finished ON webhook_deliveries (updated_at) WHERE status <> 'pending'",
];

const POSTGRES_UP: &[&str] = &[
    "DROP INDEX webhook_deliveries_listed",
    "CREATE INDEX webhook_deliveries_listed ON webhook_deliveries (webhook_id, id)",
];

/// Down on SQLite keeps the table as it is (without the key: its rows would all have to
/// name an endpoint still there) and puts the old index back.
const DOWN: &[&str] = &[
    "DROP INDEX webhook_deliveries_listed",
    "CREATE INDEX webhook_deliveries_listed ON webhook_deliveries (webhook_id, created_at)",
];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (DOWN, DOWN),
}
