//! `GET /v1/usage`: a tenant's tokens per model over a range of days, and its budget
//! (docs/api.md, "Budgets and limits").

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{Datelike as _, NaiveDate, Utc};

use super::AppState;
use super::auth::Caller;
use super::error::{ApiError, ErrorBody, Query, reply};
use crate::quotas::Quota;
use crate::wire::{Budget, ModelTokens, QuotaUse, UsageQuery, UsageReport};

fn day(text: Option<&str>, name: &str, default: NaiveDate) -> Result<NaiveDate, ApiError> {
    match text {
        None => Ok(default),
        Some(text) => NaiveDate::parse_from_str(text, "%Y-%m-%d").map_err(|_| {
            ApiError::invalid(format!("{name} must be a day as YYYY-MM-DD, not {text:?}"))
        }),
    }
}

/// The tenant's token usage and budget. *Extension.*
#[utoipa::path(get, path = "/usage", tag = "usage",
    params(UsageQuery),
    responses(
        (status = 200, description = "Tokens per model over the days asked for, and the budget", body = UsageReport),
        (status = 400, description = "A day that is not YYYY-MM-DD, or from after to", body = ErrorBody),
    ))]
pub async fn usage(
    State(app): State<AppState>,
    caller: Caller,
    Query(q): Query<UsageQuery>,
) -> Result<Response, ApiError> {
    let now = Utc::now();
    let today = now.date_naive();
    let first = today.with_day0(0).unwrap_or(today);
    let from = day(q.from.as_deref(), "from", first)?;
    let to = day(q.to.as_deref(), "to", today)?;
    if from > to {
        return Err(ApiError::invalid(format!(
            "from ({from}) is after to ({to})"
        )));
    }
    let (from, to) = (from.to_string(), to.to_string());
    let store = &app.store;
    let rows = store.usage(&caller.0.id, &from, &to).await?;
    let budgets = &app.settings.budgets;
    let budget = store
        .budget_state(&caller.0.id, (budgets.tenant_tokens, budgets.period), now)
        .await?;
    if let Some(state) = &budget {
        app.metrics.budget_used(&caller.0.id, state.used);
    }
    Ok(reply(
        StatusCode::OK,
        &UsageReport {
            tenant_id: caller.0.id.clone(),
            input_tokens: rows.iter().map(|r| r.input_tokens).sum(),
            output_tokens: rows.iter().map(|r| r.output_tokens).sum(),
            by_model: rows
                .into_iter()
                .map(|r| {
                    (
                        r.model,
                        ModelTokens {
                            input_tokens: r.input_tokens,
                            output_tokens: r.output_tokens,
                        },
                    )
                })
                .collect(),
            budget: budget.map(|b| Budget {
                limit: b.limit,
                used: b.used,
                period: b.period.as_str(),
                resets_at: b.resets_at,
            }),
            from,
            to,
            quotas: quotas(&app, &caller.0.id).await?,
        },
    ))
}

/// The tenant's quotas and what it holds.
async fn quotas(
    app: &AppState,
    tenant_id: &str,
) -> Result<std::collections::BTreeMap<&'static str, QuotaUse>, ApiError> {
    let mut held = app.quotas.held(tenant_id);
    held.insert(
        Quota::Conversations,
        app.store.conversation_count(tenant_id).await?,
    );
    held.insert(
        Quota::McpServers,
        app.store.mcp_server_count(tenant_id).await?,
    );
    held.insert(Quota::Agents, app.store.agent_count(tenant_id).await?);
    held.insert(Quota::Webhooks, app.store.webhook_count(tenant_id).await?);
    held.insert(Quota::Schedules, app.store.schedule_count(tenant_id).await?);
    held.insert(
        Quota::ConcurrentTurns,
        app.conversations.running_turns(tenant_id, None),
    );
    let mut out = std::collections::BTreeMap::new();
    for quota in Quota::ALL {
        out.insert(
            quota.name(),
            QuotaUse {
                limit: app.quotas.limit(tenant_id, quota).await,
                used: held.get(&quota).copied(),
            },
        );
    }
    Ok(out)
}
