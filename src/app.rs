//! The application: wires settings, store, actor tree and HTTP server together, and the
//! commands of the `bedrock` binary. Tests build it on port 0.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chrono::Utc;
use tokio_util::sync::CancellationToken;

use crate::api::{self, AppState, DEV_TENANT};
use crate::config::Settings;
use crate::metrics::Metrics;
use crate::model::Tenant;
use crate::persistence::WriteJob;
use crate::runtime::{RecoveryReport, Runtime};
use crate::store::{Store, StoreOptions};

/// Connects to the configured database and applies the migrations.
pub async fn open_store(settings: &Settings) -> anyhow::Result<Store> {
    crate::install_crypto();
    let url = settings.database_url();
    let store = Store::connect(&StoreOptions {
        url,
        max_connections: settings.database.max_connections,
        acquire_timeout: Duration::from_millis(settings.database.acquire_timeout_ms),
    })
    .await
    .context("cannot connect to the database (database.url / BEDROCK_DATABASE_URL)")?;
    store.migrate().await.context("the migrations failed")?;
    store
        .index_frames_by_age(settings.events.retention().is_some())
        .await
        .context("cannot index the stored frames for [events] retain")?;
    Ok(store)
}

/// The TCP port of a Postgres URL (none for SQLite).
fn database_port(url: &str) -> Option<u16> {
    let url = url::Url::parse(url).ok()?;
    matches!(url.scheme(), "postgres" | "postgresql").then(|| url.port().unwrap_or(5432))
}

/// A built, bound, not yet serving application.
#[derive(Debug)]
pub struct Application {
    pub addr: SocketAddr,
    pub runtime: Runtime,
    pub recovery: RecoveryReport,
    /// The operator listener's address (`[metrics] listen`), if it is on.
    pub metrics_addr: Option<SocketAddr>,
    /// The cap on open client connections in force (`server.max_connections`, or derived
    /// from the open-file limit).
    pub max_connections: usize,
    listener: tokio::net::TcpListener,
    metrics_listener: Option<tokio::net::TcpListener>,
    state: AppState,
    shutdown: CancellationToken,
}

impl Application {
    /// Opens the store, starts the actor tree (running restart recovery) and binds.
    pub async fn build(settings: Settings) -> anyhow::Result<Application> {
        Self::build_with(settings, Arc::new(Metrics::default())).await
    }

