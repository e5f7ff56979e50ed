//! Token budgets, usage and rate overrides of tenants (docs/api.md, "Budgets and limits").
//!
//! A tenant's budget is checked in the database, atomically with the spend of its other
//! conversations, on every node. Each LLM request first reserves an estimate of its
//! tokens with one conditional UPDATE. The update goes through only while the period's
//! `used + reserved` is under the limit, so requests that race for the last of a budget
//! cannot all pass. When the answer comes, the reservation is replaced by the real spend
//! (and the day's usage row is added to) in one transaction. A failed or cancelled request
//! gives its reservation back. The period rolls over inside the same statements: the first
//! request of a new period finds the old period's key and starts from zero.

use chrono::{DateTime, Datelike as _, NaiveDate, TimeZone as _, Utc};
use sea_orm::{ConnectionTrait as _, DbBackend, FromQueryResult, Statement};

use super::{Result, Store};
use crate::config::BudgetPeriod;

/// A tenant's own limits, where they differ from the configured defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TenantLimits {
    pub budget_tokens: Option<u64>,
    pub budget_period: Option<BudgetPeriod>,
    pub rate_per_second: Option<f64>,
    pub rate_burst: Option<u32>,
}

/// A budget as it stands in its current period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetState {
    pub limit: u64,
    pub used: u64,
    pub period: BudgetPeriod,
    pub resets_at: DateTime<Utc>,
}

/// One LLM response's tokens, to be recorded: the day's usage of its tenant and model, and
/// the tenant's budget spend in place of the request's reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageRecord {
    pub tenant_id: String,
    pub model: String,
    /// Input and output tokens.
    pub tokens: (u64, u64),
    pub reservation: Reservation,
    pub at: DateTime<Utc>,
}

/// The usage of a batch of LLM responses, summed: the tokens per (tenant, model, day) and
/// the budgets' spends per (tenant, period). A batch writes one row of each key whatever
/// the number of responses in it (and one statement may not change a row twice).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct SummedUsage<'a> {
    /// (tenant, model, day as `YYYY-MM-DD`) -> (input tokens, output tokens).
    pub days: std::collections::BTreeMap<(&'a str, &'a str, String), (u64, u64)>,
    /// (tenant, period key) -> (tokens spent, tokens the reservations held).
    pub spends: std::collections::BTreeMap<(&'a str, &'a str), (u64, u64)>,
}

impl<'a> SummedUsage<'a> {
    pub(super) fn of(usage: &'a [UsageRecord]) -> SummedUsage<'a> {
        let mut summed = SummedUsage::default();
        for record in usage {
            let (input, output) = record.tokens;
            let day = record.at.date_naive().format("%Y-%m-%d").to_string();
            let sum = summed
                .days
                .entry((&record.tenant_id, &record.model, day))
                .or_default();
            sum.0 += input;
            sum.1 += output;
            if let Reservation::Reserved { tokens, period_key } = &record.reservation {
                let spend = summed
                    .spends
                    .entry((&record.tenant_id, period_key))
                    .or_default();
                spend.0 += input + output;
                spend.1 += tokens;
            }
        }
        summed
    }
}

/// How long a tenant found without a token budget is taken to have none. A budget set on
/// this node applies at once; one set through another node of a cluster, within this.
pub const NO_BUDGET_FOR: std::time::Duration = std::time::Duration::from_secs(2);

/// What a reservation found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// The tenant has no budget.
    Unlimited,
    /// `tokens` are reserved in the period `period_key` until the request is settled or
    /// released.
    Reserved { tokens: u64, period_key: String },
    /// The budget is spent.
    Spent(BudgetState),
    /// The budget is not spent, but what is left is held by requests in flight: try again
    /// shortly.
    Held(BudgetState),
}

/// Tokens of one model over some days.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelUsage {
    pub model: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// The key of the period `now` lies in (`2026-11` or `2026-11-25`) and when it ends.
