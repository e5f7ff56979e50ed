//! The persistence actor: the one owner of database writes.
//!
//! Commits of different conversations that arrive while a flush is in flight are written
//! together in the next transaction (group commit), so throughput grows with concurrency
//! while each conversation still waits for its own commit before any effect runs. The
//! handler never awaits the database: a flush runs in its own task and reports back.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use std::sync::Arc;

use crate::metrics::Metrics;
use crate::model::{ConversationCommit, NewConversation, Tenant};
use crate::store::{NewAttachment, Store, StoreError};

/// The most commits written in one transaction.
const MAX_BATCH: usize = 512;

/// How long the usage of LLM responses may wait for a commit to go with. A response's usage
/// reaches the actor just before the commit that stores the response, so a flush started
/// for the usage alone was a transaction (and, on SQLite, a sync of the log) of its own;
/// it waits for that commit instead, and flushes alone only after this.
const USAGE_WAITS_FOR_A_COMMIT: Duration = Duration::from_millis(5);

/// How often SQLite's write-ahead log is copied back into the database under load. Often, so
/// each pass copies little: passes every 500 ms held up the commits beside them for up to
/// 17 ms, passes every 100 ms for up to 8 ms (5,000 transitions/s offered).
const CHECKPOINT_BUSY_EVERY: Duration = Duration::from_millis(100);

/// How often otherwise. A pass that copies the whole log also syncs the database file, and
/// a commit syncing the log beside it waits longer: at a low write rate, where every pass
/// catches up, rarer passes mean fewer such waits.
const CHECKPOINT_QUIET_EVERY: Duration = Duration::from_millis(500);

/// New frames since the last pass (4 MiB) from which the log is under load.
const BUSY_PASS_FRAMES: u64 = 1_024;

/// Frames (a page each) in SQLite's write-ahead log past which a checkpoint runs between
/// two flushes so the log starts over: 16,384 frames of 4 KiB, 64 MiB.
const RESTART_LOG_FRAMES: u64 = 16_384;

/// Before the checkpoint in the queue, passes beside the commits go on while each finds more
/// than this many new frames (1 MiB), so the queued one, which holds up every commit behind
/// it, copies little.
const QUEUED_CHECKPOINT_FRAMES: u64 = 256;

/// The most passes beside the commits before the queued checkpoint.
const CATCH_UP_PASSES: usize = 8;

/// A write other than a conversation's transition.
#[derive(Clone, Debug)]
pub enum WriteJob {
    CreateTenant {
        tenant: Tenant,
        key_id: String,
        key_hash: String,
        key_prefix: String,
        at: DateTime<Utc>,
    },
    CreateApiKey {
        tenant_id: String,
        key_id: String,
        key_hash: String,
        key_prefix: String,
        at: DateTime<Utc>,
    },
    EnsureTenant {
        tenant: Tenant,
        at: DateTime<Utc>,
    },
    CreateConversation(NewConversation),
    SetArchived {
        id: String,
        archived: bool,
        at: DateTime<Utc>,
    },
    DeleteConversation {
        id: String,
    },
    /// A new conversation with a copy of another's messages up to a point; one message id
    /// per copied message.
    Fork {
        new: NewConversation,
        from: crate::model::ForkPoint,
        message_ids: Vec<String>,
    },
    /// A new conversation with one message already: a continuation's summary
    /// (`continued_from` set), or a notice of its creation.
    Seeded {
        new: NewConversation,
        continued_from: Option<String>,
        message_id: String,
        message: crate::state_machine::MessageContent,
    },
    InsertAttachments(Vec<NewAttachment>),
    /// A request to the client, with its webhook event (`request.created`) if any.
    CreateClientRequest(crate::model::ClientRequest, Vec<crate::model::NewDelivery>),
    /// Resolve a pending request; `Resolved(false)` when it was no longer pending.
    ResolveClientRequest {
        id: String,
        status: crate::model::RequestStatus,
        response: Option<serde_json::Value>,
        at: DateTime<Utc>,
    },
    /// Ask the client to run one of its tools.
    CreateClientToolCall(
        Box<crate::model::ClientToolCall>,
        Vec<crate::model::NewDelivery>,
    ),
    /// Resolve a pending client tool call (answered with its output and whether it is an
    /// error, expired, cancelled); `Resolved(false)` when it was no longer pending.
    ResolveClientToolCall {
        id: String,
        status: crate::model::RequestStatus,
        answer: Option<(String, bool)>,
        at: DateTime<Utc>,
    },
    CreateBackgroundTask(crate::model::BackgroundTask),
    FinishBackgroundTask {
        id: String,
        status: crate::model::TaskStatus,
        output: String,
        exit_code: Option<i32>,
        at: DateTime<Utc>,
    },
    /// Restart recovery: expire pending client requests, fail running background tasks.
    ExpirePendingWork {
        at: DateTime<Utc>,
        /// Only this conversation's (a lease taken over); `None`: every one (a restart).
        conversation: Option<String>,
    },
    /// Retention: remove up to `limit` rows of frames stored before `before` (milliseconds
    /// since the Unix epoch).
    PruneFrames {
        before: i64,
        limit: u64,
    },
    /// An LLM response's tokens: written with the commits of a batch, in its transaction
    /// (a transaction of its own per response cost a sync of the log each and, on SQLite,
    /// the write lock beside the group commit's writer: issue 41).
    RecordUsage(crate::store::UsageRecord),
    /// A reservation on a tenant's budget given back (its request ended without an answer).
    ReleaseBudget {
        tenant_id: String,
        reservation: crate::store::Reservation,
    },
    /// A tenant's MCP server registered; a name the tenant uses already is a conflict.
    AddMcpServer {
        tenant_id: String,
        server: crate::store::McpServer,
        at: DateTime<Utc>,
    },
    /// A tenant's MCP server removed: `Resolved(whether it was there)`.
    DeleteMcpServer {
        tenant_id: String,
        name: String,
    },
    /// Versions of a tenant's agent made, in order and all or none: `Version(the first's
    /// number)` (the others follow it); a live agent of the name is a conflict when
    /// creating, none is not found when changing.
    PutAgent {
        tenant_id: String,
        name: String,
        definitions: Vec<crate::model::AgentDefinition>,
        making: crate::store::Making,
        at: DateTime<Utc>,
    },
    /// A tenant's agent deleted (its versions stay): `Resolved(whether it was live)`.
    DeleteAgent {
        tenant_id: String,
        name: String,
        at: DateTime<Utc>,
    },
    /// A tenant's webhook endpoint made.
    CreateWebhook(Box<crate::model::Webhook>),
    /// A tenant's endpoint changed: `Resolved(whether it was there)`.
    UpdateWebhook {
        tenant_id: String,
        id: String,
        change: crate::store::WebhookChange,
        at: i64,
    },
    /// A new signing secret: `Resolved(whether it was there)`.
    RotateWebhookSecret {
        tenant_id: String,
        id: String,
        secret: secrecy::SecretString,
        previous_until: i64,
        at: i64,
    },
    /// An endpoint and its deliveries removed: `Resolved(whether it was there)`.
    DeleteWebhook {
        tenant_id: String,
        id: String,
    },
    /// One cycle of a node's webhook dispatcher, one transaction: the outbox of an earlier
    /// release fanned out, due deliveries claimed: `Count(claimed)`.
    WebhookCycle(Box<WebhookCycle>),
    /// Webhook attempts' results. On SQLite they go with a batch of commits (waiting a
    /// moment for one, as the usage of LLM responses does): no transaction, sync or
    /// connection of their own.
    WebhookResults(crate::store::WebhookResults),
    /// A tenant's schedule made.
    CreateSchedule(Box<crate::model::Schedule>),
    /// A schedule paused or resumed: `Resolved(whether it was there)`.
    SetScheduleEnabled {
        tenant_id: String,
        id: String,
        enabled: bool,
        next_fire_at: Option<i64>,
        at: i64,
    },
    /// A schedule and its runs removed: `Resolved(whether it was there)`.
    DeleteSchedule {
        tenant_id: String,
        id: String,
    },
    /// Due firings claimed for a node: `Count(runs claimed)`.
    ClaimScheduleFirings {
        claimed_by: String,
        now: i64,
        until: i64,
        late_ms: i64,
        limit: u64,
    },
    /// What a run came to: `Resolved(whether the claim still held)`.
    FinishScheduleRun(Box<crate::store::RunOutcome>),
    /// A run handed to the node that owns its conversation: `Resolved(whether the claim
    /// still held)`.
    HandOffScheduleRun {
        schedule_id: String,
        fire_at: i64,
        /// The claim it is under: the process's token and the node's.
        from: (String, String),
        to: String,
        until: i64,
    },
    /// Finished deliveries and runs older than these removed, up to `limit` of each:
    /// `Count(removed)`.
    PruneWebhooksAndRuns {
        deliveries_before: i64,
        runs_before: i64,
        limit: u64,
    },
    /// A delivery sent again: `Resolved(whether it was there)`.
    RetryWebhookDelivery {
        tenant_id: String,
        webhook_id: String,
        id: String,
        now: i64,
        retry_for_ms: i64,
    },
}

