//! Per-tenant quotas (docs/security.md, "Quotas"): what one tenant may hold of a shared node,
//! so that no tenant can starve the others.
//!
//! Counted things (conversations, MCP servers, open streams, running turns, background
//! tasks) are refused over their quota with 429 `quota_exceeded`. Tool processes and LLM
//! requests wait instead, each tenant behind its own work only: every tenant has its own
//! fair (first come, first served) semaphore, so a tenant that floods the node queues behind
//! itself and never takes another's place. A tenant's own values (`bedrock tenant quota`)
//! are read from the database and cached for `quotas.cache_ms`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::config::QuotaSettings;
use crate::store::Store;

/// A quota, by the name the API and the command line use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Quota {
    Conversations,
    ConcurrentTurns,
    ToolProcesses,
    BackgroundTasks,
    Streams,
    McpServers,
    LlmConcurrency,
    WorkspaceBytes,
    Agents,
    Webhooks,
    Schedules,
}

impl Quota {
    pub const ALL: [Quota; 11] = [
        Quota::Conversations,
        Quota::ConcurrentTurns,
        Quota::ToolProcesses,
        Quota::BackgroundTasks,
        Quota::Streams,
        Quota::McpServers,
        Quota::LlmConcurrency,
        Quota::WorkspaceBytes,
        Quota::Agents,
        Quota::Webhooks,
        Quota::Schedules,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Quota::Conversations => "conversations",
            Quota::ConcurrentTurns => "concurrent_turns",
            Quota::ToolProcesses => "tool_processes",
            Quota::BackgroundTasks => "background_tasks",
            Quota::Streams => "streams",
            Quota::McpServers => "mcp_servers",
            Quota::LlmConcurrency => "llm_concurrency",
            Quota::WorkspaceBytes => "workspace_bytes",
            Quota::Agents => "agents",
            Quota::Webhooks => "webhooks",
            Quota::Schedules => "schedules",
        }
    }

    pub fn parse(name: &str) -> Option<Quota> {
        Quota::ALL.into_iter().find(|q| q.name() == name)
    }

    fn default_in(self, settings: &QuotaSettings) -> u64 {
        match self {
            Quota::Conversations => settings.conversations,
            Quota::ConcurrentTurns => settings.concurrent_turns,
            Quota::ToolProcesses => settings.tool_processes,
            Quota::BackgroundTasks => settings.background_tasks,
            Quota::Streams => settings.streams,
            Quota::McpServers => settings.mcp_servers,
            Quota::LlmConcurrency => settings.llm_concurrency,
            Quota::WorkspaceBytes => settings.workspace_bytes,
            Quota::Agents => settings.agents,
            Quota::Webhooks => settings.webhooks,
            Quota::Schedules => settings.schedules,
        }
    }
}

/// A request over a quota: 429 `quota_exceeded`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{} quota of this tenant is {limit} ({used} in use){}", quota.name(), hint(*quota))]
pub struct Exceeded {
    pub quota: Quota,
    pub limit: u64,
    pub used: u64,
    /// When it may free up by itself (seconds), for Retry-After.
    pub retry_after_secs: Option<u64>,
}

fn hint(quota: Quota) -> &'static str {
    match quota {
        Quota::Conversations => "; delete conversations to make room",
        Quota::ConcurrentTurns => "; try again when a turn ends",
        Quota::Streams => "; close a stream first",
        Quota::McpServers => "; delete an MCP server first",
        Quota::Agents => "; delete an agent first",
        Quota::Webhooks => "; delete a webhook first",
        Quota::Schedules => "; delete a schedule first",
        Quota::BackgroundTasks => "; wait for a background task to end",
        Quota::WorkspaceBytes => "; remove files from the tenant's workspace",
        Quota::ToolProcesses | Quota::LlmConcurrency => "",
    }
}

/// A tenant's limit of every quota, by `Quota as usize` (copied, not cloned, per lookup).
#[derive(Clone, Copy, Debug)]
struct Limits([u64; Quota::ALL.len()]);

