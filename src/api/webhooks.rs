//! Tenants' webhook endpoints (docs/api.md, "Webhooks"; issue 39): made, listed, changed,
//! removed, their secret rotated, their deliveries listed and sent again. The secret is
//! shown only when it is made. A URL is checked against the egress policy here, and again
//! at every connection (src/webhooks/dispatch.rs).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;

use super::AppState;
use super::auth::Caller;
use super::error::{ApiError, Body, ErrorBody, Path, Query, reply};
use crate::model::{Webhook, WebhookDelivery};
use crate::persistence::{WriteJob, WriteOutcome};
use crate::quotas::Quota;
use crate::store::WebhookChange;
use crate::wire::{
    DeliveriesQuery, DeliveryAttempt, DeliveryList, DeliveryView, NewWebhook, WebhookList,
    WebhookPatch, WebhookView,
};

/// The most deliveries a page lists, and the default.
const MAX_PAGE: u64 = 200;
const DEFAULT_PAGE: u64 = 50;

fn time(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

fn view(hook: &Webhook, secret: Option<String>) -> WebhookView {
    WebhookView {
        id: hook.id.clone(),
        url: hook.url.clone(),
        events: hook.events.clone(),
        description: hook.description.clone(),
        enabled: hook.enabled,
        disabled_reason: hook.disabled_reason.clone(),
        failing_since: hook.failing_since.map(time),
        created_at: time(hook.created_at),
        updated_at: time(hook.updated_at),
        secret,
    }
}

fn delivery_view(delivery: WebhookDelivery) -> DeliveryView {
    let log: Vec<serde_json::Value> =
        serde_json::from_str(&delivery.attempts_log).unwrap_or_default();
    let attempt_log = log
        .iter()
        .map(|entry| DeliveryAttempt {
            at: time(entry["at"].as_i64().unwrap_or_default()),
            status: entry["status"].as_u64().and_then(|s| u16::try_from(s).ok()),
            error: entry["error"].as_str().map(str::to_owned),
            latency_ms: entry["latency_ms"].as_i64().unwrap_or_default(),
            excerpt: entry["excerpt"].as_str().map(str::to_owned),
        })
        .collect();
    let data = serde_json::from_str(&delivery.payload).unwrap_or_default();
    DeliveryView {
        next_attempt_at: (delivery.status == "pending").then(|| time(delivery.next_attempt_at)),
        id: delivery.id,
        webhook_id: delivery.webhook_id,
        event_type: delivery.event_type,
        conversation_id: delivery.conversation_id,
        status: delivery.status,
        attempts: delivery.attempts,
        expires_at: time(delivery.expires_at),
        last_status: delivery.last_status,
        last_error: delivery.last_error,
        last_latency_ms: delivery.last_latency_ms,
        attempt_log,
        data,
        created_at: time(delivery.created_at),
        updated_at: time(delivery.updated_at),
    }
}

/// A URL an endpoint may have: http or https, a host, no credentials, at most 2048 bytes,
/// and allowed by the egress policy now (it is checked again at every connection).
async fn checked_url(app: &AppState, given: &str) -> Result<String, ApiError> {
    let url = url::Url::parse(given)
        .ok()
        .filter(|u| {
            given.len() <= 2048 && matches!(u.scheme(), "http" | "https") && u.host().is_some()
        })
        .ok_or_else(|| {
            ApiError::invalid("url must be an http:// or https:// URL of at most 2048 bytes")
        })?;
    app.egress.check_url(&url).await.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "egress_refused",
            format!("url: {e}"),
        )
    })?;
    Ok(url.to_string())
}

/// The events asked for: at least one, each known, each once.
fn checked_events(given: Vec<String>) -> Result<Vec<String>, ApiError> {
    let mut events = Vec::new();
    for event in given {
        if !crate::webhooks::EVENTS.contains(&event.as_str()) {
            return Err(ApiError::invalid(format!(
                "events: {event:?} is not an event; the events are {}",
                crate::webhooks::EVENTS.join(", ")
            )));
        }
        if !events.contains(&event) {
            events.push(event);
        }
    }
    if events.is_empty() {
        return Err(ApiError::invalid("events must name at least one event"));
    }
    Ok(events)
}

