//! Tenants' schedules and their firings (issue 39; migration 18). Reads are open; writes
//! are called by the persistence actor.
//!
//! A claim takes the due schedules (on Postgres their rows locked, `FOR UPDATE SKIP
//! LOCKED`, so two nodes never take the same one), inserts one run per firing keyed by
//! (schedule, fire time) and moves the schedule's next firing: one transaction, so each
//! firing is claimed once. A run not finished by its claim's end (its node died) is taken
//! over by the next claim.

use sea_orm::{ConnectionTrait, DbBackend, FromQueryResult, TransactionTrait};

use super::{Result, Store};
use crate::model::{Schedule, ScheduleRun};
use crate::schedules::{CatchUp, due};

#[derive(Debug, FromQueryResult)]
struct ScheduleRow {
    id: String,
    tenant_id: String,
    agent: Option<String>,
    conversation_id: Option<String>,
    message: String,
    cron: Option<String>,
    every_ms: Option<i64>,
    at_ms: Option<i64>,
    timezone: String,
    if_busy: String,
    catch_up: String,
    enabled: bool,
    next_fire_at: Option<i64>,
    last_fire_at: Option<i64>,
    created_at: i64,
    updated_at: i64,
}

impl From<ScheduleRow> for Schedule {
    fn from(row: ScheduleRow) -> Schedule {
        Schedule {
            id: row.id,
            tenant_id: row.tenant_id,
            agent: row.agent,
            conversation_id: row.conversation_id,
            message: row.message,
            cron: row.cron,
            every_ms: row.every_ms.and_then(|ms| u64::try_from(ms).ok()),
            at_ms: row.at_ms,
            timezone: row.timezone,
            if_busy: row.if_busy,
            catch_up: row.catch_up,
            enabled: row.enabled,
            next_fire_at: row.next_fire_at,
            last_fire_at: row.last_fire_at,
            created_at: row.created_at,
            updated_at: row.updated_at,
        }
    }
}

#[derive(Debug, FromQueryResult)]
struct RunRow {
    schedule_id: String,
    fire_at: i64,
    tenant_id: String,
    status: String,
    conversation_id: Option<String>,
    outcome: Option<String>,
    started_at: Option<i64>,
    created_at: i64,
}

impl From<RunRow> for ScheduleRun {
    fn from(row: RunRow) -> ScheduleRun {
        ScheduleRun {
            schedule_id: row.schedule_id,
            fire_at: row.fire_at,
            tenant_id: row.tenant_id,
            status: row.status,
            conversation_id: row.conversation_id,
            outcome: row.outcome,
            started_at: row.started_at,
            created_at: row.created_at,
        }
    }
}

const COLUMNS: &str = "id, tenant_id, agent, conversation_id, message, cron, every_ms, at_ms, \
     timezone, if_busy, catch_up, enabled, next_fire_at, last_fire_at, created_at, updated_at";

const RUN_COLUMNS: &str =
    "schedule_id, fire_at, tenant_id, status, conversation_id, outcome, started_at, created_at";

/// What a finished run says.
#[derive(Clone, Debug, PartialEq)]
pub struct RunOutcome {
    pub schedule_id: String,
    pub fire_at: i64,
    pub claimed_by: String,
    /// This node's own token for runs handed to it (`node:<id>`).
    pub node_token: String,
    /// `started`, `queued`, `skipped` or `failed`.
    pub status: &'static str,
    pub conversation_id: Option<String>,
    pub outcome: String,
    pub at: i64,
}

impl Store {
    /// The tenant's schedules, oldest first; every tenant's with `None` (operators).
    pub async fn schedules(&self, tenant_id: Option<&str>) -> Result<Vec<Schedule>> {
        let (sql, values) = match tenant_id {
            Some(tenant) => (
                format!(
                    "SELECT {COLUMNS} FROM schedules WHERE tenant_id = $1 ORDER BY created_at, id"
                ),
                vec![tenant.into()],
            ),
            None => (
                format!("SELECT {COLUMNS} FROM schedules ORDER BY tenant_id, created_at, id"),
                Vec::new(),
            ),
        };
        Ok(ScheduleRow::find_by_statement(self.statement(&sql, values))
            .all(&self.db)
            .await?
            .into_iter()
            .map(Schedule::from)
            .collect())
    }

