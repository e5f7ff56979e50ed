//! Tenants' schedules (docs/api.md, "Schedules"; issue 39): an agent run on a cron
//! expression, a fixed interval or once, or a message sent to a conversation, with no client
//! connected. The routes make, list, pause, resume and remove them; [`Firing`] runs each
//! node's part: it claims due firings (src/store/schedules.rs: each claimed once) and does
//! their work through this API in process, as the schedule's tenant, keyed by the run, so
//! work taken over from a dead node is not done twice: a new conversation's slug and the
//! message's `message_id` are the run's.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body as HttpBody;
use axum::extract::State;
use axum::http::{Method, Request, StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use super::AppState;
use super::auth::{Caller, InProcess};
use super::error::{ApiError, Body, ErrorBody, Path, Query, reply};
use crate::model::{Schedule, ScheduleRun, Tenant};
use crate::persistence::{WriteJob, WriteOutcome};
use crate::quotas::Quota;
use crate::schedules::{self as times, CatchUp, When, rfc3339};
use crate::store::RunOutcome;
use crate::wire::{
    NewSchedule, RunsQuery, ScheduleList, ScheduleRunList, ScheduleRunView, ScheduleView,
};

/// Runs in flight on a node at once (a run waits mostly on commits and its requests).
const CONCURRENCY: usize = 64;

fn view(schedule: &Schedule) -> ScheduleView {
    ScheduleView {
        id: schedule.id.clone(),
        agent: schedule.agent.clone(),
        conversation_id: schedule.conversation_id.clone(),
        message: schedule.message.clone(),
        cron: schedule.cron.clone(),
        every_ms: schedule.every_ms,
        at: schedule.at_ms.map(rfc3339),
        timezone: schedule.timezone.clone(),
        if_busy: schedule.if_busy.clone(),
        catch_up: schedule.catch_up.clone(),
        enabled: schedule.enabled,
        next_fire_at: schedule
            .next_fire_at
            .filter(|_| schedule.enabled)
            .map(rfc3339),
        last_fire_at: schedule.last_fire_at.map(rfc3339),
        created_at: rfc3339(schedule.created_at),
        updated_at: rfc3339(schedule.updated_at),
    }
}

fn run_view(run: ScheduleRun) -> ScheduleRunView {
    ScheduleRunView {
        fire_at: rfc3339(run.fire_at),
        status: run.status,
        conversation_id: run.conversation_id,
        outcome: run.outcome,
        started_at: run.started_at.map(rfc3339),
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Makes a schedule. *Extension.*
#[utoipa::path(post, path = "/schedules", tag = "schedules",
    request_body = NewSchedule,
    responses(
        (status = 201, description = "Made", body = ScheduleView),
        (status = 400, description = "Not one of agent and conversation_id, not one of cron, every and at, or a bad expression, interval, time, zone or policy", body = ErrorBody),
        (status = 404, description = "No such agent or conversation of the tenant", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: the tenant's `schedules` quota", body = ErrorBody),
    ))]
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    Body(body): Body<NewSchedule>,
) -> Result<Response, ApiError> {
    let tenant_id = caller.0.id.clone();
    match (&body.agent, &body.conversation_id) {
        (Some(agent), None) => {
            super::agents::resolve(&app, &caller, agent).await?;
        }
        (None, Some(id)) => {
            let conv = app.find(&caller, id).await?;
            if conv.parent_id.is_some() {
                return Err(ApiError::invalid(
                    "conversation_id names a sub-agent: schedule its parent",
                ));
            }
        }
        (Some(_), Some(_)) | (None, None) => {
            return Err(ApiError::invalid(
                "give one of agent (a new conversation per firing) and conversation_id",
            ));
        }
    }
    let max_text = app.settings.server.max_text_bytes;
    if body.message.trim().is_empty() || body.message.len() > max_text {
        return Err(ApiError::invalid(format!(
            "message must be 1 to {max_text} bytes of text"
        )));
    }
    let timezone = body.timezone.unwrap_or_else(|| "UTC".to_owned());
    times::time_zone(&timezone).map_err(|e| ApiError::invalid(format!("timezone: {e}")))?;
    let now = now_ms();
    let (cron, every_ms, at_ms) = match (&body.cron, &body.every, &body.at) {
        (Some(expr), None, None) => {
            times::cron(expr).map_err(|e| ApiError::invalid(format!("cron: {e}")))?;
            (Some(expr.clone()), None, None)
        }
        (None, Some(every), None) => {
            let ms = times::every(every).map_err(|e| ApiError::invalid(format!("every: {e}")))?;
            (None, Some(ms), None)
        }
        (None, None, Some(at)) => {
            let at = chrono::DateTime::parse_from_rfc3339(at)
                .map_err(|_| ApiError::invalid("at must be an RFC 3339 time"))?
                .timestamp_millis();
            let late = i64::try_from(app.settings.schedules.late_ms).unwrap_or(i64::MAX);
            if at < now - late {
                return Err(ApiError::invalid("at is in the past"));
            }
            (None, None, Some(at))
        }
        _ => {
            return Err(ApiError::invalid(
                "give one of cron, every (`15m`, down to `1s`) and at (RFC 3339)",
            ));
        }
    };
    let if_busy = body.if_busy.unwrap_or_else(|| "skip".to_owned());
    if !matches!(if_busy.as_str(), "skip" | "enqueue" | "interrupt") {
        return Err(ApiError::invalid(
            "if_busy must be skip, enqueue or interrupt",
        ));
    }
    let catch_up = body.catch_up.unwrap_or_else(|| "none".to_owned());
    if CatchUp::parse(&catch_up).is_none() {
        return Err(ApiError::invalid("catch_up must be none or one"));
    }
    let held = app.store.schedule_count(&tenant_id).await?;
    app.quotas.check(&tenant_id, Quota::Schedules, held).await?;
    let mut schedule = Schedule {
        id: format!("sch_{}", uuid::Uuid::now_v7().simple()),
        tenant_id,
        agent: body.agent,
        conversation_id: body.conversation_id,
        message: body.message,
        cron,
        every_ms,
        at_ms,
        timezone,
        if_busy,
        catch_up,
        enabled: body.enabled.unwrap_or(true),
        next_fire_at: None,
        last_fire_at: None,
        created_at: now,
        updated_at: now,
    };
    schedule.next_fire_at = first_firing(&schedule, now);
    if schedule.next_fire_at.is_none() {
        return Err(ApiError::invalid("the schedule never fires"));
    }
    app.persistence
        .write(WriteJob::CreateSchedule(Box::new(schedule.clone())))
        .await?;
    Ok(reply(StatusCode::CREATED, &view(&schedule)))
}

/// The schedule's first firing from `now` (a one-time one: its time).
fn first_firing(schedule: &Schedule, now: i64) -> Option<i64> {
    match schedule.when()? {
        When::At(at) => Some(at),
        when @ (When::Cron { .. } | When::Every { .. }) => times::next_after(&when, now),
    }
}

/// The tenant's schedules. *Extension.*
#[utoipa::path(get, path = "/schedules", tag = "schedules",
    responses((status = 200, description = "The tenant's schedules, oldest first", body = ScheduleList)))]
