//! Tenants' own quotas (docs/security.md, "Quotas"): one row per tenant and quota it was
//! given by `bedrock tenant quota`; a quota without a row has the configured default.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const SQLITE_UP: &[&str] = &["CREATE TABLE tenant_quotas (
        tenant_id TEXT NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        value INTEGER NOT NULL,
        PRIMARY KEY (tenant_id, name)
    ) WITHOUT ROWID"];

const POSTGRES_UP: &[&str] = &["CREATE TABLE tenant_quotas (
        tenant_id text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
        name text NOT NULL,
        value bigint NOT NULL,
        PRIMARY KEY (tenant_id, name)
    )"];

const DOWN: &[&str] = &["DROP TABLE tenant_quotas"];

statements_migration! {
    up: (SQLITE_UP, POSTGRES_UP),
    down: (DOWN, DOWN),
}