pub fn period_of(period: BudgetPeriod, now: DateTime<Utc>) -> (String, DateTime<Utc>) {
    let day = now.date_naive();
    let next = match period {
        BudgetPeriod::Day => day.succ_opt(),
        BudgetPeriod::Month => {
            let (year, month) = if day.month() == 12 {
                (day.year() + 1, 1)
            } else {
                (day.year(), day.month() + 1)
            };
            NaiveDate::from_ymd_opt(year, month, 1)
        }
    }
    .and_then(|d| d.and_hms_opt(0, 0, 0))
    .map_or(now, |d| Utc.from_utc_datetime(&d));
    let key = match period {
        BudgetPeriod::Day => day.format("%Y-%m-%d").to_string(),
        BudgetPeriod::Month => day.format("%Y-%m").to_string(),
    };
    (key, next)
}

/// The first day of the period `now` lies in.
fn first_day(period: BudgetPeriod, now: DateTime<Utc>) -> String {
    let day = now.date_naive();
    match period {
        BudgetPeriod::Day => day.format("%Y-%m-%d").to_string(),
        BudgetPeriod::Month => day.format("%Y-%m-01").to_string(),
    }
}

/// SQL for the tokens a tenant (`$1`) has used since day `$5`, from its usage rows: where a
/// new period's count starts.
const SPENT: &str = "(SELECT COALESCE(SUM(u.input_tokens + u.output_tokens), 0) \
                     FROM usage_daily u WHERE u.tenant_id = $1 AND u.day >= $5)";

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

#[derive(Debug, FromQueryResult)]
struct LimitsRow {
    budget_tokens: Option<i64>,
    budget_period: Option<String>,
    rate_per_second: Option<f64>,
    rate_burst: Option<i32>,
    period_start: String,
    used: i64,
}

#[derive(Debug, FromQueryResult)]
struct UsageRow {
    model: String,
    input_tokens: i64,
    output_tokens: i64,
}

impl Store {
    /// `sql` written with `$1, $2, ...`, for this store's database.
    pub(super) fn statement(&self, sql: &str, values: Vec<sea_orm::Value>) -> Statement {
        let backend = self.backend();
        let sql = if backend == DbBackend::Sqlite {
            sql.replace('$', "?")
        } else {
            sql.to_owned()
        };
        Statement::from_sql_and_values(backend, sql, values)
    }

    /// Whether the tenant was found without a budget less than [`NO_BUDGET_FOR`] ago: its
    /// LLM requests then read nothing (a tenant that uses no budget pays nothing for them).
    fn known_without_budget(&self, tenant_id: &str) -> bool {
        self.no_budget.known(tenant_id, NO_BUDGET_FOR)
    }

    /// Forgets that the tenant had no budget (one was just given to it on this node).
    fn budget_changed(&self, tenant_id: &str) {
        self.no_budget.forget(tenant_id);
    }

    async fn limits_row(&self, tenant_id: &str) -> Result<Option<LimitsRow>> {
        Ok(LimitsRow::find_by_statement(self.statement(
            "SELECT budget_tokens, budget_period, rate_per_second, rate_burst, period_start, used \
             FROM tenant_limits WHERE tenant_id = $1",
            vec![tenant_id.into()],
        ))
        .one(&self.db)
        .await?)
    }

    /// A tenant's own limits (all `None`: the defaults apply).
    pub async fn tenant_limits(&self, tenant_id: &str) -> Result<TenantLimits> {
        Ok(self
            .limits_row(tenant_id)
            .await?
            .map(|row| TenantLimits {
                budget_tokens: row.budget_tokens.map(to_u64),
                budget_period: row.budget_period.as_deref().and_then(BudgetPeriod::parse),
                rate_per_second: row.rate_per_second,
                rate_burst: row.rate_burst.and_then(|b| u32::try_from(b).ok()),
            })
            .unwrap_or_default())
    }

    /// Gives a tenant its own budget (`None`: the default again); `effective` is the
    /// period that then applies. The current period's spend so far is taken from the usage
    /// already recorded.
    pub async fn set_tenant_budget(
        &self,
        tenant_id: &str,
        tokens: Option<u64>,
        period: Option<BudgetPeriod>,
        effective: BudgetPeriod,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let (key, _) = period_of(effective, now);
        let spent = self.spent_this_period(tenant_id, effective, now).await?;
        self.writer()
            .execute_raw(self.statement(
                "INSERT INTO tenant_limits (tenant_id, budget_tokens, budget_period, period_start, used) \
                 VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (tenant_id) DO UPDATE SET budget_tokens = excluded.budget_tokens, \
                 budget_period = excluded.budget_period, period_start = excluded.period_start, \
                 used = excluded.used",
                vec![
                    tenant_id.into(),
                    tokens.map(to_i64).into(),
                    period.map(|p| p.as_str().to_owned()).into(),
                    key.into(),
                    to_i64(spent).into(),
                ],
            ))
            .await?;
        self.budget_changed(tenant_id);
        Ok(())
    }