/// One cycle of a node's webhook dispatcher (see [`WriteJob::WebhookCycle`]).
#[derive(Clone, Debug)]
pub struct WebhookCycle {
    pub now: i64,
    pub retry_for_ms: i64,
    pub fan_out_limit: u64,
    pub claimed_by: String,
    pub until: i64,
    pub claim_limit: u64,
    /// The deliveries in flight: not handed out again.
    pub flying: Vec<String>,
    /// Deliveries its claims hold were not sent: read them again.
    pub held: bool,
    /// Filled by the cycle: the deliveries this node's claims hold (but those in flight),
    /// with their endpoints, read in the cycle's transaction.
    pub claimed: Arc<std::sync::Mutex<Vec<(crate::model::WebhookDelivery, crate::model::Webhook)>>>,
}

/// What a write reports back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    Done,
    /// Whether a conditional update found its row in the expected status.
    Resolved(bool),
    /// Rows touched by `ExpirePendingWork`: client requests, background tasks.
    Expired(u64, u64),
    /// Rows of frames removed by `PruneFrames`.
    Pruned(u64),
    /// The number of the first version `PutAgent` made.
    Version(u32),
    /// Rows a webhook job took or claimed.
    Count(u64),
}

type Reply<T> = RpcReplyPort<Result<T, StoreError>>;

enum Job {
    Commit(Arc<ConversationCommit>, Reply<()>),
    /// A commit that goes before every queued one (a cancel).
    Urgent(Arc<ConversationCommit>, Reply<()>),
    Write(WriteJob, Reply<WriteOutcome>),
    /// Copy SQLite's write-ahead log back into the database, between two flushes.
    Checkpoint,
}

pub enum PersistenceMsg {
    Commit(Arc<ConversationCommit>, Reply<()>),
    /// A commit that goes before every queued one (a cancel: the user is waiting).
    UrgentCommit(Arc<ConversationCommit>, Reply<()>),
    Write(WriteJob, Reply<WriteOutcome>),
    /// Time for an SQLite checkpoint.
    Checkpoint,
    /// A flush finished.
    Flushed,
    /// Usage queued alone has waited long enough for a commit: flush it.
    UsageDue,
}

impl std::fmt::Debug for PersistenceMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PersistenceMsg::Commit(commit, _) | PersistenceMsg::UrgentCommit(commit, _) => {
                write!(f, "Commit({})", commit.conversation_id)
            }
            PersistenceMsg::Write(job, _) => write!(f, "Write({job:?})"),
            PersistenceMsg::Checkpoint => f.write_str("Checkpoint"),
            PersistenceMsg::Flushed => f.write_str("Flushed"),
            PersistenceMsg::UsageDue => f.write_str("UsageDue"),
        }
    }
}

#[derive(Debug)]
pub struct PersistenceActor;

pub struct PersistenceState {
    store: Store,
    metrics: Arc<Metrics>,
    /// Jobs waiting for the next flush, in arrival order.
    queue: VecDeque<Job>,
    /// Flush tasks writing (a batch that is written may still be waiting to be durable: the
    /// next one is written meanwhile).
    flushing: usize,
    /// How many may run at once: one for SQLite (one writer at a time anyway), a few for
    /// Postgres, whose own group commit then merges their WAL flushes.
    parallel: usize,
    /// A checkpoint waits in the queue.
    checkpoint_queued: bool,
    /// A [`PersistenceMsg::UsageDue`] is on its way.
    usage_timer: bool,
    /// Usage queued alone has waited [`USAGE_WAITS_FOR_A_COMMIT`]: it goes without a commit.
    usage_due: bool,
}

impl std::fmt::Debug for PersistenceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PersistenceState")
            .field("queued", &self.queue.len())
            .field("flushing", &self.flushing)
            .field("parallel", &self.parallel)
            .finish()
    }
}

