//! Token budgets at the gateway: checked before every LLM request, spent when its answer
//! comes (docs/api.md, "Budgets and limits"; the store's `limits` says how the check is
//! atomic across conversations and nodes).

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;

use super::{Failure, LlmJob, Shared};
use crate::persistence::WriteJob;
use crate::state_machine::{ErrorKind, Usage};
use crate::store::{BudgetState, Reservation, Store, UsageRecord};

/// Token budgets, kept in the database: a reservation is atomic across conversations and
/// nodes, and its answer decides whether a request goes, so it is the one write the gateway
/// makes itself (README, "Architecture invariants").
#[derive(Clone, Debug)]
pub struct Budgets {
    store: Store,
}

impl Budgets {
    pub fn new(store: Store) -> Budgets {
        Budgets { store }
    }
}

/// A request's hold on its tenant's budget. Settled with the tokens the answer reports; a
/// request that ends any other way (an error, a cancel that drops it) gives the
/// reservation back when this is dropped. Both run in tasks of their own, so that a cancel
/// that drops the request cannot cut them short.
pub(super) struct Hold {
    store: Store,
    persistence: crate::persistence::Persistence,
    metrics: Arc<crate::metrics::Metrics>,
    tenant_id: String,
    model: String,
    /// The configured default budget (tokens, period).
    default: (u64, crate::config::BudgetPeriod),
    reservation: Reservation,
    done: bool,
}

impl Hold {
    /// Records the answer's tokens: the day's usage, and the budget's spend in place of the
    /// reservation.
    /// They are written with the persistence actor's next group commit, in its transaction
    /// (issue 41: a transaction of their own for each response cost a sync of the log and,
    /// on SQLite, the write lock beside the group commit's).
    pub(super) fn settle(&mut self, usage: Usage) {
        self.done = true;
        let (store, persistence, metrics) = (
            self.store.clone(),
            self.persistence.clone(),
            self.metrics.clone(),
        );
        let record = UsageRecord {
            tenant_id: self.tenant_id.clone(),
            model: self.model.clone(),
            tokens: (usage.input_tokens, usage.output_tokens),
            reservation: self.reservation.clone(),
            at: Utc::now(),
        };
        let default = self.default;
        // Boxed: a task's future is copied as the task is made and again as it ends, and
        // this one is some 4 KB (issue 41).
        tokio::spawn(Box::pin(async move {
            let (tenant, reservation) = (&record.tenant_id, &record.reservation);
            let recorded = retried(|| async {
                persistence
                    .write(WriteJob::RecordUsage(record.clone()))
                    .await
                    .map(|_| ())
            })
            .await;
            if let Err(error) = recorded {
                tracing::warn!(%tenant, %error, "the usage of an LLM response was not recorded");
                let _ = retried(|| release(&persistence, tenant, reservation)).await;
                return;
            }
            if matches!(reservation, Reservation::Reserved { .. })
                && let Ok(Some(state)) = store.budget_state(tenant, default, Utc::now()).await
            {
                metrics.budget_used(tenant, state.used);
            }
        }));
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if self.done || !matches!(self.reservation, Reservation::Reserved { .. }) {
            return;
        }
        let (persistence, tenant, reservation) = (
            self.persistence.clone(),
            self.tenant_id.clone(),
            self.reservation.clone(),
        );
        tokio::spawn(async move {
            if let Err(error) = retried(|| release(&persistence, &tenant, &reservation)).await {
                tracing::warn!(%tenant, %error, "a budget reservation was not given back");
            }
        });
    }
}

/// Gives a reservation back, through the persistence actor.
async fn release(
    persistence: &crate::persistence::Persistence,
    tenant_id: &str,
    reservation: &Reservation,
) -> crate::store::Result<()> {
    persistence
        .write(WriteJob::ReleaseBudget {
            tenant_id: tenant_id.to_owned(),
            reservation: reservation.clone(),
        })
        .await
        .map(|_| ())
}

/// `write`, tried again a few times while the database refuses it.
async fn retried<F, Fut>(mut write: F) -> crate::store::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = crate::store::Result<()>>,
{
    let mut delay = Duration::from_millis(100);
    let mut tries = 0;
    loop {
        match write().await {
            Err(error) if error.is_unavailable() && tries < 5 => {
                tries += 1;
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            other => return other,
        }
    }
}

fn described(what: &str, state: &BudgetState) -> String {
    format!(
        "{what} has used {} of its {} tokens this {}; it resets at {}",
        state.used,
        state.limit,
        state.period.as_str(),
        state.resets_at.to_rfc3339(),
    )
}

/// The conversation's budget, then the tenant's: a spent one is a `budget` failure, one
/// whose rest is held by requests in flight a retryable one; else `estimate` tokens of the
/// tenant's are held for the request.
pub(super) async fn reserve(shared: &Shared, job: &LlmJob, estimate: u32) -> Result<Hold, Failure> {
    let metrics = &shared.metrics;
    if let Some((limit, used)) = job.budget
        && used >= limit
    {
        metrics.rejected("budget");
        return Err(Failure::new(
            ErrorKind::Budget,
            format!(
                "this conversation has used {used} of its budget of {limit} tokens; start a new conversation (or fork this one) to go on"
            ),
        ));
    }
    let budgets = &shared.settings.budgets;
    let default = (budgets.tenant_tokens, budgets.period);
    let reservation = shared
        .budgets
        .store
        .reserve_budget(
            &job.tenant_id,
            default,
            u64::from(estimate.max(1)),
            Utc::now(),
        )
        .await
        .map_err(|e| {
            Failure::new(
                ErrorKind::Network,
                format!("cannot check the token budget: {e}"),
            )
        })?;
    match &reservation {
        Reservation::Spent(state) => {
            metrics.rejected("budget");
            metrics.budget_used(&job.tenant_id, state.used);
            return Err(Failure::new(
                ErrorKind::Budget,
                described("the tenant", state),
            ));
        }
        Reservation::Held(state) => {
            // Retried by the core after a short delay: the requests in flight will have
            // settled by then, one way or the other.
            let mut failure = Failure::new(
                ErrorKind::RateLimit,
                format!(
                    "{}; the rest is held by requests in flight",
                    described("the tenant", state)
                ),
            );
            failure.retry_after_ms = Some(2000);
            return Err(failure);
        }
        Reservation::Reserved { .. } | Reservation::Unlimited => {}
    }
    Ok(Hold {
        store: shared.budgets.store.clone(),
        persistence: shared.persistence.clone(),
        metrics: metrics.clone(),
        tenant_id: job.tenant_id.clone(),
        model: job.model.clone(),
        default,
        reservation,
        done: false,
    })
}
