//! Budgets and limits (docs/api.md, "Budgets and limits").
//! - `tenant_limits`: a tenant's own token budget and request rate, where they differ from
//!   the configured defaults, and its budget's state for the current period: the tokens
//!   used, and those reserved by requests in flight.
//! - `usage_daily`: tokens per tenant, model and day (UTC), for `GET /v1/usage`.
//! - `conversations.budget_tokens`: a conversation's own budget, given at creation.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &[
    "CREATE TABLE tenant_limits (
        tenant_id TEXT NOT NULL PRIMARY KEY REFERENCES tenants (id) ON DELETE CASCADE,
        budget_tokens INTEGER NULL,
        budget_period TEXT NULL,
        rate_per_second REAL NULL,
        rate_burst INTEGER NULL,
        period_start TEXT NOT NULL DEFAULT '',
        used INTEGER NOT NULL DEFAULT 0,
        reserved INTEGER NOT NULL DEFAULT 0
    )",
    "CREATE TABLE usage_daily (
        tenant_id TEXT NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
        model TEXT NOT NULL,
        day TEXT NOT NULL,
        input_tokens INTEGER NOT NULL DEFAULT 0,
        output_tokens INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (tenant_id, day, model)
    ) WITHOUT ROWID",
    "ALTER TABLE conversations ADD COLUMN budget_tokens INTEGER NULL",
];

const POSTGRES_UP: &[&str] = &[
    "CREATE TABLE tenant_limits (
        tenant_id text NOT NULL PRIMARY KEY REFERENCES tenants (id) ON DELETE CASCADE,
        budget_tokens bigint NULL,
        budget_period text NULL,
        rate_per_second double precision NULL,
        rate_burst integer NULL,
        period_start text NOT NULL DEFAULT '',
        used bigint NOT NULL DEFAULT 0,
        reserved bigint NOT NULL DEFAULT 0
    )",
    "CREATE TABLE usage_daily (
        tenant_id text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
        model text NOT NULL,
        day text NOT NULL,
        input_tokens bigint NOT NULL DEFAULT 0,
        output_tokens bigint NOT NULL DEFAULT 0,
        PRIMARY KEY (tenant_id, day, model)
    )",
    "ALTER TABLE conversations ADD COLUMN budget_tokens bigint NULL",
];

const SQLITE_DOWN: &[&str] = &[
    "ALTER TABLE conversations DROP COLUMN budget_tokens",
    "DROP TABLE usage_daily",
    "DROP TABLE tenant_limits",
];

const POSTGRES_DOWN: &[&str] = &[
    "ALTER TABLE conversations DROP COLUMN budget_tokens",
    "DROP TABLE usage_daily",
    "DROP TABLE tenant_limits",
];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (SQLITE_DOWN, POSTGRES_DOWN),
}
