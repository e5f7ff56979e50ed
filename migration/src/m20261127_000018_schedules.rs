//! Schedules (docs/api.md, "Schedules"; issue 39): an agent run, or a message sent, on a
//! cron expression, a fixed interval or once.
//!
//! `schedules` keeps each schedule and its next firing time. A firing is a row of
//! `schedule_runs` keyed by (schedule, fire time): the node that claims it inserts the row
//! and moves the schedule's `next_fire_at` in one transaction (on Postgres with the
//! schedule's row locked, `FOR UPDATE SKIP LOCKED`), so each firing is claimed once. The
//! claim lasts until `claimed_until`; a run its node did not finish is taken over after it,
//! and its work is keyed by the run (the conversation's slug, the message's id), so doing it
//! again does nothing twice.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

const UP: &[&str] = &[
    "CREATE TABLE schedules (
        id TEXT NOT NULL PRIMARY KEY,
        tenant_id TEXT NOT NULL,
        agent TEXT NULL,
        conversation_id TEXT NULL,
        message TEXT NOT NULL,
        cron TEXT NULL,
        every_ms BIGINT NULL,
        at_ms BIGINT NULL,
        timezone TEXT NOT NULL,
        if_busy TEXT NOT NULL,
        catch_up TEXT NOT NULL,
        enabled BOOLEAN NOT NULL,
        next_fire_at BIGINT NULL,
        last_fire_at BIGINT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL
    )",
    "CREATE INDEX schedules_tenant ON schedules (tenant_id)",
    "CREATE INDEX schedules_due ON schedules (next_fire_at) WHERE enabled",
    "CREATE TABLE schedule_runs (
        schedule_id TEXT NOT NULL REFERENCES schedules (id) ON DELETE CASCADE,
        fire_at BIGINT NOT NULL,
        tenant_id TEXT NOT NULL,
        status TEXT NOT NULL,
        claimed_by TEXT NULL,
        claimed_until BIGINT NULL,
        conversation_id TEXT NULL,
        outcome TEXT NULL,
        started_at BIGINT NULL,
        created_at BIGINT NOT NULL,
        PRIMARY KEY (schedule_id, fire_at)
    )",
    "CREATE INDEX schedule_runs_claimed ON schedule_runs (claimed_until) WHERE status = 'claimed'",
];

const DOWN: &[&str] = &["DROP TABLE schedule_runs", "DROP TABLE schedules"];

statements_migration! {
    up: (UP, UP),
    down: (DOWN, DOWN),
}