    pub async fn schedule(&self, tenant_id: &str, id: &str) -> Result<Option<Schedule>> {
        let sql = format!("SELECT {COLUMNS} FROM schedules WHERE tenant_id = $1 AND id = $2");
        Ok(
            ScheduleRow::find_by_statement(self.statement(&sql, vec![tenant_id.into(), id.into()]))
                .one(&self.db)
                .await?
                .map(Schedule::from),
        )
    }

    pub async fn schedule_count(&self, tenant_id: &str) -> Result<u64> {
        self.count_of(
            "SELECT COUNT(*) AS n FROM schedules WHERE tenant_id = $1",
            vec![tenant_id.into()],
        )
        .await
    }

    /// A schedule's runs, newest first.
    pub async fn schedule_runs(
        &self,
        tenant_id: &str,
        id: &str,
        limit: u64,
    ) -> Result<Vec<ScheduleRun>> {
        let sql = format!(
            "SELECT {RUN_COLUMNS} FROM schedule_runs WHERE tenant_id = $1 AND schedule_id = $2 \
             ORDER BY fire_at DESC LIMIT $3"
        );
        Ok(RunRow::find_by_statement(self.statement(
            &sql,
            vec![
                tenant_id.into(),
                id.into(),
                i64::try_from(limit).unwrap_or(i64::MAX).into(),
            ],
        ))
        .all(&self.db)
        .await?
        .into_iter()
        .map(ScheduleRun::from)
        .collect())
    }