fn checked_description(given: Option<String>) -> Result<Option<String>, ApiError> {
    match given {
        Some(d) if d.len() > 256 => Err(ApiError::invalid("description must be at most 256 bytes")),
        Some(d) if d.is_empty() => Ok(None),
        other => Ok(other),
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Makes a webhook endpoint; its signing secret is in this answer only. *Extension.*
#[utoipa::path(post, path = "/webhooks", tag = "webhooks",
    request_body = NewWebhook,
    responses(
        (status = 201, description = "Made; `secret` is shown this once", body = WebhookView),
        (status = 400, description = "A bad URL, event or description (`invalid_request`), or a URL the egress policy refuses (`egress_refused`)", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: the tenant's `webhooks` quota", body = ErrorBody),
    ))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Body(body): Body<NewWebhook>,
) -> Result<Response, ApiError> {
    let tenant_id = caller.0.id.clone();
    let url = checked_url(&app, &body.url).await?;
    let events = checked_events(body.events)?;
    let description = checked_description(body.description)?;
    let held = app.store.webhook_count(&tenant_id).await?;
    app.quotas.check(&tenant_id, Quota::Webhooks, held).await?;
    let secret = crate::webhooks::new_secret();
    let now = now_ms();
    let enabled = body.enabled.unwrap_or(true);
    let hook = Webhook {
        id: format!("wh_{}", uuid::Uuid::now_v7().simple()),
        tenant_id: tenant_id.clone(),
        url,
        events,
        description,
        enabled,
        disabled_reason: (!enabled).then(|| "disabled by its owner".to_owned()),
        secret: secret.clone().into(),
        previous_secret: None,
        previous_secret_until: None,
        failing_since: None,
        created_at: now,
        updated_at: now,
    };
    app.persistence
        .write(WriteJob::CreateWebhook(Box::new(hook.clone())))
        .await?;
    known_again(&app, &tenant_id).await;
    Ok(reply(StatusCode::CREATED, &view(&hook, Some(secret))))
}

/// The tenant's webhook endpoints (no secret). *Extension.*
#[utoipa::path(get, path = "/webhooks", tag = "webhooks",
    responses((status = 200, description = "The tenant's endpoints, oldest first", body = WebhookList)))]
pub async fn list(State(app): State<AppState>, caller: Caller) -> Result<Response, ApiError> {
    let hooks = app.store.webhooks(&caller.0.id).await?;
    Ok(reply(
        StatusCode::OK,
        &WebhookList {
            webhooks: hooks.iter().map(|hook| view(hook, None)).collect(),
        },
    ))
}

async fn found(app: &AppState, caller: &Caller, id: &str) -> Result<Webhook, ApiError> {
    app.store
        .webhook(&caller.0.id, id)
        .await?
        .ok_or_else(|| ApiError::not_found("webhook"))
}

/// One webhook endpoint (no secret). *Extension.*
#[utoipa::path(get, path = "/webhooks/{id}", tag = "webhooks",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 200, description = "The endpoint", body = WebhookView),
        (status = 404, description = "No such endpoint of the tenant", body = ErrorBody),
    ))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let hook = found(&app, &caller, &id).await?;
    Ok(reply(StatusCode::OK, &view(&hook, None)))
}

/// Changes an endpoint's URL, events, description, or whether it is enabled. *Extension.*
#[utoipa::path(patch, path = "/webhooks/{id}", tag = "webhooks",
    params(("id" = String, Path, description = "The endpoint's id")),
    request_body = WebhookPatch,
    responses(
        (status = 200, description = "Changed", body = WebhookView),
        (status = 400, description = "A bad URL, event or description (`invalid_request`, `egress_refused`)", body = ErrorBody),
        (status = 404, description = "No such endpoint of the tenant", body = ErrorBody),
    ))]
pub async fn update(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Body(body): Body<WebhookPatch>,
) -> Result<Response, ApiError> {
    found(&app, &caller, &id).await?;
    let url = match body.url {
        Some(url) => Some(checked_url(&app, &url).await?),
        None => None,
    };
    let change = WebhookChange {
        url,
        events: body.events.map(checked_events).transpose()?,
        description: match body.description {
            Some(d) => Some(checked_description(Some(d))?),
            None => None,
        },
        enabled: body.enabled,
    };
    let changed = app
        .persistence
        .write(WriteJob::UpdateWebhook {
            tenant_id: caller.0.id.clone(),
            id: id.clone(),
            change,
            at: now_ms(),
        })
        .await?;
    if changed != WriteOutcome::Resolved(true) {
        return Err(ApiError::not_found("webhook"));
    }
    known_again(&app, &caller.0.id).await;
    let hook = found(&app, &caller, &id).await?;
    Ok(reply(StatusCode::OK, &view(&hook, None)))
}

/// Removes an endpoint and its deliveries. *Extension.*
#[utoipa::path(delete, path = "/webhooks/{id}", tag = "webhooks",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 204, description = "Removed"),
        (status = 404, description = "No such endpoint of the tenant", body = ErrorBody),
    ))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let removed = app
        .persistence
        .write(WriteJob::DeleteWebhook {
            tenant_id: caller.0.id.clone(),
            id,
        })
        .await?;
    known_again(&app, &caller.0.id).await;
    ApiError::removed(removed, "webhook")
}

/// The tenant's endpoints read again after one changed here: its next event goes to the
/// endpoint as it is now (other nodes read them again within a second).
async fn known_again(app: &AppState, tenant_id: &str) {
    if let Err(e) = app.webhooks.refresh_tenant(&app.store, tenant_id).await {
        tracing::warn!(error = %e, "webhook endpoints not read again");
    }
}