    /// [`build`](Self::build) with the process's metrics (see `telemetry::init`).
    pub async fn build_with(
        settings: Settings,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Application> {
        let settings = Arc::new(settings);
        let dev = api::resolve_auth(settings.server.auth, settings.server.listen)
            .map_err(anyhow::Error::msg)?;
        let store = open_store(&settings).await?;
        let root = &settings.workspace.root;
        std::fs::create_dir_all(root)
            .with_context(|| format!("cannot create the workspace root {}", root.display()))?;
        let workspace_root: PathBuf = root
            .canonicalize()
            .with_context(|| format!("cannot resolve the workspace root {}", root.display()))?;
        let listener = tokio::net::TcpListener::bind(settings.server.listen)
            .await
            .with_context(|| format!("cannot listen on {}", settings.server.listen))?;
        let addr = listener.local_addr()?;
        let nofile = crate::server::raise_open_file_limit();
        let max_connections = settings.server.connection_cap(
            nofile,
            settings.database.max_connections,
            settings.llm.max_concurrency,
        );
        anyhow::ensure!(
            (max_connections as u64) < nofile,
            "server.max_connections ({max_connections}) must be below the open-file limit ({nofile}), with room for the database, LLM connections and tools"
        );
        tracing::info!(max_connections, open_file_limit = nofile, "connection cap");
        let metrics_listener = match settings.metrics.address()? {
            Some(at) => Some(
                tokio::net::TcpListener::bind(at)
                    .await
                    .with_context(|| format!("cannot listen on {at} (metrics.listen)"))?,
            ),
            None => None,
        };
        let metrics_addr = match &metrics_listener {
            Some(listener) => Some(listener.local_addr()?),
            None => None,
        };
        // On Postgres every node is a node of a cluster, one node being the smallest.
        let cluster = (store.backend() == sea_orm::DbBackend::Postgres).then(|| {
            Arc::new(crate::node::Cluster::new(
                &settings.cluster,
                addr,
                &settings.data.dir,
            ))
        });
        let (runtime, recovery) = Runtime::start_node(
            settings.clone(),
            store.clone(),
            Arc::new(crate::wire::Frames),
            metrics,
            cluster,
        )
        .await?;
        // On a cluster: the heartbeat, the frames across nodes and the start-up takeover,
        // before the first request.
        if let Some(node) = crate::cluster::Handles::of(&runtime) {
            crate::cluster::start(&node).await?;
        }
        if recovery != RecoveryReport::default() {
            tracing::info!(?recovery, "restart recovery");
        }
        let dev_tenant = if dev {
            Some(dev_tenant(&runtime, &store).await?)
        } else {
            None
        };
        if let Some(sandbox) = &runtime.tool_limits.sandbox {
            sandbox.check_port(addr.port(), "Bedrock's API (server.listen)")?;
            if let Some(at) = metrics_addr {
                sandbox.check_port(at.port(), "the operator listener (metrics.listen)")?;
            }
            if let Some(port) = database_port(&settings.database_url()) {
                sandbox.check_port(port, "the database (database.url)")?;
            }
        }
        let shutdown = CancellationToken::new();
        let state = AppState::new(&runtime, dev_tenant, workspace_root, shutdown.clone());
        Ok(Application {
            addr,
            runtime,
            recovery,
            metrics_addr,
            max_connections,
            listener,
            metrics_listener,
            state,
            shutdown,
        })
    }

    /// A token that stops the server gracefully when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Serves until the shutdown token fires, then shuts down within the grace period: stop
    /// accepting, close live streams, interrupt running turns, let commits land.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let settings = &self.state.settings.server;
        let grace = Duration::from_millis(settings.shutdown_grace_ms);
        let metrics = self.runtime.metrics.clone();
        let limits = crate::server::Limits::of(settings, self.max_connections);
        let router = api::router(self.state.clone());
        // Schedules fire on every node (each firing once: src/api/schedules.rs).
        api::schedules::Firing::start(
            self.state.clone(),
            api::api_router(self.state.clone()),
            self.shutdown.clone(),
        );
        let server = tokio::spawn(crate::server::serve(
            self.listener,
            router,
            limits.clone(),
            metrics.clone(),
            self.shutdown.clone(),
            "api",
        ));
        let operator = self.metrics_listener.map(|listener| {
            let limits = crate::server::Limits {
                max_connections: OPERATOR_CONNECTIONS,
                ..limits
            };
            tokio::spawn(crate::server::serve(
                listener,
                api::operator_router(self.state.clone()),
                limits,
                metrics,
                self.shutdown.clone(),
                "operator",
            ))
        });
        self.shutdown.cancelled().await;
        tracing::info!("shutting down");
        self.runtime.shutdown(grace).await;
        let servers = async {
            server.await?;
            if let Some(operator) = operator {
                operator.await?;
            }
            Ok::<_, tokio::task::JoinError>(())
        };
        match tokio::time::timeout(grace, servers).await {
            Ok(result) => result?,
            Err(_) => {
                tracing::warn!("connections still open after the grace period; exiting anyway")
            }
        }
        Ok(())
    }
}

/// Connections the operator listener takes at once (scrapers and an operator's curl).
const OPERATOR_CONNECTIONS: usize = 64;

async fn dev_tenant(runtime: &Runtime, store: &Store) -> anyhow::Result<Tenant> {
    if let Some(tenant) = store.tenant_by_name(DEV_TENANT).await? {
        return Ok(tenant);
    }
    let tenant = Tenant {
        id: uuid::Uuid::now_v7().to_string(),
        name: DEV_TENANT.into(),
    };
    runtime
        .persistence
        .write(WriteJob::EnsureTenant {
            tenant: tenant.clone(),
            at: Utc::now(),
        })
        .await?;
    // Another process may have created it first: read back whichever won.
    Ok(store.tenant_by_name(DEV_TENANT).await?.unwrap_or(tenant))
}