impl std::ops::Index<Quota> for Limits {
    type Output = u64;
    fn index(&self, quota: Quota) -> &u64 {
        &self.0[quota as usize]
    }
}

impl Limits {
    fn defaults(settings: &QuotaSettings) -> Limits {
        Limits(Quota::ALL.map(|q| q.default_in(settings)))
    }
}

/// A tenant's quotas and what it holds of this node.
#[derive(Debug)]
struct Tenant {
    /// Its limits, and when they were read.
    limits: Mutex<Option<(Instant, Limits)>>,
    tools: Pool,
    llm: Pool,
    streams: AtomicU64,
    background: AtomicU64,
    /// Conversations admitted on this node and not yet written.
    creating: AtomicU64,
    /// Its stored conversations as last counted, and when (see [`Quotas::conversation`]).
    stored: Mutex<Option<(Instant, u64)>>,
    /// Conversations admitted here since that count (deletes are not taken off: an
    /// overestimate only brings the next count sooner).
    admitted_since: AtomicU64,
    /// Turns admitted on this node whose conversation has not yet taken them.
    starting: AtomicU64,
    /// Agents admitted on this node and not yet written.
    making_agents: AtomicU64,
    /// Held while a conversation or a turn is admitted: what is in use and what is admitted
    /// and not yet under way are read together, so requests at once cannot each find room
    /// for themselves.
    admitting: tokio::sync::Mutex<()>,
    /// How many admissions have been let go: one let go while an admission read what is
    /// stored may be counted twice (held, and stored), so that admission reads again.
    released: AtomicU64,
    /// Told of each admission let go: an admission over its quota while others are held
    /// waits for them (see [`settled_count`]).
    let_go: tokio::sync::Notify,
    /// The last measurement of its workspace: when, and its bytes.
    workspace: Mutex<Option<(Instant, u64)>>,
    /// Held while its workspace is measured: one measurement at a time.
    measuring: tokio::sync::Mutex<()>,
    /// Held while one of its traces is made: one at a time, so that a tenant holds at
    /// most one of the node's trace permits.
    tracing: Arc<tokio::sync::Mutex<()>>,
}

/// A lock whose holder may have panicked: what it guards is a counter or a cache, whole.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A fair semaphore whose size follows the quota.
#[derive(Debug)]
struct Pool {
    permits: Arc<Semaphore>,
    size: Mutex<u64>,
}

impl Pool {
    fn new(size: u64) -> Pool {
        let size = size.min(MAX_POOL);
        Pool {
            permits: Arc::new(Semaphore::new(to_usize(size))),
            size: Mutex::new(size),
        }
    }

    /// Makes the pool `size` big (a lowered quota takes effect as permits come back).
    fn resize(&self, size: u64) {
        let size = size.min(MAX_POOL);
        let mut current = self
            .size
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if size > *current {
            self.permits.add_permits(to_usize(size - *current));
        } else if size < *current {
            let mut to_forget = to_usize(*current - size);
            to_forget -= self.permits.forget_permits(to_forget);
            // Permits in use now are forgotten as they come back.
            if to_forget > 0 {
                let permits = self.permits.clone();
                tokio::spawn(async move {
                    let to_forget = u32::try_from(to_forget).unwrap_or(u32::MAX);
                    if let Ok(taken) = permits.acquire_many_owned(to_forget).await {
                        taken.forget();
                    }
                });
            }
        }
        *current = size;
    }

    fn in_use(&self) -> u64 {
        let size = *self
            .size
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        size.saturating_sub(self.permits.available_permits() as u64)
    }
}

/// The largest pool: a quota above it is as good as none, and tokio's semaphores hold at most
/// `Semaphore::MAX_PERMITS` permits.
const MAX_POOL: u64 = 1 << 20;

fn to_usize(n: u64) -> usize {
    usize::try_from(n.min(MAX_POOL)).unwrap_or(1 << 20)
}

/// Why a tool process did not get a slot.
#[derive(Debug, PartialEq, Eq)]
pub enum SlotWait {
    Cancelled,
    TimedOut { waited: Duration, limit: u64 },
}