    /// The tokens the tenant's usage rows count in the period `now` lies in.
    async fn spent_this_period(
        &self,
        tenant_id: &str,
        period: BudgetPeriod,
        now: DateTime<Utc>,
    ) -> Result<u64> {
        Ok(self
            .usage(tenant_id, &first_day(period, now), "9999-12-31")
            .await?
            .iter()
            .map(|u| u.input_tokens + u.output_tokens)
            .sum())
    }

    /// The row that counts a tenant's spend under the configured default budget, made if
    /// there is none yet (a row already there is left as it is): it starts with what the
    /// tenant used this period.
    async fn start_default_budget(
        &self,
        tenant_id: &str,
        period: BudgetPeriod,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let (key, _) = period_of(period, now);
        let spent = self.spent_this_period(tenant_id, period, now).await?;
        self.writer()
            .execute_raw(self.statement(
                "INSERT INTO tenant_limits (tenant_id, period_start, used) VALUES ($1, $2, $3) \
                 ON CONFLICT (tenant_id) DO NOTHING",
                vec![tenant_id.into(), key.into(), to_i64(spent).into()],
            ))
            .await?;
        Ok(())
    }

    /// Gives a tenant its own request rate (`None`: the default again).
    pub async fn set_tenant_rate(
        &self,
        tenant_id: &str,
        per_second: Option<f64>,
        burst: Option<u32>,
    ) -> Result<()> {
        self.writer()
            .execute_raw(self.statement(
                "INSERT INTO tenant_limits (tenant_id, rate_per_second, rate_burst) VALUES ($1, $2, $3) \
                 ON CONFLICT (tenant_id) DO UPDATE SET rate_per_second = excluded.rate_per_second, \
                 rate_burst = excluded.rate_burst",
                vec![
                    tenant_id.into(),
                    per_second.into(),
                    burst.map(|b| i32::try_from(b).unwrap_or(i32::MAX)).into(),
                ],
            ))
            .await?;
        Ok(())
    }

    /// The budget that applies to a tenant (its own, else `default`: tokens, 0 for none)
    /// and where it stands.
    pub async fn budget_state(
        &self,
        tenant_id: &str,
        default: (u64, BudgetPeriod),
        now: DateTime<Utc>,
    ) -> Result<Option<BudgetState>> {
        let row = self.limits_row(tenant_id).await?;
        let limit = row
            .as_ref()
            .and_then(|r| r.budget_tokens.map(to_u64))
            .unwrap_or(default.0);
        if limit == 0 {
            return Ok(None);
        }
        let period = row
            .as_ref()
            .and_then(|r| r.budget_period.as_deref().and_then(BudgetPeriod::parse))
            .unwrap_or(default.1);
        let (key, resets_at) = period_of(period, now);
        let used = match &row {
            Some(row) if row.period_start == key => to_u64(row.used),
            // No request yet this period (or ever): what the usage rows say.
            Some(_) | None => self
                .usage(tenant_id, &first_day(period, now), "9999-12-31")
                .await?
                .iter()
                .map(|u| u.input_tokens + u.output_tokens)
                .sum(),
        };
        Ok(Some(BudgetState {
            limit,
            used,
            period,
            resets_at,
        }))
    }