pub async fn list(State(app): State<AppState>, caller: Caller) -> Result<Response, ApiError> {
    let schedules = app.store.schedules(Some(&caller.0.id)).await?;
    Ok(reply(
        StatusCode::OK,
        &ScheduleList {
            schedules: schedules.iter().map(view).collect(),
        },
    ))
}

async fn found(app: &AppState, caller: &Caller, id: &str) -> Result<Schedule, ApiError> {
    app.store
        .schedule(&caller.0.id, id)
        .await?
        .ok_or_else(|| ApiError::not_found("schedule"))
}

/// One schedule. *Extension.*
#[utoipa::path(get, path = "/schedules/{id}", tag = "schedules",
    params(("id" = String, Path, description = "The schedule's id")),
    responses(
        (status = 200, description = "The schedule", body = ScheduleView),
        (status = 404, description = "No such schedule of the tenant", body = ErrorBody),
    ))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(reply(
        StatusCode::OK,
        &view(&found(&app, &caller, &id).await?),
    ))
}

/// Removes a schedule and its runs (the conversations it started stay). *Extension.*
#[utoipa::path(delete, path = "/schedules/{id}", tag = "schedules",
    params(("id" = String, Path, description = "The schedule's id")),
    responses(
        (status = 204, description = "Removed"),
        (status = 404, description = "No such schedule of the tenant", body = ErrorBody),
    ))]
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let removed = app
        .persistence
        .write(WriteJob::DeleteSchedule {
            tenant_id: caller.0.id.clone(),
            id,
        })
        .await?;
    ApiError::removed(removed, "schedule")
}