/// `bedrock tenant create NAME`: the tenant's id and its first API key, shown once.
/// `bedrock tenant budget`: the tenant's own budget (`tokens: None`: the default again);
/// returns the budget that now applies, as JSON.
pub async fn set_tenant_budget(
    settings: &Settings,
    name: &str,
    tokens: Option<u64>,
    period: Option<crate::config::BudgetPeriod>,
) -> anyhow::Result<serde_json::Value> {
    let store = open_store(settings).await?;
    let tenant = store
        .tenant_by_name(name)
        .await?
        .with_context(|| format!("no tenant is named {name:?}"))?;
    let effective = period.unwrap_or(settings.budgets.period);
    let now = Utc::now();
    store
        .set_tenant_budget(
            &tenant.id,
            tokens,
            tokens.and(Some(effective)),
            effective,
            now,
        )
        .await?;
    let state = store
        .budget_state(
            &tenant.id,
            (settings.budgets.tenant_tokens, settings.budgets.period),
            now,
        )
        .await?;
    store.close().await?;
    Ok(serde_json::json!({
        "tenant_id": tenant.id,
        "budget": state.map(|b| serde_json::json!({
            "limit": b.limit, "used": b.used, "period": b.period.as_str(),
            "resets_at": b.resets_at.to_rfc3339(),
        })),
    }))
}

/// `bedrock tenant rate`: the tenant's own request rate (`None`: the default again);
/// returns the rate that now applies, as JSON. Servers pick it up within a minute.
pub async fn set_tenant_rate(
    settings: &Settings,
    name: &str,
    per_second: Option<f64>,
    burst: Option<u32>,
) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(
        per_second.is_none_or(|r| r.is_finite() && r >= 0.0),
        "--per-second must be a number of requests, 0 or more"
    );
    let store = open_store(settings).await?;
    let tenant = store
        .tenant_by_name(name)
        .await?
        .with_context(|| format!("no tenant is named {name:?}"))?;
    store.set_tenant_rate(&tenant.id, per_second, burst).await?;
    store.close().await?;
    let limits = &settings.rate_limits;
    Ok(serde_json::json!({
        "tenant_id": tenant.id,
        "per_second": per_second.unwrap_or(limits.per_second),
        "burst": burst.unwrap_or(limits.burst),
    }))
}

/// Sets a tenant's own quotas from `QUOTA=VALUE` (VALUE a number of at least 1, or
/// `default`) and returns every quota of the tenant as it then stands.
pub async fn set_tenant_quotas(
    settings: &Settings,
    name: &str,
    sets: &[String],
) -> anyhow::Result<serde_json::Value> {
    use crate::quotas::Quota;
    let mut changes = Vec::new();
    for set in sets {
        let (quota, value) = set
            .split_once('=')
            .with_context(|| format!("{set:?} is not QUOTA=VALUE"))?;
        let quota = Quota::parse(quota).with_context(|| {
            format!(
                "{quota:?} is not a quota; the quotas are {}",
                Quota::ALL.map(Quota::name).join(", ")
            )
        })?;
        let value = match value {
            "default" => None,
            number => Some(
                number
                    .parse::<u64>()
                    .ok()
                    .filter(|n| *n >= 1)
                    .with_context(|| {
                        format!(
                            "{}: {number:?} is not a number of at least 1, nor `default`",
                            quota.name()
                        )
                    })?,
            ),
        };
        changes.push((quota, value));
    }
    let store = open_store(settings).await?;
    let tenant = store
        .tenant_by_name(name)
        .await?
        .with_context(|| format!("no tenant is named {name:?}"))?;
    for (quota, value) in changes {
        store
            .set_tenant_quota(&tenant.id, quota.name(), value)
            .await?;
    }
    let own: std::collections::HashMap<String, u64> =
        store.tenant_quotas(&tenant.id).await?.into_iter().collect();
    store.close().await?;
    let defaults = crate::quotas::Quotas::defaults(&settings.quotas);
    let quotas: serde_json::Map<String, serde_json::Value> = Quota::ALL
        .into_iter()
        .map(|quota| {
            let own_value = own.get(quota.name()).copied();
            (
                quota.name().to_owned(),
                serde_json::json!({
                    "limit": own_value.unwrap_or(defaults[&quota]),
                    "own": own_value.is_some(),
                }),
            )
        })
        .collect();
    Ok(serde_json::json!({"tenant_id": tenant.id, "quotas": quotas}))
}