/// Every tenant's quotas on this node.
#[derive(Debug)]
pub struct Quotas {
    defaults: QuotaSettings,
    /// Other nodes create conversations too (a cluster): their count is always read.
    clustered: bool,
    store: Store,
    /// Where `workspace_bytes` is measured.
    workspaces: Arc<crate::workspace::Workspaces>,
    tenants: Mutex<HashMap<String, Arc<Tenant>>>,
}

/// Something counted against its tenant's quota while it lives: an open stream, a
/// background task, a conversation or a turn admitted and not yet under way.
#[derive(Debug)]
pub struct Held(Arc<Tenant>, Counter);

#[derive(Clone, Copy, Debug)]
enum Counter {
    Streams,
    Background,
    Creating,
    Starting,
    MakingAgents,
}

impl Counter {
    fn of(self, tenant: &Tenant) -> &AtomicU64 {
        match self {
            Counter::Streams => &tenant.streams,
            Counter::Background => &tenant.background,
            Counter::Creating => &tenant.creating,
            Counter::Starting => &tenant.starting,
            Counter::MakingAgents => &tenant.making_agents,
        }
    }
}

/// Reads of what is in use an admission makes at most, while admissions are let go
/// meanwhile.
const READS: usize = 4;

/// What `stored` counts and the admissions `held` holds, read together: an admission let
/// go during the count (its write done) may be in both, so the count is read again. Past
/// the last read it counts twice (a refusal, never one too many).
async fn steady_count<F, E>(
    tenant: &Tenant,
    held: &AtomicU64,
    stored: &impl Fn() -> F,
) -> Result<(u64, u64), E>
where
    F: Future<Output = Result<u64, E>>,
{
    let (mut count, mut holding) = (0, 0);
    for _ in 0..READS {
        let released = tenant.released.load(Ordering::Acquire);
        holding = held.load(Ordering::Acquire);
        count = stored().await?;
        if tenant.released.load(Ordering::Acquire) == released {
            break;
        }
    }
    Ok((count, holding))
}

/// How long an admission over its quota waits for the admissions held beside it to be let
/// go before it is refused (see [`settled_count`]).
const SETTLE: Duration = Duration::from_secs(2);

/// [`steady_count`] until the count is under `limit`, or nothing is held: an admission held
/// whose write is done is counted twice (stored, and held) until its holder lets it go, a
/// moment after, so a count over the limit with admissions held waits for one to be let go
/// (up to [`SETTLE`]) and reads again. Without it, a flood of creates at once could refuse
/// one that fits (a count of three where two were made).
async fn settled_count<F, E>(
    tenant: &Tenant,
    held: &AtomicU64,
    stored: &impl Fn() -> F,
    limit: u64,
) -> Result<(u64, u64), E>
where
    F: Future<Output = Result<u64, E>>,
{
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        // Registered before the count, so that a release during it is not missed.
        let let_go = tenant.let_go.notified();
        let mut let_go = std::pin::pin!(let_go);
        let_go.as_mut().enable();
        let (count, holding) = steady_count(tenant, held, stored).await?;
        if count.saturating_add(holding) < limit
            || holding == 0
            || tokio::time::timeout_at(deadline, let_go).await.is_err()
        {
            return Ok((count, holding));
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.1.of(&self.0).fetch_sub(1, Ordering::AcqRel);
        self.0.released.fetch_add(1, Ordering::AcqRel);
        self.0.let_go.notify_waiters();
    }
}

impl Quotas {
    /// `clustered`: other nodes create this node's tenants' conversations too.
    pub fn new(
        defaults: QuotaSettings,
        clustered: bool,
        store: Store,
        workspaces: Arc<crate::workspace::Workspaces>,
    ) -> Quotas {
        Quotas {
            defaults,
            clustered,
            store,
            workspaces,
            tenants: Mutex::new(HashMap::new()),
        }
    }

    /// Every quota's configured default.
    pub fn defaults(settings: &QuotaSettings) -> HashMap<Quota, u64> {
        Quota::ALL
            .into_iter()
            .map(|q| (q, q.default_in(settings)))
            .collect()
    }