    /// The runs claimed by `claimed_by`, or handed to this node (`node_token`), and not
    /// finished, with their schedules.
    pub async fn claimed_runs(
        &self,
        claimed_by: &str,
        node_token: &str,
    ) -> Result<Vec<(ScheduleRun, Schedule)>> {
        let sql = format!(
            "SELECT {RUN_COLUMNS} FROM schedule_runs WHERE claimed_by IN ($1, $2) AND status = 'claimed' \
             ORDER BY fire_at"
        );
        let runs: Vec<ScheduleRun> = RunRow::find_by_statement(
            self.statement(&sql, vec![claimed_by.into(), node_token.into()]),
        )
        .all(&self.db)
        .await?
        .into_iter()
        .map(ScheduleRun::from)
        .collect();
        if runs.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT {COLUMNS} FROM schedules WHERE id IN \
             (SELECT schedule_id FROM schedule_runs WHERE claimed_by IN ($1, $2) AND status = 'claimed')"
        );
        let schedules: Vec<Schedule> = ScheduleRow::find_by_statement(
            self.statement(&sql, vec![claimed_by.into(), node_token.into()]),
        )
        .all(&self.db)
        .await?
        .into_iter()
        .map(Schedule::from)
        .collect();
        Ok(runs
            .into_iter()
            .filter_map(|run| {
                let schedule = schedules.iter().find(|s| s.id == run.schedule_id)?.clone();
                Some((run, schedule))
            })
            .collect())
    }

    /// When the next claim has work: the earliest next firing of an enabled schedule, or
    /// the earliest end of a claim on an unfinished run (`None`: no work at all). A read, so
    /// a node with no schedules writes nothing for them.
    pub async fn schedules_due_at(&self, node_token: &str) -> Result<Option<i64>> {
        #[derive(Debug, FromQueryResult)]
        struct Due {
            at: Option<i64>,
        }
        let row = Due::find_by_statement(self.statement(
            "SELECT MIN(t) AS at FROM (\
               SELECT MIN(next_fire_at) AS t FROM schedules WHERE enabled = $1 \
               UNION ALL SELECT MIN(claimed_until) AS t FROM schedule_runs WHERE status = 'claimed' \
               UNION ALL SELECT MIN(fire_at) AS t FROM schedule_runs WHERE status = 'claimed' AND claimed_by = $2) AS d",
            vec![true.into(), node_token.into()],
        ))
        .one(&self.db)
        .await?;
        Ok(row.and_then(|row| row.at))
    }

    pub(crate) async fn insert_schedule(&self, schedule: &Schedule) -> Result<()> {
        let sql = format!(
            "INSERT INTO schedules ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)"
        );
        self.writer()
            .execute_raw(self.statement(
                &sql,
                vec![
                    schedule.id.clone().into(),
                    schedule.tenant_id.clone().into(),
                    schedule.agent.clone().into(),
                    schedule.conversation_id.clone().into(),
                    schedule.message.clone().into(),
                    schedule.cron.clone().into(),
                    schedule
                        .every_ms
                        .map(|ms| i64::try_from(ms).unwrap_or(i64::MAX))
                        .into(),
                    schedule.at_ms.into(),
                    schedule.timezone.clone().into(),
                    schedule.if_busy.clone().into(),
                    schedule.catch_up.clone().into(),
                    schedule.enabled.into(),
                    schedule.next_fire_at.into(),
                    schedule.last_fire_at.into(),
                    schedule.created_at.into(),
                    schedule.updated_at.into(),
                ],
            ))
            .await?;
        Ok(())
    }

    /// Pauses or resumes the tenant's schedule (resumed: from `next_fire_at`); whether it
    /// was there.
    pub(crate) async fn set_schedule_enabled(
        &self,
        tenant_id: &str,
        id: &str,
        enabled: bool,
        next_fire_at: Option<i64>,
        at: i64,
    ) -> Result<bool> {
        let done = self
            .writer()
            .execute_raw(self.statement(
                "UPDATE schedules SET enabled = $1, next_fire_at = $2, updated_at = $3 \
                 WHERE tenant_id = $4 AND id = $5",
                vec![
                    enabled.into(),
                    next_fire_at.into(),
                    at.into(),
                    tenant_id.into(),
                    id.into(),
                ],
            ))
            .await?;
        Ok(done.rows_affected() == 1)
    }

    pub(crate) async fn delete_schedule(&self, tenant_id: &str, id: &str) -> Result<bool> {
        let txn = self.writer().begin().await?;
        txn.execute_raw(self.statement(
            "DELETE FROM schedule_runs WHERE tenant_id = $1 AND schedule_id = $2",
            vec![tenant_id.into(), id.into()],
        ))
        .await?;
        let done = txn
            .execute_raw(self.statement(
                "DELETE FROM schedules WHERE tenant_id = $1 AND id = $2",
                vec![tenant_id.into(), id.into()],
            ))
            .await?;
        txn.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    /// Claims the firings due at `now` for `claimed_by` until `until`, of up to `limit`
    /// schedules, and takes over runs whose claim ran out. Returns the runs claimed.
    pub(crate) async fn claim_schedule_firings(
        &self,
        claimed_by: &str,
        now: i64,
        until: i64,
        late_ms: i64,
        limit: u64,
    ) -> Result<u64> {
        let txn = self.writer().begin().await?;
        let lock = if self.backend() == DbBackend::Postgres {
            " FOR UPDATE SKIP LOCKED"
        } else {
            ""
        };
        let sql = format!(
            "SELECT {COLUMNS} FROM schedules WHERE enabled = $1 AND next_fire_at <= $2 \
             ORDER BY next_fire_at LIMIT $3{lock}"
        );
        let due_now: Vec<Schedule> = ScheduleRow::find_by_statement(self.statement(
            &sql,
            vec![
                true.into(),
                now.into(),
                i64::try_from(limit).unwrap_or(i64::MAX).into(),
            ],
        ))
        .all(&txn)
        .await?
        .into_iter()
        .map(Schedule::from)
        .collect();
        let mut claimed = 0u64;
        for schedule in &due_now {
            let (Some(when), Some(next_fire_at)) = (schedule.when(), schedule.next_fire_at) else {
                continue;
            };
            let catch_up = CatchUp::parse(&schedule.catch_up).unwrap_or(CatchUp::None);
            let firings = due(&when, next_fire_at, now, late_ms, catch_up);
            for fire_at in &firings.fire {
                let inserted = txn
                    .execute_raw(self.statement(
                        "INSERT INTO schedule_runs (schedule_id, fire_at, tenant_id, status, \
                         claimed_by, claimed_until, created_at) VALUES ($1, $2, $3, 'claimed', $4, $5, $6) \
                         ON CONFLICT (schedule_id, fire_at) DO NOTHING",
                        vec![
                            schedule.id.clone().into(),
                            (*fire_at).into(),
                            schedule.tenant_id.clone().into(),
                            claimed_by.into(),
                            until.into(),
                            now.into(),
                        ],
                    ))
                    .await?;
                claimed += inserted.rows_affected();
            }
            if let Some(last) = firings.last_skipped {
                txn.execute_raw(self.statement(
                    "INSERT INTO schedule_runs (schedule_id, fire_at, tenant_id, status, outcome, \
                     created_at) VALUES ($1, $2, $3, 'skipped', $4, $5) \
                     ON CONFLICT (schedule_id, fire_at) DO NOTHING",
                    vec![
                        schedule.id.clone().into(),
                        last.into(),
                        schedule.tenant_id.clone().into(),
                        format!(
                            "{} firing(s) missed while no node ran (catch_up: {}), up to this one",
                            firings.skipped, schedule.catch_up
                        )
                        .into(),
                        now.into(),
                    ],
                ))
                .await?;
            }
            let last_fire = firings.fire.last().copied().or(schedule.last_fire_at);
            txn.execute_raw(self.statement(
                "UPDATE schedules SET next_fire_at = $1, last_fire_at = $2, enabled = $3, \
                 updated_at = $4 WHERE id = $5",
                vec![
                    firings.next.into(),
                    last_fire.into(),
                    firings.next.is_some().into(),
                    now.into(),
                    schedule.id.clone().into(),
                ],
            ))
            .await?;
        }
        // Runs whose node died before it finished them.
        let taken = txn
            .execute_raw(self.statement(
                "UPDATE schedule_runs SET claimed_by = $1, claimed_until = $2 \
                 WHERE status = 'claimed' AND claimed_until < $3",
                vec![claimed_by.into(), until.into(), now.into()],
            ))
            .await?;
        txn.commit().await?;
        Ok(claimed + taken.rows_affected())
    }

    /// Writes what a run came to, under its claim; whether the claim still held.
    pub(crate) async fn finish_schedule_run(&self, run: &RunOutcome) -> Result<bool> {
        let done = self
            .writer()
            .execute_raw(self.statement(
                "UPDATE schedule_runs SET status = $1, conversation_id = $2, outcome = $3, \
                 started_at = $4, claimed_by = NULL, claimed_until = NULL \
                 WHERE schedule_id = $5 AND fire_at = $6 AND claimed_by IN ($7, $8) AND status = 'claimed'",
                vec![
                    run.status.into(),
                    run.conversation_id.clone().into(),
                    run.outcome.clone().into(),
                    run.at.into(),
                    run.schedule_id.clone().into(),
                    run.fire_at.into(),
                    run.claimed_by.clone().into(),
                    run.node_token.clone().into(),
                ],
            ))
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Removes up to `limit` finished runs made before `before`; how many.
    pub(crate) async fn prune_schedule_runs(&self, before: i64, limit: u64) -> Result<u64> {
        let done = self
            .writer()
            .execute_raw(self.statement(
                "DELETE FROM schedule_runs WHERE (schedule_id, fire_at) IN (SELECT schedule_id, fire_at \
                 FROM schedule_runs WHERE status <> 'claimed' AND created_at < $1 LIMIT $2)",
                vec![before.into(), i64::try_from(limit).unwrap_or(i64::MAX).into()],
            ))
            .await?;
        Ok(done.rows_affected())
    }

    /// Hands a run to the node that owns its conversation (`to`: its `node:<id>` token) for
    /// `until`; whether the claim (`from` or this node's own `node_token`) still held.
    pub(crate) async fn hand_off_schedule_run(
        &self,
        schedule_id: &str,
        fire_at: i64,
        from: (&str, &str),
        to: &str,
        until: i64,
    ) -> Result<bool> {
        let done = self
            .writer()
            .execute_raw(self.statement(
                "UPDATE schedule_runs SET claimed_by = $1, claimed_until = $2 \
                 WHERE schedule_id = $3 AND fire_at = $4 AND claimed_by IN ($5, $6) AND status = 'claimed'",
                vec![
                    to.into(),
                    until.into(),
                    schedule_id.into(),
                    fire_at.into(),
                    from.0.into(),
                    from.1.into(),
                ],
            ))
            .await?;
        Ok(done.rows_affected() == 1)
    }
}