/// Runs a key command on a store of its own (the command line's).
async fn with_store<T>(
    settings: &Settings,
    command: impl AsyncFnOnce(&Store) -> Result<T, api::keys::KeyError>,
) -> anyhow::Result<T> {
    let store = open_store(settings).await?;
    let done = command(&store).await;
    store.close().await?;
    Ok(done?)
}

/// `bedrock tenant key create NAME`.
pub async fn create_key(settings: &Settings, name: &str) -> anyhow::Result<serde_json::Value> {
    with_store(settings, async |store| {
        api::keys::create_key_in(store, name).await
    })
    .await
}

/// `bedrock tenant key list NAME`.
pub async fn list_keys(settings: &Settings, name: &str) -> anyhow::Result<serde_json::Value> {
    with_store(settings, async |store| {
        api::keys::list_keys_in(store, name).await
    })
    .await
}

/// `bedrock tenant key revoke NAME KEY`.
pub async fn revoke_key(
    settings: &Settings,
    name: &str,
    key: &str,
) -> anyhow::Result<serde_json::Value> {
    with_store(settings, async |store| {
        api::keys::revoke_key_in(store, name, key).await
    })
    .await
}

pub async fn create_tenant(settings: &Settings, name: &str) -> anyhow::Result<(Tenant, String)> {
    anyhow::ensure!(
        !name.trim().is_empty() && name.len() <= 100,
        "the tenant name must be 1 to 100 characters"
    );
    let store = open_store(settings).await?;
    anyhow::ensure!(
        store.tenant_by_name(name).await?.is_none(),
        "a tenant named {name:?} already exists"
    );
    let tenant = Tenant {
        id: uuid::Uuid::now_v7().to_string(),
        name: name.to_owned(),
    };
    let key = api::new_key();
    store
        .insert_tenant(
            &tenant,
            &uuid::Uuid::now_v7().to_string(),
            &api::hash_key(&key),
            &api::key_prefix(&key),
            Utc::now(),
        )
        .await?;
    store.close().await?;
    Ok((tenant, key))
}

/// The listener with TCP_NODELAY on every connection, for `axum::serve` (the fake LLM of
/// the tests): frames are small and must go out at once, and Nagle's algorithm would hold
/// one back until the client acknowledged the one before (up to 40 ms when the client
/// delays its ACKs). The server's own listeners set it in `server::serve`.
pub fn no_delay(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = SocketAddr> {
    use axum::serve::ListenerExt as _;
    listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY");
        }
    })
}

/// `bedrock agent export TENANT AGENT [--latest]`: the agent's document.
/// `bedrock schedule list`: every schedule (or `tenant`'s), one JSON object each, with its
/// latest run.
pub async fn list_schedules(
    settings: &Settings,
    tenant: Option<&str>,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let store = open_store(settings).await?;
    let tenant_id = tenant_id_named(&store, tenant).await?;
    let mut lines = Vec::new();
    for schedule in store.schedules(tenant_id.as_deref()).await? {
        let latest = store
            .schedule_runs(&schedule.tenant_id, &schedule.id, 1)
            .await?
            .into_iter()
            .next();
        let time = |ms: Option<i64>| ms.map(crate::schedules::rfc3339);
        lines.push(serde_json::json!({
            "tenant_id": schedule.tenant_id,
            "id": schedule.id,
            "agent": schedule.agent,
            "conversation_id": schedule.conversation_id,
            "cron": schedule.cron,
            "every_ms": schedule.every_ms,
            "at": time(schedule.at_ms),
            "timezone": schedule.timezone,
            "enabled": schedule.enabled,
            "next_fire_at": time(schedule.next_fire_at.filter(|_| schedule.enabled)),
            "last_fire_at": time(schedule.last_fire_at),
            "latest_run": latest.map(|run| serde_json::json!({
                "fire_at": crate::schedules::rfc3339(run.fire_at),
                "status": run.status,
                "outcome": run.outcome,
            })),
        }));
    }
    store.close().await?;
    Ok(lines)
}