    fn tenant(&self, tenant_id: &str) -> Arc<Tenant> {
        let mut tenants = self
            .tenants
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(tenant) = tenants.get(tenant_id) {
            return tenant.clone();
        }
        tenants
            .entry(tenant_id.to_owned())
            .or_insert_with(|| {
                Arc::new(Tenant {
                    limits: Mutex::new(None),
                    tools: Pool::new(self.defaults.tool_processes),
                    llm: Pool::new(self.defaults.llm_concurrency),
                    streams: AtomicU64::new(0),
                    background: AtomicU64::new(0),
                    creating: AtomicU64::new(0),
                    stored: Mutex::new(None),
                    admitted_since: AtomicU64::new(0),
                    starting: AtomicU64::new(0),
                    making_agents: AtomicU64::new(0),
                    admitting: tokio::sync::Mutex::new(()),
                    released: AtomicU64::new(0),
                    let_go: tokio::sync::Notify::new(),
                    workspace: Mutex::new(None),
                    measuring: tokio::sync::Mutex::new(()),
                    tracing: Arc::default(),
                })
            })
            .clone()
    }

    /// The tenant's limits: its own where it has them, else the defaults. Read from the
    /// database at most every `cache_ms`; a database that does not answer keeps the last
    /// values (or the defaults).
    async fn limits(&self, tenant: &Tenant, tenant_id: &str) -> Limits {
        let ttl = Duration::from_millis(self.defaults.cache_ms);
        if let Some((read, limits)) = &*tenant
            .limits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            && read.elapsed() < ttl
        {
            return *limits;
        }
        let mut limits = Limits::defaults(&self.defaults);
        match self.store.tenant_quotas(tenant_id).await {
            Ok(own) => {
                for (name, value) in own {
                    if let Some(quota) = Quota::parse(&name) {
                        limits.0[quota as usize] = value;
                    }
                }
            }
            Err(error) => {
                tracing::warn!(tenant = %tenant_id, %error, "cannot read the tenant's quotas; the last known apply");
                if let Some((_, last)) = &*tenant
                    .limits
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                {
                    return *last;
                }
            }
        }
        tenant.tools.resize(limits[Quota::ToolProcesses]);
        tenant.llm.resize(limits[Quota::LlmConcurrency]);
        *tenant
            .limits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((Instant::now(), limits));
        limits
    }

    /// The tenant's limit of `quota`.
    pub async fn limit(&self, tenant_id: &str, quota: Quota) -> u64 {
        let tenant = self.tenant(tenant_id);
        self.limits(&tenant, tenant_id).await[quota]
    }

    /// Refuses one more of `quota` when `used` are already held.
    pub async fn check(&self, tenant_id: &str, quota: Quota, used: u64) -> Result<(), Exceeded> {
        let limit = self.limit(tenant_id, quota).await;
        self.within(quota, limit, used)
    }

    /// Refuses one more of `quota` when `used` are already held of `limit`.
    fn within(&self, quota: Quota, limit: u64, used: u64) -> Result<(), Exceeded> {
        if used >= limit {
            return Err(Exceeded {
                quota,
                limit,
                used,
                retry_after_secs: match quota {
                    Quota::ConcurrentTurns | Quota::Streams | Quota::BackgroundTasks => Some(1),
                    Quota::WorkspaceBytes => Some(self.defaults.measure_every_ms.div_ceil(1000)),
                    Quota::Conversations
                    | Quota::McpServers
                    | Quota::Agents
                    | Quota::Webhooks
                    | Quota::Schedules
                    | Quota::ToolProcesses
                    | Quota::LlmConcurrency => None,
                },
            });
        }
        Ok(())
    }