impl Actor for PersistenceActor {
    type Msg = PersistenceMsg;
    type State = PersistenceState;
    type Arguments = (Store, Arc<Metrics>);

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        (store, metrics): (Store, Arc<Metrics>),
    ) -> Result<Self::State, ActorProcessingErr> {
        let parallel = if store.backend() == sea_orm::DbBackend::Postgres {
            4
        } else {
            1
        };
        if store.backend() == sea_orm::DbBackend::Sqlite {
            // SQLite starts its write-ahead log over only after a checkpoint that copied all
            // of it, with no write in between. Beside a steady stream of commits a
            // checkpoint never catches up, and the log grows without bound (hundreds of MB a
            // minute under load, every write appending to new blocks). So the bulk of the
            // copying runs beside the commits, and when the log has grown long, one more
            // checkpoint runs in the queue, between two flushes, where it copies the rest
            // and the log is reused.
            let (store, me) = (store.clone(), myself.clone());
            tokio::spawn(async move {
                let (mut pause, mut seen) = (CHECKPOINT_QUIET_EVERY, 0);
                while me.get_status() <= ractor::ActorStatus::Running {
                    tokio::time::sleep(pause).await;
                    match pass(&store).await {
                        Ok(Some(frames)) => {
                            pause = pause_after(seen, frames);
                            seen = frames;
                            if frames >= RESTART_LOG_FRAMES {
                                seen = catch_up(frames, || pass(&store)).await;
                                let _ = me.cast(PersistenceMsg::Checkpoint);
                            }
                        }
                        Ok(None) => {}
                        Err(e) => tracing::debug!(%e, "checkpoint skipped"),
                    }
                }
            });
        }
        Ok(PersistenceState {
            store,
            metrics,
            queue: VecDeque::new(),
            flushing: 0,
            parallel,
            checkpoint_queued: false,
            usage_timer: false,
            usage_due: false,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            PersistenceMsg::Commit(commit, reply) => {
                state.queue.push_back(Job::Commit(commit, reply))
            }
            PersistenceMsg::UrgentCommit(commit, reply) => {
                state.queue.push_front(Job::Urgent(commit, reply))
            }
            PersistenceMsg::Write(job, reply) => state.queue.push_back(Job::Write(job, reply)),
            PersistenceMsg::Checkpoint => {
                if !std::mem::replace(&mut state.checkpoint_queued, true) {
                    state.queue.push_back(Job::Checkpoint);
                }
            }
            PersistenceMsg::Flushed => state.flushing -= 1,
            PersistenceMsg::UsageDue => {
                state.usage_timer = false;
                state.usage_due = !state.queue.is_empty();
            }
        }
        while state.flushing < state.parallel && !state.queue.is_empty() {
            if !state.usage_due && state.queue.iter().all(is_usage) {
                if !std::mem::replace(&mut state.usage_timer, true) {
                    myself.send_after(USAGE_WAITS_FOR_A_COMMIT, || PersistenceMsg::UsageDue);
                }
                break;
            }
            state.usage_due = false;
            let jobs = take_batch(&mut state.queue);
            if matches!(jobs.first(), Some(Job::Checkpoint)) {
                state.checkpoint_queued = false;
            }
            start_flush(&myself, state, jobs);
        }
        // Where flushes run side by side (Postgres), a cancel does not wait for one of them
        // to end: its commit gets a flush of its own.
        if state.parallel > 1 {
            let urgent = take_urgent(&mut state.queue);
            if !urgent.is_empty() {
                start_flush(&myself, state, urgent);
            }
        }
        Ok(())
    }
}

fn start_flush(myself: &ActorRef<PersistenceMsg>, state: &mut PersistenceState, jobs: Vec<Job>) {
    state.flushing += 1;
    let store = state.store.clone();
    let metrics = state.metrics.clone();
    let myself = myself.clone();
    // Boxed: the flush's future is some 7 KB (the store's writes), and a task's future is
    // copied as the task is made and again as it ends (issue 41).
    tokio::spawn(Box::pin(async move {
        flush(&store, &metrics, jobs, move || {
            // The actor is gone only when the server stops; then nothing waits.
            let _ = myself.cast(PersistenceMsg::Flushed);
        })
        .await;
    }));
}

/// The urgent commits at the front of the queue.
fn take_urgent(queue: &mut VecDeque<Job>) -> Vec<Job> {
    let mut jobs = Vec::new();
    while let Some(job) = queue.pop_front() {
        if matches!(job, Job::Urgent(..)) {
            jobs.push(job);
        } else {
            queue.push_front(job);
            break;
        }
    }
    jobs
}

/// A checkpoint pass beside the commits: copies what it can of the log into the database,
/// then syncs the database file, so the pages it copied are on disk before the checkpoint in
/// the queue (which syncs whatever is left while every commit waits) comes.
async fn pass(store: &Store) -> crate::store::Result<Option<u64>> {
    let frames = store.checkpoint().await?;
    store.sync_database().await?;
    Ok(frames)
}

/// Frames written to the log between two passes that found it `before` and `now` frames
/// long (a log that started over is shorter than it was).
fn new_frames(before: u64, now: u64) -> u64 {
    if now >= before { now - before } else { now }
}

/// The pause before the next checkpoint pass, from the log's length at the last pass and now.
fn pause_after(before: u64, now: u64) -> Duration {
    if new_frames(before, now) >= BUSY_PASS_FRAMES {
        CHECKPOINT_BUSY_EVERY
    } else {
        CHECKPOINT_QUIET_EVERY
    }
}