pub async fn export_agent(
    settings: &Settings,
    tenant: &str,
    agent: &str,
    latest: bool,
) -> anyhow::Result<serde_json::Value> {
    let store = open_store(settings).await?;
    let tenant = store
        .tenant_by_name(tenant)
        .await?
        .with_context(|| format!("no tenant is named {tenant:?}"))?;
    let mut versions = store.agent_versions(&tenant.id, agent).await?;
    store.close().await?;
    anyhow::ensure!(
        !versions.is_empty(),
        "the tenant has no agent named {agent:?}"
    );
    if latest {
        versions = versions.split_off(versions.len() - 1);
    }
    Ok(serde_json::to_value(api::agents::document(
        agent, &versions,
    ))?)
}

/// `bedrock agent import TENANT FILE [--as NAME]`: the versions made. Checked as
/// POST /v1/agents/import checks it, the `agents` quota included; written as the tenant
/// commands write (a process of its own, beside the servers).
pub async fn import_agent(
    settings: &Settings,
    tenant: &str,
    text: &str,
    as_name: Option<String>,
) -> anyhow::Result<serde_json::Value> {
    let document: crate::wire::AgentDocument =
        serde_json::from_str(text).context("not an agent document")?;
    let (name, definitions) = api::agents::importable(settings, document, as_name)
        .map_err(|e| anyhow::anyhow!("{}", e.message))?;
    let store = open_store(settings).await?;
    let tenant = store
        .tenant_by_name(tenant)
        .await?
        .with_context(|| format!("no tenant is named {tenant:?}"))?;
    let own = store.tenant_quotas(&tenant.id).await?;
    let limit = own
        .iter()
        .find(|(quota, _)| quota == crate::quotas::Quota::Agents.name())
        .map_or(settings.quotas.agents, |(_, limit)| *limit);
    let count = store.agent_count(&tenant.id).await?;
    anyhow::ensure!(
        count < limit,
        "the tenant has {count} agents, its agents quota ({limit})"
    );
    let made = store
        .put_agent_versions(
            &tenant.id,
            &name,
            &definitions,
            crate::store::Making::Create,
            Utc::now(),
        )
        .await;
    store.close().await?;
    let made = made.map_err(|e| match e {
        crate::store::StoreError::Conflict(_) => {
            anyhow::anyhow!("the tenant has an agent named {name:?}; import it --as another name")
        }
        other @ (crate::store::StoreError::Unavailable(_)
        | crate::store::StoreError::NotFound
        | crate::store::StoreError::Corrupt(_)
        | crate::store::StoreError::Other(_)) => other.into(),
    })?;
    Ok(serde_json::json!({
        "name": name,
        "versions": made.iter().map(|v| v.version).collect::<Vec<_>>(),
    }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_database_port_comes_from_a_postgres_url() {
        use super::database_port;
        assert_eq!(
            database_port("postgres://u:p@db:6543/x?sslmode=disable"),
            Some(6543)
        );
        assert_eq!(database_port("postgresql://u@db/x"), Some(5432));
        assert_eq!(database_port("sqlite:///tmp/b.db?mode=rwc"), None);
    }
}

/// The id of the tenant an operator names (`--tenant NAME`), if one is named.
async fn tenant_id_named(store: &Store, name: Option<&str>) -> anyhow::Result<Option<String>> {
    let Some(name) = name else {
        return Ok(None);
    };
    Ok(Some(
        store
            .tenant_by_name(name)
            .await?
            .with_context(|| format!("no tenant is named {name:?}"))?
            .id,
    ))
}

/// Conversations `bedrock replay` reads at a time.
const REPLAY_BATCH: usize = 100;

/// What `bedrock replay` re-runs (issue 40).
#[derive(Clone, Debug, Default)]
pub struct ReplayTarget {
    /// One conversation, by id; `None` with `all`.
    pub conversation: Option<String>,
    pub all: bool,
    /// `--since`: RFC 3339, or a span back from now (`24h`, `7d`).
    pub since: Option<String>,
    /// `--tenant`: a tenant's name.
    pub tenant: Option<String>,
    /// The hidden test switch: replay with a deliberately changed decision.
    pub changed_decision: bool,
}

/// What a replay found, over all its conversations.
#[derive(Clone, Debug, Default)]
pub struct ReplaySummary {
    pub conversations: u64,
    pub steps: u64,
    pub skipped: u64,
    pub diverged: u64,
    pub seconds: f64,
}

/// Re-runs the stored steps of the conversations `target` names through the core and
/// compares every decision with the stored one (`bedrock replay`), writing a line per
/// conversation that diverged (the first divergent step: the event, both sides) and, with
/// `verbose`, a line per conversation that did not.
pub async fn replay(
    settings: &Settings,
    target: &ReplayTarget,
    out: &mut dyn std::io::Write,
    verbose: bool,
) -> anyhow::Result<ReplaySummary> {
    let store = open_store(settings).await?;
    replay_with(&store, target, out, verbose).await
}

/// [`replay`] on an open store (the benchmark's entry).
pub async fn replay_with(
    store: &Store,
    target: &ReplayTarget,
    out: &mut dyn std::io::Write,
    verbose: bool,
) -> anyhow::Result<ReplaySummary> {
    let ids = match (&target.conversation, target.all) {
        (Some(id), false) => {
            anyhow::ensure!(
                target.since.is_none() && target.tenant.is_none(),
                "--since and --tenant go with --all"
            );
            if store.conversation_by_id(id).await?.is_none() {
                anyhow::bail!("no conversation has the id {id:?}");
            }
            vec![id.clone()]
        }
        (None, true) => {
            let tenant_id = tenant_id_named(store, target.tenant.as_deref()).await?;
            let since = target.since.as_deref().map(since_ms).transpose()?;
            store
                .replay_targets(&crate::store::ReplayFilter { tenant_id, since })
                .await?
        }
        _ => anyhow::bail!("name one conversation, or --all"),
    };
    let decide: crate::replay::Decide = if target.changed_decision {
        crate::replay::changed_decision
    } else {
        crate::replay::decide
    };
    let started = std::time::Instant::now();
    let mut summary = ReplaySummary::default();
    // A hundred conversations a read: their steps and messages in three queries.
    for batch in ids.chunks(REPLAY_BATCH) {
        for input in store.replay_batch(batch).await? {
            if let Some(reason) = &input.unreadable {
                summary.conversations += 1;
                summary.diverged += 1;
                let line = serde_json::json!({
                    "conversation_id": input.conversation_id,
                    "unreadable": reason,
                });
                writeln!(out, "{line}")?;
                continue;
            }
            let messages = &input.messages;
            let lookup = |seq: i64| messages.get(&seq).cloned();
            let checked = crate::replay::replay(&input.rows, &lookup, decide, |_, _, _, _, _| {
                crate::replay::Visit::Continue
            });
            let id = &input.conversation_id;
            summary.conversations += 1;
            summary.steps += checked.steps;
            summary.skipped += checked.skipped;
            match &checked.divergence {
                Some(divergence) => {
                    summary.diverged += 1;
                    let line = serde_json::json!({
                        "conversation_id": id,
                        "diverged_at_step": divergence.step,
                        "reason": divergence.reason,
                        "event": divergence.event,
                        "stored": divergence.stored,
                        "replayed": divergence.replayed,
                        "steps_before": checked.steps,
                    });
                    writeln!(out, "{line}")?;
                }
                None if verbose => {
                    let line = serde_json::json!({
                        "conversation_id": id,
                        "steps": checked.steps,
                        "skipped": checked.skipped,
                        "same": true,
                    });
                    writeln!(out, "{line}")?;
                }
                None => {}
            }
        }
    }
    summary.seconds = started.elapsed().as_secs_f64();
    Ok(summary)
}

/// `--since`: an RFC 3339 time, or a span back from now (`24h`, `7d`), as milliseconds
/// since the Unix epoch.
fn since_ms(text: &str) -> anyhow::Result<i64> {
    if let Ok(at) = chrono::DateTime::parse_from_rfc3339(text) {
        return Ok(at.timestamp_millis());
    }
    let span = humantime::parse_duration(text).with_context(|| {
        format!("--since {text:?} is neither an RFC 3339 time nor a span such as 24h")
    })?;
    let span = chrono::Duration::from_std(span).context("--since is too far back")?;
    Ok((Utc::now() - span).timestamp_millis())
}