    /// Room for one more conversation of the tenant (`conversations`): the stored ones
    /// (`stored` counts them) and those admitted here and not yet written. Held until the
    /// returned value is dropped: drop it once the conversation is written.
    ///
    /// On a single node the count is read once per `quotas.cache_ms` while the tenant is
    /// far from its limit: the last count and the conversations admitted here since bound
    /// what is stored (only this node writes them), so a create reads nothing and waits
    /// behind no other create's read (issue 41). Near the limit, and on a cluster, every
    /// create counts.
    pub async fn conversation<F>(
        &self,
        tenant_id: &str,
        stored: impl Fn() -> F,
    ) -> crate::store::Result<Result<Held, Exceeded>>
    where
        F: Future<Output = crate::store::Result<u64>>,
    {
        let tenant = self.tenant(tenant_id);
        let limit = self.limits(&tenant, tenant_id).await[Quota::Conversations];
        let _one_at_a_time = tenant.admitting.lock().await;
        let fresh = Duration::from_millis(self.defaults.cache_ms);
        let bound = (!self.clustered)
            .then(|| *lock(&tenant.stored))
            .flatten()
            .filter(|(at, _)| at.elapsed() < fresh)
            .map(|(_, count)| count + tenant.admitted_since.load(Ordering::Acquire));
        if bound.is_none_or(|bound| bound >= limit) {
            let (count, held) = settled_count(&tenant, &tenant.creating, &stored, limit).await?;
            *lock(&tenant.stored) = Some((Instant::now(), count));
            tenant.admitted_since.store(held, Ordering::Release);
            if let Err(exceeded) = self.within(Quota::Conversations, limit, count + held) {
                return Ok(Err(exceeded));
            }
        }
        tenant.creating.fetch_add(1, Ordering::AcqRel);
        tenant.admitted_since.fetch_add(1, Ordering::AcqRel);
        Ok(Ok(Held(tenant.clone(), Counter::Creating)))
    }

    /// Room for one more agent of the tenant (`agents`): those stored (`stored` counts them)
    /// and those admitted here and not yet written, read together so that creates at once
    /// cannot each find the last place. Held until the returned value is dropped: drop it
    /// once the agent is written.
    pub async fn agent<F>(
        &self,
        tenant_id: &str,
        stored: impl Fn() -> F,
    ) -> crate::store::Result<Result<Held, Exceeded>>
    where
        F: Future<Output = crate::store::Result<u64>>,
    {
        self.admit(
            tenant_id,
            Quota::Agents,
            Counter::MakingAgents,
            None::<fn() -> u64>,
            stored,
        )
        .await
    }

    /// Room for one more running turn of the tenant (`concurrent_turns`): those running
    /// (`running` counts them) and those admitted here that their conversation has not yet
    /// taken. `at_most` bounds the running ones (the conversations running on the node); read
    /// under the admission's lock, it spares a tenant far from its limit the count. Held
    /// until the returned value is dropped, once the conversation answered.
    pub async fn turn(
        &self,
        tenant_id: &str,
        at_most: impl FnOnce() -> u64,
        running: impl Fn() -> u64,
    ) -> Result<Held, Exceeded> {
        let admitted = self
            .admit(
                tenant_id,
                Quota::ConcurrentTurns,
                Counter::Starting,
                Some(at_most),
                || async { Ok::<_, std::convert::Infallible>(running()) },
            )
            .await;
        match admitted {
            Ok(admitted) => admitted,
            Err(never) => match never {},
        }
    }

    /// Room for one more of `quota`: `in_use` and what `counter` holds (admitted, not yet
    /// under way), read one admission at a time per tenant. `in_use` is not read when
    /// `at_most` (a bound of it) leaves room anyway.
    async fn admit<F, E>(
        &self,
        tenant_id: &str,
        quota: Quota,
        counter: Counter,
        at_most: Option<impl FnOnce() -> u64>,
        in_use: impl Fn() -> F,
    ) -> Result<Result<Held, Exceeded>, E>
    where
        F: Future<Output = Result<u64, E>>,
    {
        let tenant = self.tenant(tenant_id);
        let limit = self.limits(&tenant, tenant_id).await[quota];
        let _one_at_a_time = tenant.admitting.lock().await;
        let held = counter.of(&tenant).load(Ordering::Acquire);
        let room = at_most.is_some_and(|bound| bound().saturating_add(held) < limit);
        if !room {
            // Turns are not waited for: a turn's admission is let go as its conversation
            // takes it, and a refused send is told to retry in a second.
            let (stored, held) = if matches!(counter, Counter::Starting) {
                steady_count(&tenant, counter.of(&tenant), &in_use).await?
            } else {
                settled_count(&tenant, counter.of(&tenant), &in_use, limit).await?
            };
            if let Err(exceeded) = self.within(quota, limit, stored + held) {
                return Ok(Err(exceeded));
            }
        }
        counter.of(&tenant).fetch_add(1, Ordering::AcqRel);
        Ok(Ok(Held(tenant.clone(), counter)))
    }