async fn set_enabled(
    app: &AppState,
    caller: &Caller,
    id: &str,
    enabled: bool,
) -> Result<Response, ApiError> {
    let schedule = found(app, caller, id).await?;
    let now = now_ms();
    // Resumed: from its next time after now (what was missed while paused is not run).
    let next = if enabled {
        match schedule.when() {
            Some(When::At(at)) if schedule.last_fire_at.is_none() => Some(at.max(now)),
            Some(When::At(_)) | None => None,
            Some(when @ (When::Cron { .. } | When::Every { .. })) => times::next_after(&when, now),
        }
    } else {
        schedule.next_fire_at
    };
    if enabled && next.is_none() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "schedule_done",
            "the schedule has no firing left (a one-time schedule that fired)",
        ));
    }
    let done = app
        .persistence
        .write(WriteJob::SetScheduleEnabled {
            tenant_id: caller.0.id.clone(),
            id: id.to_owned(),
            enabled,
            next_fire_at: next,
            at: now,
        })
        .await?;
    if done != WriteOutcome::Resolved(true) {
        return Err(ApiError::not_found("schedule"));
    }
    Ok(reply(StatusCode::OK, &view(&found(app, caller, id).await?)))
}

/// Pauses a schedule: it does not fire until resumed. *Extension.*
#[utoipa::path(post, path = "/schedules/{id}/pause", tag = "schedules",
    params(("id" = String, Path, description = "The schedule's id")),
    responses(
        (status = 200, description = "Paused", body = ScheduleView),
        (status = 404, description = "No such schedule of the tenant", body = ErrorBody),
    ))]
pub async fn pause(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    set_enabled(&app, &caller, &id, false).await
}

/// Resumes a schedule from its next time after now (firings while paused are not run).
/// *Extension.*
#[utoipa::path(post, path = "/schedules/{id}/resume", tag = "schedules",
    params(("id" = String, Path, description = "The schedule's id")),
    responses(
        (status = 200, description = "Resumed", body = ScheduleView),
        (status = 404, description = "No such schedule of the tenant", body = ErrorBody),
        (status = 409, description = "`schedule_done`: a one-time schedule that fired", body = ErrorBody),
    ))]
pub async fn resume(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    set_enabled(&app, &caller, &id, true).await
}

/// A schedule's firings, newest first: when, what came of it, the conversation. *Extension.*
#[utoipa::path(get, path = "/schedules/{id}/runs", tag = "schedules",
    params(("id" = String, Path, description = "The schedule's id"), RunsQuery),
    responses(
        (status = 200, description = "Its runs", body = ScheduleRunList),
        (status = 400, description = "A bad limit", body = ErrorBody),
        (status = 404, description = "No such schedule of the tenant", body = ErrorBody),
    ))]
pub async fn runs(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<RunsQuery>,
) -> Result<Response, ApiError> {
    found(&app, &caller, &id).await?;
    let limit = query.limit.unwrap_or(100);
    if !(1..=500).contains(&limit) {
        return Err(ApiError::invalid("limit must be 1 to 500"));
    }
    let runs = app.store.schedule_runs(&caller.0.id, &id, limit).await?;
    Ok(reply(
        StatusCode::OK,
        &ScheduleRunList {
            runs: runs.into_iter().map(run_view).collect(),
        },
    ))
}

/// Each node's firing of schedules: claims due firings, runs them, writes what came of
/// each.
#[derive(Debug)]
pub struct Firing {
    app: AppState,
    /// The API without its outer checks (Host, Origin), which in-process requests skip.
    api: Router,
    /// This process's claims.
    claimer: String,
    /// Runs handed to this node by others (its conversations' firings): `node:<id>`.
    node_token: String,
}