    /// Reserves `estimate` tokens of the tenant's budget for one LLM request, if there is
    /// budget left (see the module's comment). The first request of a period starts from
    /// the usage already recorded in it.
    pub async fn reserve_budget(
        &self,
        tenant_id: &str,
        default: (u64, BudgetPeriod),
        estimate: u64,
        now: DateTime<Utc>,
    ) -> Result<Reservation> {
        if default.0 == 0 && self.known_without_budget(tenant_id) {
            return Ok(Reservation::Unlimited);
        }
        let row = self.limits_row(tenant_id).await?;
        let limit = row
            .as_ref()
            .and_then(|r| r.budget_tokens.map(to_u64))
            .unwrap_or(default.0);
        if limit == 0 {
            self.no_budget.mark(tenant_id);
            return Ok(Reservation::Unlimited);
        }
        let period = row
            .as_ref()
            .and_then(|r| r.budget_period.as_deref().and_then(BudgetPeriod::parse))
            .unwrap_or(default.1);
        if row.is_none() {
            // The configured default: the row that counts its spend starts with what was
            // used this period already. Only the first request makes it: a concurrent one
            // that also found none must not write its (older) sum over the spend and the
            // reservations made since (two requests of a new tenant passed a budget that
            // had room for one).
            self.start_default_budget(tenant_id, period, now).await?;
        }
        let (key, _) = period_of(period, now);
        let reserved = self
            .writer()
            .execute_raw(self.statement(
                &format!(
                    "UPDATE tenant_limits SET \
                     used = CASE WHEN period_start = $2 THEN used ELSE {SPENT} END, \
                     reserved = CASE WHEN period_start = $2 THEN reserved ELSE 0 END + $3, \
                     period_start = $2 \
                     WHERE tenant_id = $1 \
                     AND (CASE WHEN period_start = $2 THEN used + reserved ELSE {SPENT} END) < $4"
                ),
                vec![
                    tenant_id.into(),
                    key.clone().into(),
                    to_i64(estimate).into(),
                    to_i64(limit).into(),
                    first_day(period, now).into(),
                ],
            ))
            .await?
            .rows_affected();
        if reserved == 1 {
            return Ok(Reservation::Reserved {
                tokens: estimate,
                period_key: key,
            });
        }
        let state = self
            .budget_state(tenant_id, default, now)
            .await?
            .unwrap_or(BudgetState {
                limit,
                used: limit,
                period,
                resets_at: period_of(period, now).1,
            });
        Ok(if state.used >= state.limit {
            Reservation::Spent(state)
        } else {
            Reservation::Held(state)
        })
    }

    /// The statements that record a batch's `usage` on SQLite, to run inside the batch's
    /// transaction: the usage summed per key ([`SummedUsage`]), in multi-row statements of
    /// power-of-two sizes with anonymous parameters, so that the batch's text repeats and
    /// stays prepared whatever the number of responses (one statement per response made a
    /// new text for every count, each parsed again and kept in the writer's statement
    /// cache: 2.5 times the memory and 12% more CPU a turn).
    pub(super) fn sqlite_usage_statements(usage: &[UsageRecord]) -> Vec<Statement> {
        let summed = SummedUsage::of(usage);
        let days: Vec<_> = summed.days.into_iter().collect();
        let spends: Vec<_> = summed.spends.into_iter().collect();
        let mut statements = Vec::new();
        for chunk in super::shaped_chunks(&days) {
            let mut values = Vec::with_capacity(chunk.len() * 5);
            for ((tenant_id, model, day), (input, output)) in chunk {
                values.extend([
                    sea_orm::Value::from(*tenant_id),
                    sea_orm::Value::from(*model),
                    sea_orm::Value::from(day.as_str()),
                    sea_orm::Value::from(to_i64(*input)),
                    sea_orm::Value::from(to_i64(*output)),
                ]);
            }
            statements.push(Statement::from_sql_and_values(
                DbBackend::Sqlite,
                format!(
                    "INSERT INTO usage_daily (tenant_id, model, day, input_tokens, output_tokens) \
                     VALUES {} ON CONFLICT (tenant_id, day, model) DO UPDATE SET \
                     input_tokens = usage_daily.input_tokens + excluded.input_tokens, \
                     output_tokens = usage_daily.output_tokens + excluded.output_tokens",
                    vec!["(?, ?, ?, ?, ?)"; chunk.len()].join(", ")
                ),
                values,
            ));
        }
        for chunk in super::shaped_chunks(&spends) {
            let mut values = Vec::with_capacity(chunk.len() * 4);
            for ((tenant_id, period_start), (spent, held)) in chunk {
                values.extend([
                    sea_orm::Value::from(*tenant_id),
                    sea_orm::Value::from(*period_start),
                    sea_orm::Value::from(to_i64(*spent)),
                    sea_orm::Value::from(to_i64(*held)),
                ]);
            }
            statements.push(Statement::from_sql_and_values(
                DbBackend::Sqlite,
                format!(
                    "UPDATE tenant_limits SET used = used + x.spent, \
                     reserved = CASE WHEN reserved > x.held THEN reserved - x.held ELSE 0 END \
                     FROM (SELECT column1 AS tenant_id, column2 AS period_start, \
                     column3 AS spent, column4 AS held FROM (VALUES {})) AS x \
                     WHERE tenant_limits.tenant_id = x.tenant_id \
                     AND tenant_limits.period_start = x.period_start",
                    vec!["(?, ?, ?, ?)"; chunk.len()].join(", ")
                ),
                values,
            ));
        }
        statements
    }