    /// One more open stream of the tenant, counted until the returned value is dropped.
    pub async fn stream(&self, tenant_id: &str) -> Result<Held, Exceeded> {
        self.hold(tenant_id, Quota::Streams, Counter::Streams).await
    }

    /// One more background task of the tenant, counted until the returned value is dropped.
    pub async fn background_task(&self, tenant_id: &str) -> Result<Held, Exceeded> {
        self.hold(tenant_id, Quota::BackgroundTasks, Counter::Background)
            .await
    }

    async fn hold(
        &self,
        tenant_id: &str,
        quota: Quota,
        counter: Counter,
    ) -> Result<Held, Exceeded> {
        let tenant = self.tenant(tenant_id);
        let limit = self.limits(&tenant, tenant_id).await[quota];
        let count = counter.of(&tenant);
        let before = count.fetch_add(1, Ordering::AcqRel);
        let held = Held(tenant.clone(), counter);
        if before >= limit {
            drop(held);
            return Err(Exceeded {
                quota,
                limit,
                used: before,
                retry_after_secs: Some(1),
            });
        }
        Ok(held)
    }

    /// A slot for one tool process of the tenant: waits behind the tenant's own processes
    /// only, at most `wait`, and not past a cancel.
    pub async fn tool_slot(
        &self,
        tenant_id: &str,
        wait: Duration,
        cancel: &CancellationToken,
    ) -> Result<OwnedSemaphorePermit, SlotWait> {
        let tenant = self.tenant(tenant_id);
        let limit = self.limits(&tenant, tenant_id).await[Quota::ToolProcesses];
        let started = Instant::now();
        tokio::select! {
            biased;
            () = cancel.cancelled() => Err(SlotWait::Cancelled),
            permit = tenant.tools.permits.clone().acquire_owned() => {
                permit.map_err(|_| SlotWait::Cancelled)
            }
            () = tokio::time::sleep(wait) => Err(SlotWait::TimedOut { waited: started.elapsed(), limit }),
        }
    }

    /// The tenant's one slot for making a trace (src/api/trace.rs): its traces wait behind
    /// each other only, and never hold more than one of the node's.
    pub async fn trace_slot(&self, tenant_id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let tracing = self.tenant(tenant_id).tracing.clone();
        tracing.lock_owned().await
    }

    /// A slot for one LLM request of the tenant (its share of the node's), waiting behind
    /// the tenant's own requests only.
    pub async fn llm_slot(&self, tenant_id: &str) -> Option<OwnedSemaphorePermit> {
        let tenant = self.tenant(tenant_id);
        self.limits(&tenant, tenant_id).await;
        tenant.llm.permits.clone().acquire_owned().await.ok()
    }

    /// The bytes in the tenant's workspace, measured again when the last measurement is
    /// older than `quotas.measure_every_ms` (at most one measurement at a time per tenant).
    pub async fn workspace_bytes(&self, tenant_id: &str) -> Option<u64> {
        let tenant = self.tenant(tenant_id);
        let every = Duration::from_millis(self.defaults.measure_every_ms);
        let recent = || {
            tenant
                .workspace
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .filter(|(at, _)| at.elapsed() < every)
                .map(|(_, bytes)| bytes)
        };
        if let Some(bytes) = recent() {
            return Some(bytes);
        }
        // One measurement at a time: those who waited take its result.
        let _measuring = tenant.measuring.lock().await;
        if let Some(bytes) = recent() {
            return Some(bytes);
        }
        let (workspaces, owned) = (self.workspaces.clone(), tenant_id.to_owned());
        let measure = move || workspaces.tenant_bytes(&owned).ok();
        let measured = tokio::task::spawn_blocking(measure).await.ok().flatten()?;
        *tenant
            .workspace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((Instant::now(), measured));
        Some(measured)
    }

