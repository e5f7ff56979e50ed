//! Indexes for the retention passes that remove finished webhook deliveries and schedule
//! runs past their keeping (src/runtime/retention.rs, every minute at most): without them
//! each pass read every delivery and every run kept, on the writing connection.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const UP: &[&str] = &[
    "CREATE INDEX webhook_deliveries_finished ON webhook_deliveries (updated_at) \
     WHERE status <> 'pending'",
    "CREATE INDEX schedule_runs_created ON schedule_runs (created_at) WHERE status <> 'claimed'",
];

const DOWN: &[&str] = &[
    "DROP INDEX webhook_deliveries_finished",
    "DROP INDEX schedule_runs_created",
];

statements_migration! {
    up: (UP, UP),
    down: (DOWN, DOWN),
}