/// A new signing secret, shown in this answer only; the previous one keeps signing beside
/// it (a second `v1,` signature) for `webhooks.rotation_overlap_ms` (a day by default), so
/// receivers can move over. *Extension.*
#[utoipa::path(post, path = "/webhooks/{id}/rotate_secret", tag = "webhooks",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 200, description = "Rotated; `secret` is the new one", body = WebhookView),
        (status = 404, description = "No such endpoint of the tenant", body = ErrorBody),
    ))]
pub async fn rotate_secret(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let secret = crate::webhooks::new_secret();
    let now = now_ms();
    let grace = i64::try_from(app.settings.webhooks.rotation_overlap_ms).unwrap_or(i64::MAX);
    let rotated = app
        .persistence
        .write(WriteJob::RotateWebhookSecret {
            tenant_id: caller.0.id.clone(),
            id: id.clone(),
            secret: secret.clone().into(),
            previous_until: now.saturating_add(grace),
            at: now,
        })
        .await?;
    if rotated != WriteOutcome::Resolved(true) {
        return Err(ApiError::not_found("webhook"));
    }
    known_again(&app, &caller.0.id).await;
    let hook = found(&app, &caller, &id).await?;
    Ok(reply(StatusCode::OK, &view(&hook, Some(secret))))
}

/// An endpoint's deliveries, newest first, with their attempts. *Extension.*
#[utoipa::path(get, path = "/webhooks/{id}/deliveries", tag = "webhooks",
    params(("id" = String, Path, description = "The endpoint's id"), DeliveriesQuery),
    responses(
        (status = 200, description = "A page of deliveries", body = DeliveryList),
        (status = 400, description = "A bad status or limit", body = ErrorBody),
        (status = 404, description = "No such endpoint of the tenant", body = ErrorBody),
    ))]
pub async fn deliveries(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<DeliveriesQuery>,
) -> Result<Response, ApiError> {
    found(&app, &caller, &id).await?;
    if let Some(status) = &query.status
        && !matches!(status.as_str(), "pending" | "succeeded" | "failed")
    {
        return Err(ApiError::invalid(
            "status must be pending, succeeded or failed",
        ));
    }
    let limit = query.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::invalid("limit must be 1 to 200"));
    }
    let page = app
        .store
        .webhook_deliveries(
            &caller.0.id,
            &id,
            query.status.as_deref(),
            query.cursor.as_deref(),
            limit + 1,
        )
        .await?;
    let more = page.len() as u64 > limit;
    let mut deliveries: Vec<DeliveryView> = page
        .into_iter()
        .take(usize::try_from(limit).unwrap_or(usize::MAX))
        .map(delivery_view)
        .collect();
    let next_cursor = more
        .then(|| deliveries.last().map(|d| d.id.clone()))
        .flatten();
    deliveries.shrink_to_fit();
    Ok(reply(
        StatusCode::OK,
        &DeliveryList {
            deliveries,
            next_cursor,
        },
    ))
}

/// Sends a delivery again now (a failed one too), retried as a new one would be.
/// *Extension.*
#[utoipa::path(post, path = "/webhooks/{id}/deliveries/{delivery_id}/retry", tag = "webhooks",
    params(
        ("id" = String, Path, description = "The endpoint's id"),
        ("delivery_id" = String, Path, description = "The delivery's id (its `webhook-id`)"),
    ),
    responses(
        (status = 202, description = "Due now", body = DeliveryView),
        (status = 404, description = "No such endpoint or delivery of the tenant", body = ErrorBody),
        (status = 409, description = "`webhook_disabled`: enable the endpoint first", body = ErrorBody),
    ))]
pub async fn retry(
    State(app): State<AppState>,
    caller: Caller,
    Path((id, delivery_id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let hook = found(&app, &caller, &id).await?;
    if !hook.enabled {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "webhook_disabled",
            "the endpoint is disabled: enable it (PATCH enabled: true) first",
        ));
    }
    let retry_for = i64::try_from(app.settings.webhooks.retry_for_ms).unwrap_or(i64::MAX);
    let done = app
        .persistence
        .write(WriteJob::RetryWebhookDelivery {
            tenant_id: caller.0.id.clone(),
            webhook_id: id.clone(),
            id: delivery_id.clone(),
            now: now_ms(),
            retry_for_ms: retry_for,
        })
        .await?;
    if done != WriteOutcome::Resolved(true) {
        return Err(ApiError::not_found("delivery"));
    }
    app.webhooks.wake();
    let delivery = app
        .store
        .webhook_delivery(&caller.0.id, &id, &delivery_id)
        .await?
        .ok_or_else(|| ApiError::not_found("delivery"))?;
    Ok(reply(StatusCode::ACCEPTED, &delivery_view(delivery)))
}
