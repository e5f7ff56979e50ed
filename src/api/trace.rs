//! A conversation's trace (docs/api.md, "Trace"; issue 40): each step of its core re-run
//! from the replay log, with the event, the states before and after and the effects.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;

use super::AppState;
use super::auth::Caller;
use super::error::{ApiError, ErrorBody, Path, Query, reply};
use crate::wire::{TraceList, TraceQuery, TraceStepView};

const DEFAULT_PAGE: u64 = 100;
const MAX_PAGE: u64 = 500;

/// The steps of a conversation's core, in order, re-run from its replay log. *Extension.*
#[utoipa::path(get, path = "/conversations/{id}/trace", tag = "conversations",
    params(("id" = String, Path, description = "The conversation's id or slug"), TraceQuery),
    responses(
        (status = 200, description = "A page of steps", body = TraceList),
        (status = 400, description = "A bad limit or cursor", body = ErrorBody),
        (status = 404, description = "No such conversation of the tenant", body = ErrorBody),
    ))]
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<TraceQuery>,
) -> Result<Response, ApiError> {
    let conv = app.target(&caller, &id).await?;
    let limit = query.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::invalid("limit must be 1 to 500"));
    }
    let after = query.after.unwrap_or(0);
    if after < 0 {
        return Err(ApiError::invalid("after must be a step number (0 or more)"));
    }
    // The steps up to one past the page (whether more follow), from the first.
    let upto = after
        .saturating_add(i64::try_from(limit).unwrap_or(i64::MAX))
        .saturating_add(1);
    // A trace re-runs the core over the conversation's log: off the async workers, and a
    // few at a time on a node, one of them a tenant's, so that no tenant's traces take the
    // node's cores or keep others' waiting.
    let _mine = app.quotas.trace_slot(&caller.0.id).await;
    static RUNNING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);
    let _permit = RUNNING
        .acquire()
        .await
        .map_err(|_| ApiError::unavailable("shutting down"))?;
    let rows = app.store.steps_of(&conv.id, upto).await?;
    let messages = app
        .store
        .message_contents(&conv.id, &crate::replay::referenced(&rows))
        .await?;
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    let page = tokio::task::spawn_blocking(move || {
        let lookup = |seq: i64| messages.get(&seq).cloned();
        crate::replay::trace(&rows, &lookup, after, limit)
    })
    .await
    .map_err(|_| ApiError::unavailable("the trace could not be made; try again"))?;
    let next_cursor = page
        .more
        .then(|| page.steps.last().map_or(after, |step| step.step));
    let divergence = page.divergence.map(|d| crate::wire::TraceDivergence {
        step: d.step,
        reason: d.reason,
    });
    let skipped = page.skipped;
    let steps = page
        .steps
        .into_iter()
        .map(|step| {
            let (kind, message) = crate::replay::event_kind(&step.event);
            TraceStepView {
                step: step.step,
                at: crate::schedules::rfc3339(step.at),
                kind,
                message,
                event: step.event,
                state_before: step.state_before,
                state_after: step.state_after,
                effects: step.effects,
                same: step.matches,
            }
        })
        .collect();
    Ok(reply(
        StatusCode::OK,
        &TraceList {
            steps,
            skipped,
            next_cursor,
            divergence,
        },
    ))
}