    /// What the tenant holds now on this node (the quotas counted in memory), by quota.
    pub fn held(&self, tenant_id: &str) -> HashMap<Quota, u64> {
        let tenant = self.tenant(tenant_id);
        let mut held = HashMap::new();
        held.insert(Quota::ToolProcesses, tenant.tools.in_use());
        held.insert(Quota::LlmConcurrency, tenant.llm.in_use());
        held.insert(Quota::Streams, tenant.streams.load(Ordering::Acquire));
        held.insert(
            Quota::BackgroundTasks,
            tenant.background.load(Ordering::Acquire),
        );
        if let Some((_, bytes)) = *tenant
            .workspace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            held.insert(Quota::WorkspaceBytes, bytes);
        }
        held
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::store::testing::sqlite_store;

    fn settings(concurrent_turns: u64) -> QuotaSettings {
        QuotaSettings {
            conversations: 10,
            concurrent_turns,
            tool_processes: 1,
            background_tasks: 1,
            streams: 1,
            mcp_servers: 1,
            agents: 1,
            webhooks: 1,
            schedules: 1,
            llm_concurrency: 1,
            workspace_bytes: u64::MAX,
            measure_every_ms: 1000,
            cache_ms: 60_000,
        }
    }

    /// A turn is counted only when the bound (the node's running conversations, read under
    /// the admission's lock) does not already leave room; admitted turns not yet under way
    /// count either way, and the quota holds.
    #[tokio::test]
    async fn a_turn_far_from_the_limit_is_admitted_without_counting_the_running_ones() {
        let (store, dir) = sqlite_store("quota-turns", &[]).await;
        let workspaces = crate::workspace::Workspaces::open(&dir.join("ws"), None).expect("a root");
        let quotas = Quotas::new(settings(2), false, store, Arc::new(workspaces));
        let counted = Cell::new(0);
        let running = |n: u64| {
            let counted = &counted;
            move || {
                counted.set(counted.get() + 1);
                n
            }
        };
        // One conversation on the node: its turns cannot reach the limit of 2.
        let first = quotas.turn("t", || 1, running(1)).await.expect("room");
        assert_eq!(counted.get(), 0, "not counted");
        // 1 conversation + 1 admitted reach 2: counted now (none runs), and admitted.
        let second = quotas.turn("t", || 1, running(0)).await.expect("room");
        assert_eq!(counted.get(), 1);
        // Two admitted, not yet under way: a third is refused whatever runs.
        let refused = quotas.turn("t", || 0, running(0)).await;
        assert!(
            matches!(
                refused,
                Err(Exceeded {
                    quota: Quota::ConcurrentTurns,
                    limit: 2,
                    used: 2,
                    ..
                })
            ),
            "{refused:?}"
        );
        // Running turns found by the count are refused too.
        drop((first, second));
        let refused = quotas.turn("t", || 5, running(2)).await;
        assert!(refused.is_err(), "{refused:?}");
        quotas
            .turn("t", || 0, running(0))
            .await
            .expect("room again");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Quotas of two agents a tenant, in a store of its own (`name`), and the first agent's
    /// admission.
    async fn two_agents(name: &str) -> (Quotas, Held, std::path::PathBuf) {
        let (store, dir) = sqlite_store(name, &[]).await;
        let workspaces =
            Arc::new(crate::workspace::Workspaces::open(&dir.join("ws"), None).expect("a root"));
        let mut limits = settings(2);
        limits.agents = 2;
        let quotas = Quotas::new(limits, false, store, workspaces);
        let first = quotas
            .agent("t", || std::future::ready(Ok(0)))
            .await
            .expect("reads")
            .expect("room");
        (quotas, first, dir)
    }

    /// An agent written and let go while a create reads the stored count is in both the
    /// count and the admitted ones: the create reads again and is admitted (a flood of
    /// creates once got one refusal too many this way). The quota still holds.
    #[tokio::test]
    async fn an_admission_let_go_during_the_count_is_not_counted_twice() {
        let (quotas, first, dir) = two_agents("quota-agents").await;
        // The first is written (the count finds it) and let go during the second's count.
        let writing = Mutex::new(Some(first));
        let second = quotas
            .agent("t", || {
                drop(writing.lock().expect("not poisoned").take());
                std::future::ready(Ok(1))
            })
            .await
            .expect("reads")
            .expect("room: one stored of two");
        // The third waits for the second, held, to be let go (its write done: two stored)
        // and is refused then.
        let stored = AtomicU64::new(1);
        let third = quotas.agent("t", || {
            std::future::ready(Ok(stored.load(Ordering::Acquire)))
        });
        let written = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            stored.store(2, Ordering::Release);
            drop(second);
        };
        let (third, ()) = tokio::join!(third, written);
        assert!(
            third.expect("reads").is_err(),
            "one stored and one admitted reach 2"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A flood of creates at once: an admission whose write is done is counted twice
    /// (stored, and held) until its holder lets it go, a moment later. A create that finds
    /// the count over the limit that way waits for it and is admitted once it is let go;
    /// without admissions held it is refused at once.
    #[tokio::test]
    async fn a_create_waits_for_a_written_admission_to_be_let_go() {
        let (quotas, first, dir) = two_agents("quota-settle").await;
        // The first is written (one stored) and still held: 1 + 1 reach the limit of 2.
        let second = quotas.agent("t", || std::future::ready(Ok(1)));
        let let_go = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(first);
        };
        let (second, ()) = tokio::join!(second, let_go);
        let second = second
            .expect("reads")
            .expect("room once the first is let go: one stored of two");
        drop(second);
        // Two stored and nothing held: refused without waiting.
        let started = Instant::now();
        let third = quotas
            .agent("t", || std::future::ready(Ok(2)))
            .await
            .expect("reads");
        assert!(third.is_err());
        assert!(started.elapsed() < SETTLE, "nothing held: no wait");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// On one node a create reads the stored count once per window while the count and
    /// the creates admitted since leave room; near the limit it counts again and the quota
    /// holds. On a cluster every create counts.
    #[tokio::test]
    async fn a_create_far_from_the_limit_reads_no_count() {
        let (store, dir) = sqlite_store("quota-creates", &[]).await;
        let workspaces =
            Arc::new(crate::workspace::Workspaces::open(&dir.join("ws"), None).expect("a root"));
        let counted = Cell::new(0);
        let stored = |n: u64| {
            let counted = &counted;
            move || {
                counted.set(counted.get() + 1);
                std::future::ready(Ok(n))
            }
        };
        // A limit of 10: the first create counts (none stored), the next nine do not.
        let single = Quotas::new(settings(2), false, store.clone(), workspaces.clone());
        for n in 0..10 {
            let held = single.conversation("t", stored(n)).await.expect("reads");
            drop(held.expect("room"));
        }
        assert_eq!(counted.get(), 1, "counted once");
        // None stored at the count + 10 admitted since reach the limit: counted again, and
        // the count (10 written) refuses the next.
        let refused = single.conversation("t", stored(10)).await.expect("reads");
        assert!(
            matches!(refused, Err(Exceeded { used: 10, .. })),
            "{refused:?}"
        );
        assert_eq!(counted.get(), 2);
        // Deletes found by the next count make room again.
        let held = single.conversation("t", stored(3)).await.expect("reads");
        assert!(held.is_ok());
        assert_eq!(counted.get(), 3);

        let clustered = Quotas::new(settings(2), true, store, workspaces);
        counted.set(0);
        for _ in 0..3 {
            let held = clustered.conversation("t", stored(0)).await.expect("reads");
            drop(held.expect("room"));
        }
        assert_eq!(counted.get(), 3, "a cluster counts every create");
        let _ = std::fs::remove_dir_all(dir);
    }
}
