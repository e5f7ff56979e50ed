//! Token budgets at the gateway: checked before every LLM request, spent when its answer
//! comes (docs/api.md, "Budgets and limits"; the store's `limits` says how the check is
//! atomic across conversations and nodes).

use std::sync::Arc;

use chrono::Utc;

use super::{Failure, LlmJob, Shared};
use crate::config::BudgetPeriod;
use crate::state_machine::{ErrorKind, Usage};
use crate::store::{BudgetState, Reservation, Store};

/// A request's hold on its tenant's budget. Settled with the tokens the answer reports; a
/// request that ends any other way (an error, a cancel that drops it) gives the reservation
/// back when this is dropped.
pub(super) struct Hold {
    store: Store,
    metrics: Arc<crate::metrics::Metrics>,
    tenant_id: String,
    model: String,
    period: BudgetPeriod,
    /// The configured default budget (tokens, period).
    default: (u64, BudgetPeriod),
    reservation: Reservation,
    settled: bool,
}

impl Hold {
    /// Records the answer's tokens: the day's usage, and the budget's spend.
    pub(super) async fn settle(&mut self, usage: Usage) {
        self.settled = true;
        let now = Utc::now();
        if let Err(error) = self
            .store
            .record_usage(
                &self.tenant_id,
                &self.model,
                (usage.input_tokens, usage.output_tokens),
                self.reservation,
                self.period,
                now,
            )
            .await
        {
            tracing::warn!(tenant = %self.tenant_id, %error, "the usage of an LLM response was not recorded");
            let _ = self
                .store
                .release_budget(&self.tenant_id, self.reservation)
                .await;
            return;
        }
        if matches!(self.reservation, Reservation::Reserved { .. })
            && let Ok(Some(state)) = self
                .store
                .budget_state(&self.tenant_id, self.default, now)
                .await
        {
            self.metrics.budget_used(&self.tenant_id, state.used);
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if self.settled || !matches!(self.reservation, Reservation::Reserved { .. }) {
            return;
        }
        let (store, tenant, reservation) =
            (self.store.clone(), self.tenant_id.clone(), self.reservation);
        tokio::spawn(async move {
            if let Err(error) = store.release_budget(&tenant, reservation).await {
                tracing::warn!(%tenant, %error, "a budget reservation was not given back");
            }
        });
    }
}

fn spent(what: &str, state: &BudgetState) -> Failure {
    Failure::new(
        ErrorKind::Budget,
        format!(
            "{what} has used {} of its {} tokens this {}; it resets at {}",
            state.used,
            state.limit,
            state.period.as_str(),
            state.resets_at.to_rfc3339(),
        ),
    )
}

/// The conversation's budget, then the tenant's: a spent one is a `budget` failure; else
/// `estimate` tokens of the tenant's are held for the request.
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
    let period = match reservation {
        Reservation::Spent(state) => {
            metrics.rejected("budget");
            metrics.budget_used(&job.tenant_id, state.used);
            return Err(spent("the tenant", &state));
        }
        Reservation::Reserved { .. } => shared
            .store
            .tenant_limits(&job.tenant_id)
            .await
            .ok()
            .and_then(|l| l.budget_period)
            .unwrap_or(budgets.period),
        Reservation::Unlimited => budgets.period,
    };
    Ok(Hold {
        store: shared.store.clone(),
        metrics: metrics.clone(),
        tenant_id: job.tenant_id.clone(),
        model: job.model.clone(),
        period,
        default,
        reservation,
        settled: false,
    })
}