/// What a firing's work came to.
enum Worked {
    Done(&'static str, Option<String>, String),
    /// The conversation runs on this node of a cluster: the run goes to it.
    HandOff(String),
}

impl Firing {
    /// Starts this node's firing; it stops with `stop`.
    pub fn start(app: AppState, api: Router, stop: CancellationToken) {
        let node = app
            .cluster
            .as_ref()
            .map_or_else(|| "local".to_owned(), |node| node.node_id.clone());
        let firing = Arc::new(Firing {
            claimer: format!("{node}/{}", uuid::Uuid::now_v7().simple()),
            node_token: format!("node:{node}"),
            app,
            api,
        });
        tokio::spawn(firing.run(stop));
    }

    async fn run(self: Arc<Self>, stop: CancellationToken) {
        let settings = self.app.settings.schedules.clone();
        let poll = Duration::from_millis(settings.poll_ms);
        let mut running: JoinSet<(i64, String)> = JoinSet::new();
        let mut flying: HashSet<(String, i64)> = HashSet::new();
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(poll) => {}
                Some(Ok((fire_at, id))) = running.join_next() => {
                    flying.remove(&(id, fire_at));
                }
            }
            while let Some(done) = running.try_join_next() {
                if let Ok((fire_at, id)) = done {
                    flying.remove(&(id, fire_at));
                }
            }
            let now = now_ms();
            // A read first: a node with nothing due writes nothing.
            match self.app.store.schedules_due_at(&self.node_token).await {
                Ok(Some(at)) if at <= now => {}
                Ok(_) if flying.is_empty() => continue,
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "schedules not read");
                    continue;
                }
            }
            let claim = self
                .app
                .persistence
                .write(WriteJob::ClaimScheduleFirings {
                    claimed_by: self.claimer.clone(),
                    now,
                    until: now.saturating_add(ms(settings.claim_ms)),
                    late_ms: ms(settings.late_ms),
                    // No more than can start now: what is claimed is read every poll.
                    limit: settings
                        .batch
                        .min(CONCURRENCY.saturating_sub(flying.len()) as u64),
                })
                .await;
            if let Err(e) = claim {
                tracing::warn!(error = %e, "schedules' firings could not be claimed");
                continue;
            }
            let mine = match self
                .app
                .store
                .claimed_runs(&self.claimer, &self.node_token)
                .await
            {
                Ok(mine) => mine,
                Err(e) => {
                    tracing::warn!(error = %e, "claimed firings could not be read");
                    continue;
                }
            };
            for (run, schedule) in mine {
                let key = (schedule.id.clone(), run.fire_at);
                if flying.len() >= CONCURRENCY || flying.contains(&key) {
                    continue;
                }
                flying.insert(key);
                let this = Arc::clone(&self);
                let span = tracing::info_span!("schedule firing", tenant = %schedule.tenant_id,
                    schedule = %schedule.id, fire_at = %rfc3339(run.fire_at));
                running.spawn(tracing::Instrument::instrument(
                    async move {
                        let fire_at = run.fire_at;
                        let id = schedule.id.clone();
                        this.fire(&run, &schedule).await;
                        (fire_at, id)
                    },
                    span,
                ));
            }
        }
        running.abort_all();
    }

    /// Runs one firing and writes what came of it.
    async fn fire(&self, run: &ScheduleRun, schedule: &Schedule) {
        let tenant = Tenant {
            id: schedule.tenant_id.clone(),
            name: String::new(),
        };
        let now = now_ms();
        let (status, conversation_id, outcome) = match self.work(&tenant, run, schedule).await {
            Worked::Done(status, conversation, outcome) => (status, conversation, outcome),
            Worked::HandOff(owner) => {
                let until = now.saturating_add(ms(self.app.settings.schedules.claim_ms));
                let handed = self
                    .app
                    .persistence
                    .write(WriteJob::HandOffScheduleRun {
                        schedule_id: schedule.id.clone(),
                        fire_at: run.fire_at,
                        from: (self.claimer.clone(), self.node_token.clone()),
                        to: format!("node:{owner}"),
                        until,
                    })
                    .await;
                if let Err(e) = handed {
                    tracing::warn!(error = %e, "a firing could not be handed to its conversation's node");
                }
                return;
            }
        };
        self.app
            .metrics
            .schedule_firing(status, (now - run.fire_at) as f64 / 1000.0);
        if status == "failed" {
            tracing::warn!(schedule = %schedule.id, %outcome, "a schedule's firing failed");
        }
        let finished = self
            .app
            .persistence
            .write(WriteJob::FinishScheduleRun(Box::new(RunOutcome {
                schedule_id: schedule.id.clone(),
                fire_at: run.fire_at,
                claimed_by: self.claimer.clone(),
                node_token: self.node_token.clone(),
                status,
                conversation_id,
                outcome,
                at: now,
            })))
            .await;
        if let Err(e) = finished {
            // Taken over when the claim runs out; the work is keyed by the run.
            tracing::warn!(error = %e, "a firing's outcome could not be stored");
        }
    }

    /// The firing's work: a conversation of the agent (made once: its slug is the run's)
    /// and the message (sent once: its `message_id` is the run's), or the message to the
    /// schedule's conversation under its `if_busy`.
    async fn work(&self, tenant: &Tenant, run: &ScheduleRun, schedule: &Schedule) -> Worked {
        let key = format!("{}@{}", schedule.id, run.fire_at);
        let conversation = match (&schedule.agent, &schedule.conversation_id) {
            (Some(agent), _) => {
                let slug = format!("{}-{}", schedule.id.replace('_', "-"), run.fire_at);
                let (status, body) = self
                    .call(
                        tenant,
                        Method::POST,
                        "/v1/conversations",
                        Some(json!({"agent": agent, "slug": slug})),
                    )
                    .await;
                match status {
                    201 => body["id"].as_str().map(str::to_owned),
                    // Made already, by the node that died doing this run.
                    409 if body["error"]["code"] == "slug_taken" => {
                        let (_, found) = self
                            .call(
                                tenant,
                                Method::GET,
                                &format!("/v1/conversations/{slug}"),
                                None,
                            )
                            .await;
                        found["id"].as_str().map(str::to_owned)
                    }
                    _ => return Worked::Done("failed", None, error_text(status, &body)),
                }
            }
            (None, Some(id)) => Some(id.clone()),
            (None, None) => None,
        };
        let Some(conversation) = conversation else {
            return Worked::Done("failed", None, "no conversation to send to".to_owned());
        };
        let if_busy = match schedule.if_busy.as_str() {
            "enqueue" => "enqueue",
            "interrupt" => "interrupt",
            _ => "reject",
        };
        let (status, body) = self
            .call(
                tenant,
                Method::POST,
                &format!("/v1/conversations/{conversation}/messages?if_busy={if_busy}"),
                Some(json!({"text": schedule.message, "message_id": key})),
            )
            .await;
        // On a cluster, a conversation another node runs is that node's to send to.
        if status == 503
            && let Some(cluster) = &self.app.cluster
            && let Ok(Some(owner)) = self
                .app
                .store
                .live_owner(&conversation, cluster.node())
                .await
        {
            return Worked::HandOff(owner.node);
        }
        let conversation = Some(conversation);
        let (status, outcome) = match status {
            200 => ("started", "sent before (a repeat)".to_owned()),
            202 if body.get("queued").is_some() => {
                ("queued", "queued behind the running turn".to_owned())
            }
            202 => ("started", "the turn started".to_owned()),
            409 if body["error"]["code"] == "agent_busy" => (
                "skipped",
                "the conversation was busy (if_busy: skip)".to_owned(),
            ),
            _ => ("failed", error_text(status, &body)),
        };
        Worked::Done(status, conversation, outcome)
    }

    /// A request to this node's API in process, as `tenant`.
    async fn call(
        &self,
        tenant: &Tenant,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::CONTENT_TYPE, "application/json")
            .extension(InProcess(tenant.clone()))
            .body(HttpBody::from(
                body.map(|b| b.to_string()).unwrap_or_default(),
            ));
        let Ok(request) = request else {
            return (500, Value::Null);
        };
        let Ok(response) = self.api.clone().oneshot(request).await;
        let status = response.status().as_u16();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap_or_default();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }
}

fn error_text(status: u16, body: &Value) -> String {
    format!(
        "HTTP {status}: {}",
        body["error"]["message"].as_str().unwrap_or("no answer")
    )
}

fn ms(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