/// Runs checkpoint passes beside the commits until one finds few new frames, from a pass that
/// found the log `frames` long; returns the last length seen.
///
/// A pass copies the log up to where it stood when the pass began; what was written while it
/// ran is left for the next. After a long pass that rest is large, and the checkpoint in the
/// queue, which every commit behind it waits for, would copy it all (measured: 3–19 ms once
/// a second at 5,000 transitions/s). A pass that found few new frames was short, so little
/// was written during it.
async fn catch_up<F, Fut>(mut frames: u64, mut pass: F) -> u64
where
    F: FnMut() -> Fut,
    Fut: Future<Output = crate::store::Result<Option<u64>>>,
{
    for _ in 0..CATCH_UP_PASSES {
        match pass().await {
            Ok(Some(now)) => {
                let fresh = new_frames(frames, now);
                frames = now;
                if fresh <= QUEUED_CHECKPOINT_FRAMES {
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(%e, "checkpoint skipped");
                break;
            }
        }
    }
    frames
}

/// Whether a job is the usage of an LLM response.
/// Whether a job waits a moment for a commit to go with: the usage of an LLM response,
/// webhook attempts' results.
fn is_usage(job: &Job) -> bool {
    matches!(
        job,
        Job::Write(WriteJob::RecordUsage(_) | WriteJob::WebhookResults(_), _)
    )
}

/// Whether a job is written with the commits of a batch: a commit, a new conversation, the
/// usage of an LLM response.
fn batched(job: &Job) -> bool {
    matches!(
        job,
        Job::Commit(..)
            | Job::Urgent(..)
            | Job::Write(
                WriteJob::CreateConversation(_)
                    | WriteJob::RecordUsage(_)
                    | WriteJob::WebhookResults(_),
                _
            )
    )
}

/// The next jobs to flush: a run of commits and new conversations (up to [`MAX_BATCH`]), or
/// one other write.
fn take_batch(queue: &mut VecDeque<Job>) -> Vec<Job> {
    let mut jobs = Vec::new();
    while let Some(job) = queue.pop_front() {
        match job {
            _ if batched(&job) && jobs.len() < MAX_BATCH => jobs.push(job),
            Job::Write(..) | Job::Checkpoint if jobs.is_empty() => {
                jobs.push(job);
                break;
            }
            Job::Commit(..) | Job::Urgent(..) | Job::Write(..) | Job::Checkpoint => {
                queue.push_front(job);
                break;
            }
        }
    }
    jobs
}

/// Runs `jobs`, calling `written` once the database is free for the next flush: for a batch
/// of commits that is as soon as it is written, before it is durable, so the next batch is
/// written while this one's log is synced (SQLite); replies go out once it is durable.
async fn flush(store: &Store, metrics: &Metrics, jobs: Vec<Job>, written: impl FnOnce()) {
    let mut batch = Vec::with_capacity(jobs.len());
    let mut replies = Vec::with_capacity(jobs.len());
    let mut created = Vec::new();
    let mut created_replies = Vec::new();
    let mut usage = Vec::new();
    let mut usage_replies = Vec::new();
    let mut results = crate::store::WebhookResults::default();
    let mut results_replies = Vec::new();
    for job in jobs {
        match job {
            Job::Commit(commit, reply) | Job::Urgent(commit, reply) => {
                batch.push(commit);
                replies.push(reply);
            }
            Job::Write(WriteJob::CreateConversation(new), reply) => {
                created.push(new);
                created_replies.push(reply);
            }
            Job::Write(WriteJob::RecordUsage(record), reply) => {
                usage.push(record);
                usage_replies.push(reply);
            }
            Job::Write(WriteJob::WebhookResults(these), reply) => {
                results.append(these);
                results_replies.push(reply);
            }
            Job::Write(job, reply) => {
                // Boxed: the future of any write is as large as the largest (every arm of
                // `write`), and it would make every flush's task that large, copied a few
                // times as each is spawned (issue 41).
                let _ = reply.send(Box::pin(write(store, job)).await);
            }
            Job::Checkpoint => {
                if let Err(e) = store.checkpoint().await {
                    tracing::debug!(%e, "checkpoint skipped");
                }
            }
        }
    }
    // Webhook results ride with SQLite's group commit (its text, its connection); Postgres
    // writes them alone, so that they never fail the batch's commits.
    if !store.results_ride_with_commits() && !results.is_empty() {
        let outcome = store
            .finish_webhook_attempts(&std::mem::take(&mut results))
            .await;
        for reply in results_replies.drain(..) {
            let _ = reply.send(outcome.clone().map(|()| WriteOutcome::Done));
        }
    }
    if batch.is_empty() && created.is_empty() && usage.is_empty() && results.is_empty() {
        written();
        return;
    }
    let started = Instant::now();
    let outcome = match store.write_batch(&batch, &created, &usage, &results).await {
        Ok(durable) => {
            written();
            durable.wait().await
        }
        // One bad commit (or a taken slug) must not fail its neighbours: write each alone
        // to find it.
        Err(error)
            if batch.len() + created.len() + usage.len() + results.len() > 1
                && !error.is_unavailable() =>
        {
            Box::pin(one_by_one(
                store,
                (&created, created_replies),
                (&usage, usage_replies),
                (&results, results_replies),
                (&batch, replies),
            ))
            .await;
            written();
            return;
        }
        Err(error) => {
            written();
            Err(error)
        }
    };
    metrics.commit(started.elapsed().as_secs_f64(), batch.len());
    tracing::trace!(
        target: "bedrock::persistence",
        commits = batch.len(),
        elapsed_us = started.elapsed().as_micros() as u64,
        ok = outcome.is_ok(),
        "group commit"
    );
    for reply in replies {
        let _ = reply.send(outcome.clone());
    }
    for reply in created_replies
        .into_iter()
        .chain(usage_replies)
        .chain(results_replies)
    {
        let _ = reply.send(outcome.clone().map(|()| WriteOutcome::Done));
    }
}

/// Writes each of a batch that failed alone, to find the one that fails.
async fn one_by_one(
    store: &Store,
    (created, created_replies): (&[NewConversation], Vec<Reply<WriteOutcome>>),
    (usage, usage_replies): (&[crate::store::UsageRecord], Vec<Reply<WriteOutcome>>),
    (results, results_replies): (&crate::store::WebhookResults, Vec<Reply<WriteOutcome>>),
    (batch, replies): (&[Arc<ConversationCommit>], Vec<Reply<()>>),
) {
    for (new, reply) in created.iter().zip(created_replies) {
        let outcome = store.insert_conversation(new).await;
        let _ = reply.send(outcome.map(|()| WriteOutcome::Done));
    }
    for (record, reply) in usage.iter().zip(usage_replies) {
        let _ = reply.send(store.record(record).await.map(|()| WriteOutcome::Done));
    }
    // The webhook results, all in one write (a dispatcher's: it only logs a failure).
    let outcome = store.finish_webhook_attempts(results).await;
    for reply in results_replies {
        let _ = reply.send(outcome.clone().map(|()| WriteOutcome::Done));
    }
    for (commit, reply) in batch.chunks(1).zip(replies) {
        let _ = reply.send(store.commit_batch(commit).await);
    }
}

async fn write(store: &Store, job: WriteJob) -> Result<WriteOutcome, StoreError> {
    match job {
        WriteJob::CreateTenant {
            tenant,
            key_id,
            key_hash,
            key_prefix,
            at,
        } => {
            store
                .insert_tenant(&tenant, &key_id, &key_hash, &key_prefix, at)
                .await?
        }
        WriteJob::CreateApiKey {
            tenant_id,
            key_id,
            key_hash,
            key_prefix,
            at,
        } => {
            store
                .insert_api_key(&tenant_id, &key_id, &key_hash, &key_prefix, at)
                .await?
        }
        WriteJob::EnsureTenant { tenant, at } => store.ensure_tenant(&tenant, at).await?,
        WriteJob::CreateConversation(new) => store.insert_conversation(&new).await?,
        WriteJob::SetArchived { id, archived, at } => store.set_archived(&id, archived, at).await?,
        WriteJob::DeleteConversation { id } => store.delete_conversation(&id).await?,
        WriteJob::Fork {
            new,
            from,
            message_ids,
        } => store.insert_fork(&new, &from, &message_ids).await?,
        WriteJob::Seeded {
            new,
            continued_from,
            message_id,
            message,
        } => {
            store
                .insert_seeded(&new, continued_from.as_deref(), &message_id, &message)
                .await?
        }
        WriteJob::InsertAttachments(new) => store.insert_attachments(&new).await?,
        WriteJob::CreateClientRequest(request, deliveries) => {
            store.insert_client_request(&request, &deliveries).await?
        }
        WriteJob::ResolveClientRequest {
            id,
            status,
            response,
            at,
        } => {
            let resolved = store
                .resolve_client_request(&id, status, response, at)
                .await?;
            return Ok(WriteOutcome::Resolved(resolved));
        }
        WriteJob::CreateClientToolCall(call, deliveries) => {
            store.insert_client_tool_call(&call, &deliveries).await?
        }
        WriteJob::ResolveClientToolCall {
            id,
            status,
            answer,
            at,
        } => {
            let resolved = store
                .resolve_client_tool_call(&id, status, answer, at)
                .await?;
            return Ok(WriteOutcome::Resolved(resolved));
        }
        WriteJob::CreateBackgroundTask(task) => store.insert_background_task(&task).await?,
        WriteJob::FinishBackgroundTask {
            id,
            status,
            output,
            exit_code,
            at,
        } => {
            let finished = store
                .finish_background_task(&id, status, &output, exit_code, at)
                .await?;
            return Ok(WriteOutcome::Resolved(finished));
        }
        WriteJob::ExpirePendingWork { at, conversation } => {
            let (requests, tasks) = store
                .expire_pending_work(at, conversation.as_deref())
                .await?;
            return Ok(WriteOutcome::Expired(requests, tasks));
        }
        WriteJob::PruneFrames { before, limit } => {
            // The replay log's steps keep the frames' window (issue 40). Another round is
            // due while either table gave up a whole batch.
            let frames = store.prune_frames(before, limit).await?;
            let steps = store.prune_steps(before, limit).await?;
            return Ok(WriteOutcome::Pruned(frames.max(steps)));
        }
        WriteJob::RecordUsage(record) => store.record(&record).await?,
        WriteJob::ReleaseBudget {
            tenant_id,
            reservation,
        } => store.release_budget(&tenant_id, &reservation).await?,
        WriteJob::AddMcpServer {
            tenant_id,
            server,
            at,
        } => {
            store.add_mcp_server(&tenant_id, &server, at).await?;
        }
        WriteJob::DeleteMcpServer { tenant_id, name } => {
            return Ok(WriteOutcome::Resolved(
                store.delete_mcp_server(&tenant_id, &name).await?,
            ));
        }
        WriteJob::PutAgent {
            tenant_id,
            name,
            definitions,
            making,
            at,
        } => {
            let made = store
                .put_agent_versions(&tenant_id, &name, &definitions, making, at)
                .await?;
            let first = made.first().map_or(0, |version| version.version);
            return Ok(WriteOutcome::Version(first));
        }
        WriteJob::DeleteAgent {
            tenant_id,
            name,
            at,
        } => {
            return Ok(WriteOutcome::Resolved(
                store.delete_agent(&tenant_id, &name, at).await?,
            ));
        }
        WriteJob::CreateWebhook(hook) => store.insert_webhook(&hook).await?,
        WriteJob::UpdateWebhook {
            tenant_id,
            id,
            change,
            at,
        } => {
            return Ok(WriteOutcome::Resolved(
                store.update_webhook(&tenant_id, &id, &change, at).await?,
            ));
        }
        WriteJob::RotateWebhookSecret {
            tenant_id,
            id,
            secret,
            previous_until,
            at,
        } => {
            return Ok(WriteOutcome::Resolved(
                store
                    .rotate_webhook_secret(&tenant_id, &id, &secret, previous_until, at)
                    .await?,
            ));
        }
        WriteJob::DeleteWebhook { tenant_id, id } => {
            return Ok(WriteOutcome::Resolved(
                store.delete_webhook(&tenant_id, &id).await?,
            ));
        }
        WriteJob::WebhookResults(results) => store.finish_webhook_attempts(&results).await?,
        WriteJob::WebhookCycle(cycle) => {
            let flying: Vec<&str> = cycle.flying.iter().map(String::as_str).collect();
            let (count, mine) = store
                .webhook_cycle(
                    cycle.now,
                    cycle.retry_for_ms,
                    cycle.fan_out_limit,
                    &cycle.claimed_by,
                    cycle.until,
                    cycle.claim_limit,
                    &flying,
                    cycle.held,
                )
                .await?;
            *cycle
                .claimed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = mine;
            return Ok(WriteOutcome::Count(count));
        }
        WriteJob::CreateSchedule(schedule) => store.insert_schedule(&schedule).await?,
        WriteJob::SetScheduleEnabled {
            tenant_id,
            id,
            enabled,
            next_fire_at,
            at,
        } => {
            return Ok(WriteOutcome::Resolved(
                store
                    .set_schedule_enabled(&tenant_id, &id, enabled, next_fire_at, at)
                    .await?,
            ));
        }
        WriteJob::DeleteSchedule { tenant_id, id } => {
            return Ok(WriteOutcome::Resolved(
                store.delete_schedule(&tenant_id, &id).await?,
            ));
        }
        WriteJob::ClaimScheduleFirings {
            claimed_by,
            now,
            until,
            late_ms,
            limit,
        } => {
            return Ok(WriteOutcome::Count(
                store
                    .claim_schedule_firings(&claimed_by, now, until, late_ms, limit)
                    .await?,
            ));
        }
        WriteJob::FinishScheduleRun(run) => {
            return Ok(WriteOutcome::Resolved(
                store.finish_schedule_run(&run).await?,
            ));
        }
        WriteJob::HandOffScheduleRun {
            schedule_id,
            fire_at,
            from,
            to,
            until,
        } => {
            return Ok(WriteOutcome::Resolved(
                store
                    .hand_off_schedule_run(&schedule_id, fire_at, (&from.0, &from.1), &to, until)
                    .await?,
            ));
        }
        WriteJob::PruneWebhooksAndRuns {
            deliveries_before,
            runs_before,
            limit,
        } => {
            let deliveries = store
                .prune_webhook_deliveries(deliveries_before, limit)
                .await?;
            let runs = store.prune_schedule_runs(runs_before, limit).await?;
            return Ok(WriteOutcome::Count(deliveries + runs));
        }
        WriteJob::RetryWebhookDelivery {
            tenant_id,
            webhook_id,
            id,
            now,
            retry_for_ms,
        } => {
            return Ok(WriteOutcome::Resolved(
                store
                    .retry_webhook_delivery(&tenant_id, &webhook_id, &id, now, retry_for_ms)
                    .await?,
            ));
        }
    }
    Ok(WriteOutcome::Done)
}

/// A cheap, cloneable handle on the persistence actor.
#[derive(Clone, Debug)]
pub struct Persistence {
    actor: ActorRef<PersistenceMsg>,
    /// How long a caller waits for a write before reporting the database unavailable.
    timeout: Duration,
}

impl Persistence {
    pub fn new(actor: ActorRef<PersistenceMsg>, timeout: Duration) -> Self {
        Self { actor, timeout }
    }

    pub fn actor(&self) -> &ActorRef<PersistenceMsg> {
        &self.actor
    }

    /// Writes one transition and waits for the outcome. There is no timeout here on
    /// purpose: a commit reported as failed must not land later, or the conversation's
    /// memory and its row would disagree. Every flush answers every commit it took (the
    /// database calls themselves are bounded by the pool's and the server's timeouts).
    pub async fn commit(&self, commit: Arc<ConversationCommit>) -> Result<(), StoreError> {
        self.request(|reply| PersistenceMsg::Commit(commit, reply), None)
            .await
    }

    /// [`commit`](Self::commit), ahead of everything queued.
    pub async fn commit_urgent(&self, commit: Arc<ConversationCommit>) -> Result<(), StoreError> {
        self.request(|reply| PersistenceMsg::UrgentCommit(commit, reply), None)
            .await
    }

    /// Runs one write and waits for it.
    pub async fn write(&self, job: WriteJob) -> Result<WriteOutcome, StoreError> {
        self.request(
            |reply| PersistenceMsg::Write(job, reply),
            Some(self.timeout),
        )
        .await
    }

    async fn request<T: Send + 'static>(
        &self,
        message: impl FnOnce(Reply<T>) -> PersistenceMsg,
        timeout: Option<Duration>,
    ) -> Result<T, StoreError> {
        use ractor::rpc::CallResult;
        match self.actor.call(message, timeout).await {
            Ok(CallResult::Success(result)) => result,
            Ok(CallResult::Timeout) => Err(StoreError::Unavailable(format!(
                "no commit within {} ms",
                self.timeout.as_millis()
            ))),
            Ok(CallResult::SenderError) | Err(_) => Err(StoreError::Unavailable(
                "the persistence actor has stopped".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ConversationCommit, NewConversation};
    use crate::state_machine::ConvState;
    use crate::store::testing::{at, row, sqlite_store};

    /// A commit that moves `id` to Error with `message`, expecting the event counter
    /// `expected_event`.
    fn to_error(
        id: &str,
        message: &str,
        next_sequence_id: i64,
        expected_event: i64,
    ) -> ConversationCommit {
        ConversationCommit {
            conversation_id: id.into(),
            state: Some(ConvState::Error {
                error_kind: crate::state_machine::ErrorKind::Unknown,
                message: message.into(),
            }),
            messages: Vec::new(),
            events: Vec::new(),
            usage: None,
            expected_next_sequence_id: next_sequence_id,
            expected_next_event_id: expected_event,
            next_sequence_id,
            next_event_id: expected_event,
            at: at(),
            lease: None,
            deliveries: Vec::new(),
            steps: Vec::new(),
        }
    }

    /// Flushes one commit and waits for its answer.
    async fn flush_one(store: &Store, commit: ConversationCommit) -> Result<(), StoreError> {
        let (tx, rx) = ractor::concurrency::oneshot();
        flush(
            store,
            &Metrics::default(),
            vec![Job::Commit(Arc::new(commit), tx.into())],
            || {},
        )
        .await;
        rx.await.expect("the commit is answered")
    }

    /// Flushes `jobs` and tells how many times the flush freed the writer, running `check`
    /// each time it does.
    async fn flush_counting(store: &Store, jobs: Vec<Job>, check: impl Fn()) -> usize {
        let mut freed = 0;
        flush(store, &Metrics::default(), jobs, || {
            freed += 1;
            check();
        })
        .await;
        freed
    }

    /// The writer is handed the next batch as soon as a batch is written, before it is
    /// durable and answered; every kind of flush frees the writer exactly once.
    /// Issue 41: the usage of an LLM response waits for a commit to go with (it arrives just
    /// before the response's own commit) instead of taking a transaction, and a sync of the
    /// log, of its own; alone, it is written after a short wait all the same.
    #[tokio::test]
    async fn usage_waits_for_a_commit_and_is_written_without_one() {
        use crate::store::{Reservation, UsageRecord};
        let (store, dir) = sqlite_store("usage-waits", &["c1"]).await;
        let metrics = Arc::new(Metrics::default());
        let (actor, handle) = Actor::spawn(None, PersistenceActor, (store.clone(), metrics))
            .await
            .expect("the actor starts");
        let persistence = Persistence::new(actor.clone(), Duration::from_secs(30));
        let usage = |tokens| {
            WriteJob::RecordUsage(UsageRecord {
                tenant_id: "t".into(),
                model: "m".into(),
                tokens: (tokens, 0),
                reservation: Reservation::Unlimited,
                at: Utc::now(),
            })
        };
        let day = Utc::now().date_naive().format("%Y-%m-%d").to_string();
        // Alone: written after the wait.
        persistence.write(usage(10)).await.expect("recorded");
        let used = store.usage("t", &day, &day).await.expect("reads");
        assert_eq!(used.first().map(|u| u.input_tokens), Some(10));
        // With a commit that follows at once: both land (in one batch when the commit comes
        // within the wait).
        let before = row(&store, "c1").await;
        let commit = to_error("c1", "x", before.next_sequence_id, before.next_event_id);
        let (recorded, committed) = tokio::join!(
            persistence.write(usage(5)),
            persistence.commit(Arc::new(commit))
        );
        recorded.expect("recorded");
        committed.expect("committed");
        let used = store.usage("t", &day, &day).await.expect("reads");
        assert_eq!(used.first().map(|u| u.input_tokens), Some(15));
        actor.stop(None);
        let _ = handle.await;
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn the_writer_is_freed_once_before_the_answers() {
        let (store, dir) = sqlite_store("freed", &["c1"]).await;
        let before = row(&store, "c1").await;
        let (tx, rx) = ractor::concurrency::oneshot();
        let commit = to_error("c1", "x", before.next_sequence_id, before.next_event_id);
        let answer = Arc::new(std::sync::Mutex::new(rx));
        let seen = Arc::clone(&answer);
        let jobs = vec![Job::Commit(Arc::new(commit), tx.into())];
        let freed = flush_counting(&store, jobs, move || {
            let pending = seen.lock().expect("not poisoned").try_recv();
            assert!(pending.is_err(), "answered before the writer was freed");
        })
        .await;
        assert_eq!(freed, 1);
        let answered = answer.lock().expect("not poisoned").try_recv();
        assert!(matches!(answered, Ok(Ok(()))), "{answered:?}");

        for jobs in [
            vec![Job::Checkpoint],
            vec![Job::Write(
                WriteJob::SetArchived {
                    id: "c1".into(),
                    archived: true,
                    at: at(),
                },
                ractor::concurrency::oneshot().0.into(),
            )],
        ] {
            assert_eq!(flush_counting(&store, jobs, || {}).await, 1);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A cancel's commit gets a flush of its own where flushes run side by side: the urgent
    /// commits at the front of the queue are taken, nothing behind them; a batch takes
    /// urgent and ordinary commits alike.
    #[test]
    fn urgent_commits_at_the_front_are_taken_alone() {
        let job = |urgent: bool| {
            let (tx, _rx) = ractor::concurrency::oneshot();
            let commit = Arc::new(to_error("c", "x", 1, 1));
            if urgent {
                Job::Urgent(commit, tx.into())
            } else {
                Job::Commit(commit, tx.into())
            }
        };
        let mut queue: VecDeque<Job> = [job(true), job(true), job(false), job(true)].into();
        let urgent = take_urgent(&mut queue);
        assert_eq!(urgent.len(), 2);
        assert!(urgent.iter().all(|j| matches!(j, Job::Urgent(..))));
        assert_eq!(queue.len(), 2);
        assert!(matches!(queue.front(), Some(Job::Commit(..))));
        assert!(take_urgent(&mut queue).is_empty(), "none at the front");
        assert_eq!(take_batch(&mut queue).len(), 2, "a batch takes both kinds");
        assert!(queue.is_empty());
    }

    /// A group commit with one stale commit in it: the others still land, and only the
    /// stale one is answered with a conflict (the fallback that writes each alone).
    #[tokio::test]
    async fn a_bad_commit_does_not_fail_its_neighbours() {
        let ids = ["c1", "c2", "c3"];
        let (store, dir) = sqlite_store("flush", &ids).await;
        let before = row(&store, "c1").await;
        let stale = before.next_event_id + 7;
        let mut jobs = Vec::new();
        let mut answers = Vec::new();
        for (id, expected) in [
            ("c1", before.next_event_id),
            ("c2", stale),
            ("c3", before.next_event_id),
        ] {
            let (tx, rx) = ractor::concurrency::oneshot();
            let commit = to_error(id, "x", before.next_sequence_id, expected);
            jobs.push(Job::Commit(Arc::new(commit), tx.into()));
            answers.push(rx);
        }
        assert_eq!(flush_counting(&store, jobs, || {}).await, 1, "freed once");

        let mut outcomes = Vec::new();
        for rx in answers {
            outcomes.push(rx.await.expect("every commit is answered"));
        }
        assert!(outcomes[0].is_ok(), "{outcomes:?}");
        assert!(
            matches!(outcomes[1], Err(StoreError::Conflict(_))),
            "{outcomes:?}"
        );
        assert!(outcomes[2].is_ok(), "{outcomes:?}");
        for (id, landed) in [("c1", true), ("c2", false), ("c3", true)] {
            let state = row(&store, id).await.state;
            assert_eq!(matches!(state, ConvState::Error { .. }), landed, "{id}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Issue 39: an event's deliveries land in its commit's transaction, claimed as they
    /// were made; one for an endpoint disabled or deleted since this node read the endpoints
    /// is not written, and takes nothing down with it (on both databases).
    #[tokio::test]
    async fn deliveries_land_with_their_commit_for_enabled_endpoints_only() {
        let (sqlite, dir) = sqlite_store("deliveries", &["c1"]).await;
        let postgres = crate::store::testing::postgres_store(&["c1"]).await;
        let mut stores = vec![&sqlite];
        if let Some((store, _)) = &postgres {
            stores.push(store);
        }
        for store in stores {
            for (id, enabled) in [("wh_on", true), ("wh_off", false)] {
                store
                    .insert_webhook(&crate::model::Webhook {
                        id: id.into(),
                        tenant_id: "t".into(),
                        url: "http://127.0.0.1:9/".into(),
                        events: vec!["turn.completed".into()],
                        description: None,
                        enabled,
                        disabled_reason: None,
                        secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".to_owned().into(),
                        previous_secret: None,
                        previous_secret_until: None,
                        failing_since: None,
                        created_at: 1,
                        updated_at: 1,
                    })
                    .await
                    .expect("an endpoint");
            }
            let delivery = |id: &str, webhook: &str, claimed: bool| crate::model::NewDelivery {
                id: id.into(),
                webhook_id: webhook.into(),
                tenant_id: "t".into(),
                conversation_id: "c1".into(),
                event_seq: 7,
                event_type: "turn.completed",
                payload: "{}".into(),
                created_at: 10,
                expires_at: 100,
                claimed: claimed.then(|| ("n/direct".to_owned(), 70)),
            };
            let before = row(store, "c1").await;
            let mut commit = to_error("c1", "x", before.next_sequence_id, before.next_event_id);
            commit.deliveries = vec![
                delivery("msg_1", "wh_on", true),
                delivery("msg_2", "wh_off", false),
                delivery("msg_3", "wh_gone", true),
            ];
            flush_one(store, commit).await.expect("the commit lands");
            assert!(matches!(
                row(store, "c1").await.state,
                ConvState::Error { .. }
            ));
            let on = store
                .webhook_deliveries("t", "wh_on", Some("pending"), None, 10)
                .await
                .expect("reads");
            assert_eq!(
                on.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(),
                ["msg_1"]
            );
            assert_eq!((on[0].event_seq, on[0].attempts_log.as_str()), (7, "[]"));
            let off = store
                .webhook_deliveries("t", "wh_off", None, None, 10)
                .await
                .expect("reads");
            assert!(off.is_empty(), "a disabled endpoint gets nothing");
            // The claim it was made under holds it: a read of pending pairs that leaves out
            // that claim's does not see it, another does.
            let pairs = |except: &'static str| async move {
                store.pending_pairs(except).await.expect("reads")
            };
            assert!(pairs("n/direct").await.is_empty());
            assert_eq!(pairs("n2").await, [("wh_on".to_owned(), "c1".to_owned())]);
            // A delivery that cannot be written (its id taken) takes its commit down with it:
            // on SQLite the deliveries run after the batch's text, in its transaction.
            let before = row(store, "c1").await;
            let mut commit = to_error("c1", "y", before.next_sequence_id, before.next_event_id);
            commit.deliveries = vec![delivery("msg_1", "wh_on", true)];
            assert!(flush_one(store, commit).await.is_err(), "the id is taken");
            let message = |state: ConvState| {
                let ConvState::Error { message, .. } = state else {
                    panic!("{state:?}");
                };
                message
            };
            assert_eq!(
                message(row(store, "c1").await.state),
                "x",
                "nothing of the commit landed"
            );
            // And the writer goes on.
            let mut commit = to_error("c1", "z", before.next_sequence_id, before.next_event_id);
            commit.deliveries = vec![delivery("msg_4", "wh_on", false)];
            flush_one(store, commit)
                .await
                .expect("the next commit lands");
            assert_eq!(message(row(store, "c1").await.state), "z");
            let on = store
                .webhook_deliveries("t", "wh_on", None, None, 10)
                .await
                .expect("reads");
            assert_eq!(
                on.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(),
                ["msg_4", "msg_1"]
            );
        }
        let _ = std::fs::remove_dir_all(dir);
        if let Some((store, name)) = postgres {
            crate::store::testing::drop_postgres(store, &name).await;
        }
    }

    /// New conversations are written with the commits of their batch; one whose slug is
    /// taken fails alone (the fallback that writes each alone), on both databases.
    #[tokio::test]
    async fn new_conversations_go_with_the_batch_and_fail_alone() {
        let (sqlite, dir) = sqlite_store("created", &["c1"]).await;
        let postgres = crate::store::testing::postgres_store(&["c1"]).await;
        let mut stores = vec![&sqlite];
        if let Some((store, _)) = &postgres {
            stores.push(store);
        }
        for store in stores {
            let before = row(store, "c1").await;
            let mut jobs = Vec::new();
            let mut created = Vec::new();
            for (id, slug) in [("n1", "fresh"), ("n2", "taken"), ("n3", "taken")] {
                let (tx, rx) = ractor::concurrency::oneshot();
                let mut new = NewConversation::user(id, "t", "/tmp", "m", at());
                new.slug = slug.into();
                jobs.push(Job::Write(WriteJob::CreateConversation(new), tx.into()));
                created.push(rx);
            }
            let (tx, committed) = ractor::concurrency::oneshot();
            let commit = to_error("c1", "x", before.next_sequence_id, before.next_event_id);
            jobs.push(Job::Commit(Arc::new(commit), tx.into()));
            let mut queue: VecDeque<Job> = jobs.into();
            let batch = take_batch(&mut queue);
            assert_eq!(
                batch.len(),
                4,
                "one batch takes commits and new conversations"
            );
            assert_eq!(flush_counting(store, batch, || {}).await, 1);
            let mut outcomes = Vec::new();
            for rx in created {
                outcomes.push(rx.await.expect("answered"));
            }
            assert!(
                matches!(outcomes[0], Ok(WriteOutcome::Done)),
                "{outcomes:?}"
            );
            assert!(
                matches!(outcomes[1], Ok(WriteOutcome::Done)),
                "{outcomes:?}"
            );
            assert!(
                matches!(outcomes[2], Err(StoreError::Conflict(_))),
                "{outcomes:?}"
            );
            assert!(matches!(committed.await, Ok(Ok(()))));
            assert!(matches!(
                row(store, "c1").await.state,
                ConvState::Error { .. }
            ));
            for (id, exists) in [("n1", true), ("n2", true), ("n3", false)] {
                let found = store.conversation_by_id(id).await.expect("reads");
                assert_eq!(found.is_some(), exists, "{id}");
            }
        }
        if let Some((store, name)) = postgres {
            crate::store::testing::drop_postgres(store, &name).await;
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Checkpoint passes come often while the log grows fast, rarely while it does not; a
    /// log that started over counts from its start.
    #[test]
    fn passes_follow_the_write_rate() {
        assert_eq!(pause_after(0, 0), CHECKPOINT_QUIET_EVERY);
        assert_eq!(
            pause_after(5_000, 5_000 + BUSY_PASS_FRAMES - 1),
            CHECKPOINT_QUIET_EVERY
        );
        assert_eq!(
            pause_after(5_000, 5_000 + BUSY_PASS_FRAMES),
            CHECKPOINT_BUSY_EVERY
        );
        assert_eq!(pause_after(17_000, 300), CHECKPOINT_QUIET_EVERY);
        assert_eq!(pause_after(17_000, 2_000), CHECKPOINT_BUSY_EVERY);
    }

    /// The passes beside the commits go on while each finds many new frames, and stop at the
    /// first that finds few, at an error, or after [`CATCH_UP_PASSES`].
    #[tokio::test]
    async fn passes_catch_up_until_one_finds_few_new_frames() {
        /// Runs the passes against scripted log lengths (`None`: the pass fails); the last
        /// length seen and the passes run.
        async fn run(first: u64, lengths: &[Option<u64>]) -> (u64, usize) {
            let calls = std::cell::Cell::new(0);
            let last = catch_up(first, || {
                let answer = lengths[calls.get()]
                    .map(Some)
                    .ok_or_else(|| StoreError::Unavailable("gone".into()));
                calls.set(calls.get() + 1);
                async move { answer }
            })
            .await;
            (last, calls.get())
        }
        let few = QUEUED_CHECKPOINT_FRAMES;
        // +4,000, +1,000, then +few: the third pass found few new frames.
        let lengths = [Some(24_000), Some(25_000), Some(25_000 + few), Some(99_999)];
        assert_eq!(run(20_000, &lengths).await, (25_000 + few, 3));
        // A log that keeps growing fast gets at most CATCH_UP_PASSES passes.
        let growing: Vec<_> = (1..=CATCH_UP_PASSES as u64 + 4)
            .map(|i| Some(20_000 + i * 10 * few))
            .collect();
        assert_eq!(run(20_000, &growing).await.1, CATCH_UP_PASSES);
        // A failed pass ends them; the queued checkpoint still follows.
        assert_eq!(
            run(20_000, &[Some(30_000), None, Some(30_001)]).await,
            (30_000, 2)
        );
    }

    /// REQ-BED-007 (durable, bounded storage): a checkpoint run in the queue, between two
    /// flushes, lets SQLite start its write-ahead log over, so the log file stays as long as
    /// the writes between two checkpoints instead of growing with every commit ever made.
    #[tokio::test]
    async fn a_queued_checkpoint_starts_the_log_over() {
        let ids: Vec<String> = (0..40).map(|i| format!("c{i}")).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let (store, dir) = sqlite_store("checkpoint", &refs).await;
        let row = row(&store, "c0").await;
        let wal = dir.join("db.sqlite-wal");
        let log_bytes = || std::fs::metadata(&wal).map_or(0, |m| m.len());
        let mut sizes = Vec::new();
        for round in 0..3 {
            if round > 0 {
                flush(&store, &Metrics::default(), vec![Job::Checkpoint], || {}).await;
            }
            let start = log_bytes();
            // A row written again unchanged is not written at all: each round says more.
            let message = "x".repeat(round + 1);
            for id in &refs {
                let commit = to_error(id, &message, row.next_sequence_id, row.next_event_id);
                flush_one(&store, commit).await.expect("commits");
            }
            sizes.push((start, log_bytes()));
        }
        let (start, end) = sizes[0];
        assert!(end > start, "the first round appends to the log: {sizes:?}");
        for &(start, end) in &sizes[1..] {
            assert_eq!(
                start, end,
                "after a checkpoint the log is written over from its start: {sizes:?}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