    /// Records one LLM response's tokens alone (see [`UsageRecord`]), in one transaction:
    /// a batch of its own. The persistence actor writes them with the group commit of its
    /// batch instead (`WriteJob::RecordUsage`); this is for a write that must go on its own.
    pub async fn record(&self, usage: &UsageRecord) -> Result<()> {
        self.write_batch(
            &[],
            &[],
            std::slice::from_ref(usage),
            &super::WebhookResults::default(),
        )
        .await?
        .wait()
        .await
    }

    /// Gives back a reservation whose request spent nothing it was told of (failed,
    /// cancelled).
    pub async fn release_budget(&self, tenant_id: &str, reservation: &Reservation) -> Result<()> {
        let Reservation::Reserved { tokens, period_key } = reservation else {
            return Ok(());
        };
        self.writer()
            .execute_raw(self.statement(
                "UPDATE tenant_limits SET reserved = CASE WHEN reserved > $2 THEN reserved - $2 ELSE 0 END \
                 WHERE tenant_id = $1 AND period_start = $3",
                vec![
                    tenant_id.into(),
                    to_i64(*tokens).into(),
                    period_key.clone().into(),
                ],
            ))
            .await?;
        Ok(())
    }

    /// Forgets every reservation: at the start of the only node, no request is in flight.
    pub async fn clear_reservations(&self) -> Result<()> {
        self.writer()
            .execute_raw(self.statement(
                "UPDATE tenant_limits SET reserved = 0 WHERE reserved <> 0",
                vec![],
            ))
            .await?;
        Ok(())
    }

    /// A tenant's tokens per model over the days `from..=to` (`YYYY-MM-DD`).
    pub async fn usage(&self, tenant_id: &str, from: &str, to: &str) -> Result<Vec<ModelUsage>> {
        let rows = UsageRow::find_by_statement(self.statement(
            "SELECT model, CAST(SUM(input_tokens) AS BIGINT) AS input_tokens, \
             CAST(SUM(output_tokens) AS BIGINT) AS output_tokens \
             FROM usage_daily WHERE tenant_id = $1 AND day >= $2 AND day <= $3 \
             GROUP BY model ORDER BY model",
            vec![tenant_id.into(), from.into(), to.into()],
        ))
        .all(&self.db)
        .await?;
        Ok(rows
            .into_iter()
            .map(|row| ModelUsage {
                model: row.model,
                input_tokens: to_u64(row.input_tokens),
                output_tokens: to_u64(row.output_tokens),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_start_and_end_in_utc() {
        let now = Utc
            .with_ymd_and_hms(2026, 12, 31, 23, 59, 0)
            .single()
            .expect("a time");
        let (key, resets) = period_of(BudgetPeriod::Month, now);
        assert_eq!(key, "2026-12");
        assert_eq!(resets.to_rfc3339(), "2027-01-01T00:00:00+00:00");
        let (key, resets) = period_of(BudgetPeriod::Day, now);
        assert_eq!(key, "2026-12-31");
        assert_eq!(resets.to_rfc3339(), "2027-01-01T00:00:00+00:00");
        assert_eq!(first_day(BudgetPeriod::Month, now), "2026-12-01");
    }
}
