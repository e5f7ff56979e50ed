//! The store: the only code that knows sea-orm. Reads are open to everyone; writes are
//! `pub(crate)` and called only by the persistence actor, the one owner of database writes.
//!
//! SQLite (the embedded default, WAL mode, every commit synced before it is acknowledged)
//! and Postgres share every code path here but the group commit, which each does in one
//! round trip of its own (`sqlite.rs`, `postgres.rs`).

mod agents;
mod client_tools;
mod cluster;
mod codec;
mod conversation_rows;
mod error;
mod history;
mod limits;
mod mcp;
mod packed;
mod postgres;
mod quotas;
mod requests;
mod schedules;
mod sqlite;
mod steps;
mod tenant_rows;
mod webhooks;

use conversation_rows::{conversation, conversation_row};

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use entity::conversations;
use migration::{Migrator, MigratorTrait};
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, EntityTrait,
    TransactionTrait,
};
use serde::Serialize;

pub use agents::Making;
pub use cluster::{FRAMES_CHANNEL, Lease, Node, Owner, WATCH_CHANNEL};
pub use error::StoreError;
pub use limits::{BudgetState, ModelUsage, Reservation, TenantLimits, UsageRecord, period_of};
pub use mcp::McpServer;
pub use schedules::RunOutcome;
pub(crate) use sqlite::Durable;
pub use steps::{ReplayFilter, ReplayInput};
pub use webhooks::{ATTEMPTS_KEPT, Attempt, WebhookChange, WebhookResults};

use crate::model::{ConversationCommit, NewConversation, StoredFrame};

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A row of frames as read back, its items as text.
#[derive(Debug, sea_orm::FromQueryResult)]
struct StoredRow {
    first_event_id: i64,
    last_event_id: i64,
    /// Before migration 21; `''` or NULL on a packed row.
    frames: Option<String>,
    packed_frames: Option<Vec<u8>>,
}

/// A row of `conversation_frames` to write: a commit's frames, in a run that carries at most
/// one dedup key.
#[derive(Debug, Serialize)]
struct NewFrames<'a> {
    conversation_id: &'a str,
    last_event_id: i64,
    first_event_id: i64,
    /// The items, JSON text, while the row is made; stored packed.
    #[serde(skip)]
    frames: String,
    /// The items packed (src/store/packed.rs; base64 in Postgres's document).
    #[serde(serialize_with = "base64_bytes")]
    packed_frames: Vec<u8>,
    dedup_key: Option<&'a str>,
    /// Milliseconds since the Unix epoch.
    created_at: i64,
    /// The commit's steps of the replay log (issue 40), on its last row of frames: no row of
    /// their own, no index entry of their own. (A commit without frames writes its steps to
    /// `conversation_steps`.) Packed.
    first_step: Option<i64>,
    last_step: Option<i64>,
    #[serde(serialize_with = "base64_option")]
    packed_steps: Option<Vec<u8>>,
}

/// Bytes as base64, the way Postgres's `decode(..., 'base64')` reads them (a packed value in
/// `bedrock_commit`'s documents).
fn base64_text(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn base64_bytes<S: serde::Serializer>(
    bytes: &[u8],
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    serializer.serialize_str(&base64_text(bytes))
}

fn base64_option<S: serde::Serializer>(
    bytes: &Option<Vec<u8>>,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    match bytes {
        Some(bytes) => base64_bytes(bytes, serializer),
        None => serializer.serialize_none(),
    }
}

/// The rows a commit's frames are stored in: consecutive frames share a row, a second
/// dedup key starts a new one.
fn frame_rows(commit: &ConversationCommit) -> Vec<NewFrames<'_>> {
    let mut rows: Vec<NewFrames<'_>> = Vec::new();
    for event in &commit.events {
        let joins = rows.last().is_some_and(|row| {
            row.last_event_id + 1 == event.event_id
                && !(row.dedup_key.is_some() && event.dedup_key.is_some())
        });
        if !joins {
            rows.push(NewFrames {
                conversation_id: &commit.conversation_id,
                last_event_id: event.event_id,
                first_event_id: event.event_id,
                frames: String::from("["),
                packed_frames: Vec::new(),
                dedup_key: None,
                created_at: event.created_at.timestamp_millis(),
                first_step: None,
                last_step: None,
                packed_steps: None,
            });
        }
        let Some(row) = rows.last_mut() else {
            continue; // just pushed
        };
        if joins {
            row.frames.push(',');
        }
        match &event.stored {
            StoredFrame::Message { sequence_id } => {
                row.frames.push_str("{\"m\":");
                row.frames.push_str(&sequence_id.to_string());
            }
            StoredFrame::State(state) => {
                row.frames.push_str("{\"s\":");
                row.frames.push_str(state);
            }
            StoredFrame::Whole => {
                row.frames.push_str("{\"f\":");
                row.frames.push_str(&event.payload);
            }
        }
        row.frames.push('}');
        row.last_event_id = event.event_id;
        if let Some(key) = &event.dedup_key {
            row.dedup_key = Some(key);
        }
    }
    for row in &mut rows {
        row.frames.push(']');
        // The text is not kept once packed.
        row.packed_frames = packed::pack(&std::mem::take(&mut row.frames));
    }
    if let Some(last) = rows.last_mut()
        && let (Some(first), Some(end)) = (commit.steps.first(), commit.steps.last())
    {
        last.first_step = Some(first.n);
        last.last_step = Some(end.n);
        last.packed_steps = Some(packed_steps(commit));
    }
    rows
}

/// A commit's steps, packed.
fn packed_steps(commit: &ConversationCommit) -> Vec<u8> {
    packed::pack(&crate::model::LoggedStep::array(&commit.steps))
}

/// Whether a commit's steps need a row of `conversation_steps` (it has steps but no frames
/// to carry them).
fn steps_row(commit: &ConversationCommit) -> bool {
    !commit.steps.is_empty() && commit.events.is_empty()
}

/// `column` (a conversation key) names the conversation `id`: messages and rows of frames
/// refer to their conversation by its `internal_key`, found here by its id.
fn of_conversation(column: impl sea_orm::sea_query::IntoColumnRef, id: &str) -> Expr {
    let key = sea_orm::sea_query::Query::select()
        .column(INTERNAL_KEY)
        .from(conversations::Entity)
        .and_where(Expr::col(conversations::Column::Id).eq(id))
        .to_owned();
    Expr::col(column).eq(Expr::SubQuery(None, Box::new(key.into())))
}

/// The conversations' column of the integer key their messages and frames refer to them by
/// (the database sets it; the application only looks conversations up by id).
const INTERNAL_KEY: &str = "internal_key";

/// The event id of each message's frame in `commit`, by sequence id.
fn message_event_id(commit: &ConversationCommit, sequence_id: i64) -> Option<i64> {
    commit.events.iter().find_map(|event| match event.stored {
        StoredFrame::Message { sequence_id: seq } if seq == sequence_id => Some(event.event_id),
        StoredFrame::Message { .. } | StoredFrame::State(_) | StoredFrame::Whole => None,
    })
}

/// How the store connects.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    pub url: String,
    pub max_connections: u32,
    /// How long a request waits for a pooled connection before the database counts as
    /// unavailable.
    pub acquire_timeout: Duration,
}

/// A handle on the database; cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    db: DatabaseConnection,
    /// SQLite: the pool writes go through, with the connection group commits keep.
    writer: Option<sqlite::Writer>,
    /// Postgres: other nodes are live (as of the last heartbeat), so this node's frames
    /// are announced to them (see the cluster's `frames` module).
    peers: Arc<std::sync::atomic::AtomicBool>,
    /// Tenants found without a token budget (see `limits::NO_BUDGET_FOR`).
    no_budget: Absent,
    /// Tenants found without MCP servers (see `mcp::NO_SERVERS_FOR`).
    no_mcp_servers: Absent,
}

/// An image to store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewAttachment {
    pub id: String,
    pub tenant_id: String,
    pub conversation_id: String,
    pub media_type: String,
    pub data: Vec<u8>,
    pub width: u32,
    pub height: u32,
    pub created_at: DateTime<Utc>,
}

/// A stored image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    pub id: String,
    pub media_type: String,
    pub data: Vec<u8>,
}

impl Store {
    /// Connects, creating the SQLite file and its directory when needed.
    pub async fn connect(options: &StoreOptions) -> Result<Store> {
        if let Some(path) = sqlite_path(&options.url)
            && let Some(dir) = Path::new(&path)
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
        {
            std::fs::create_dir_all(dir).map_err(|e| {
                StoreError::Unavailable(format!("cannot create {}: {e}", dir.display()))
            })?;
        }
        let mut connect = ConnectOptions::new(options.url.clone());
        connect
            .max_connections(options.max_connections)
            .min_connections(1)
            .acquire_timeout(options.acquire_timeout)
            .connect_timeout(options.acquire_timeout)
            .sqlx_logging(false)
            // A connection in use is known to work: pinging each at checkout cost a round trip
            // to the database (for SQLite, to its worker thread) per transaction. Only one
            // idle long enough to have been dropped (a database restart, a proxy) is checked.
            .test_before_acquire_if_idle_for(Duration::from_secs(1))
            .map_sqlx_sqlite_opts(|opts| sqlite_options(opts, READ_CACHE))
            .map_sqlx_sqlite_pool_opts(|pool| {
                pool.after_connect(|conn, _| Box::pin(stable_plans(conn)))
            })
            // A statement stuck on a dead connection must fail, not hang a flush.
            .map_sqlx_postgres_opts(|opts| opts.options([("statement_timeout", "15000")]))
            .map_sqlx_postgres_pool_opts(|pool| {
                pool.after_connect(|conn, _| Box::pin(postgres::no_delay(conn)))
            });
        // SQLite drops a connection's whole page cache when it begins a transaction after
        // another connection has written. Commits taking turns over the pool's connections
        // found every B-tree page they touched gone and read each back from the file, a
        // system call a page: their statements ran at half speed. Writes have a pool of their
        // own (see `sqlite::Writer`), and group commits keep one connection of it, whose
        // cache stays warm; reads go through the main pool.
        let db = Database::connect(connect.clone()).await?;
        let writer = if db.get_database_backend() == DbBackend::Sqlite {
            let mut two = connect;
            two.max_connections(2)
                .min_connections(1)
                .map_sqlx_sqlite_opts(|opts| {
                    sqlite_options(opts, WRITE_CACHE)
                        .statement_cache_capacity(sqlite::WRITER_STATEMENTS)
                })
                .map_sqlx_sqlite_pool_opts(|pool| {
                    pool.after_connect(|conn, _| {
                        Box::pin(async move {
                            stable_plans(conn).await?;
                            sqlite::prepare(conn).await
                        })
                    })
                });
            Some(sqlite::Writer::new(Database::connect(two).await?).await?)
        } else {
            None
        };
        Ok(Store {
            db,
            writer,
            peers: Arc::default(),
            no_budget: Absent::default(),
            no_mcp_servers: Absent::default(),
        })
    }

    /// The connection writes go through.
    fn writer(&self) -> &DatabaseConnection {
        self.writer.as_ref().map_or(&self.db, |w| &w.pool)
    }

    /// Applies every pending migration.
    pub async fn migrate(&self) -> Result<()> {
        Migrator::up(&self.db, None).await?;
        Ok(())
    }

    /// Makes (or drops) the index of stored frames by age, which retention needs to find
    /// old frames and nothing else uses: every frame stored pays for it, so it exists only
    /// where frames have a retention window. On Postgres it is built without blocking
    /// writes.
    pub async fn index_frames_by_age(&self, on: bool) -> Result<()> {
        let postgres = self.backend() == DbBackend::Postgres;
        // The replay log's steps share the window (issue 40).
        for table in ["conversation_frames", "conversation_steps"] {
            let sql = match (on, postgres) {
                (true, false) => {
                    format!("CREATE INDEX IF NOT EXISTS {table}_created ON {table} (created_at)")
                }
                (true, true) => format!(
                    "CREATE INDEX CONCURRENTLY IF NOT EXISTS {table}_created ON {table} (created_at)"
                ),
                (false, _) => format!("DROP INDEX IF EXISTS {table}_created"),
            };
            self.db.execute_unprepared(&sql).await?;
        }
        Ok(())
    }

    pub fn backend(&self) -> DbBackend {
        self.db.get_database_backend()
    }

    /// Copies the SQLite write-ahead log back into the database as far as readers allow,
    /// without blocking writers (a passive checkpoint), and tells how many frames the log
    /// held. `None` on Postgres, which has nothing to do.
    ///
    /// A checkpoint that copies the whole log lets the next commit start the log over; one
    /// that runs beside a steady stream of commits never catches up, so the persistence
    /// actor also runs one between two of its flushes when the log grows long.
    pub async fn checkpoint(&self) -> Result<Option<u64>> {
        if self.backend() != DbBackend::Sqlite {
            return Ok(None);
        }
        let frames: Option<i64> =
            sqlite::one_value(&self.db, "PRAGMA wal_checkpoint(PASSIVE)", 1).await?;
        Ok(Some(u64::try_from(frames.unwrap_or(0)).unwrap_or(0)))
    }

    /// Syncs SQLite's database file (nothing on Postgres or in memory).
    ///
    /// A checkpoint syncs the file only when it copied the whole log, which one beside a
    /// steady stream of commits never does: the pages it copied stayed dirty in the kernel,
    /// megabytes of them, until the checkpoint between two flushes (the one that lets the log
    /// start over) synced them all while every commit waited (11 – 23 ms measured at 1,000
    /// turns/s). Synced after each pass beside the commits instead, that one finds little.
    pub(crate) async fn sync_database(&self) -> Result<()> {
        match self.writer.as_ref().and_then(|w| w.file.clone()) {
            Some(file) => sqlite::sync_file(file).await,
            None => Ok(()),
        }
    }

    /// Whether the database answers (GET /readyz).
    pub async fn ping(&self) -> Result<()> {
        self.db.ping().await?;
        Ok(())
    }

    /// Connections open in the pool.
    pub fn pool_size(&self) -> u32 {
        if self.backend() == DbBackend::Postgres {
            self.db.get_postgres_connection_pool().size()
        } else {
            self.db.get_sqlite_connection_pool().size()
                + self
                    .writer
                    .as_ref()
                    .map_or(0, |w| w.pool.get_sqlite_connection_pool().size())
        }
    }

    /// Closes the pool.
    pub async fn close(self) -> Result<()> {
        if let Some(writer) = self.writer {
            writer.close().await?;
        }
        self.db.close().await?;
        Ok(())
    }

    // ---- Reads ----

    /// Writes several conversations' transitions in one transaction (group commit): each
    /// commit's guarded update must find its conversation's counters as it expects, or
    /// nothing of the batch is written ([`StoreError::Conflict`]).
    pub(crate) async fn commit_batch(&self, commits: &[Arc<ConversationCommit>]) -> Result<()> {
        self.write_batch(commits, &[], &[], &WebhookResults::default())
            .await?
            .wait()
            .await
    }

    /// Whether webhook attempts' results cost nothing beside a batch of commits (SQLite's
    /// group commit: its text, its connection); elsewhere they are written alone, so that
    /// they never fail the commits they would have gone with.
    pub(crate) fn results_ride_with_commits(&self) -> bool {
        self.writer.is_some()
    }

    /// [`Store::commit_batch`] in two steps: the batch is written (and visible) when this
    /// returns, and durable when the answer's `wait` returns. The next batch may be written
    /// in between (SQLite syncs its log off the write lock; a Postgres commit is durable
    /// when it returns).
    /// New conversations in `created` are written in the batch's transaction.
    /// The usage of LLM responses in `usage` is recorded in the batch's transaction too, so
    /// that it costs no transaction (and no sync of the log) of its own.
    pub(crate) async fn write_batch(
        &self,
        commits: &[Arc<ConversationCommit>],
        created: &[NewConversation],
        usage: &[UsageRecord],
        results: &WebhookResults,
    ) -> Result<Durable> {
        match &self.writer {
            Some(writer) => {
                let rows = created
                    .iter()
                    .map(conversation_row)
                    .collect::<Result<Vec<_>>>()?;
                let more = Store::sqlite_usage_statements(usage);
                let mut alone = sqlite::insert_deliveries(commits);
                // The results' statements as one text: their mixes are few.
                alone.extend(sqlite::one_text(webhooks::finish_statements(
                    results, false,
                )));
                writer.write(commits, rows, more, alone).await
            }
            // Webhook results in a transaction of their own before the commits (the
            // persistence actor writes them alone instead: `results_ride_with_commits`).
            None if !results.is_empty() => {
                self.finish_webhook_attempts(results).await?;
                Box::pin(self.write_batch(commits, created, usage, &WebhookResults::default()))
                    .await
            }
            None if created.is_empty() => {
                postgres::commit(&self.db, commits, usage).await?;
                Ok(Durable::default())
            }
            // With new conversations, a transaction around their insert and the commit: the
            // batch lands whole or not at all, as on SQLite.
            None => {
                let rows = created
                    .iter()
                    .map(conversation_row)
                    .collect::<Result<Vec<_>>>()?;
                let transaction = self.db.begin().await?;
                conversations::Entity::insert_many(rows)
                    .exec(&transaction)
                    .await?;
                if !commits.is_empty() || !usage.is_empty() {
                    postgres::commit(&transaction, commits, usage).await?;
                }
                transaction.commit().await?;
                Ok(Durable::default())
            }
        }
    }
}

/// How every SQLite connection is set up, with `cache_size` of page cache (a writer's or a
/// reader's, below).
fn sqlite_options(
    opts: sea_orm::sqlx::sqlite::SqliteConnectOptions,
    cache_size: &'static str,
) -> sea_orm::sqlx::sqlite::SqliteConnectOptions {
    use sea_orm::sqlx::sqlite::{SqliteJournalMode, SqliteSynchronous};
    opts.journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .foreign_keys(true)
        .busy_timeout(Duration::from_secs(2))
        // Checkpoints run in the background (see `checkpoint`), not inside whichever commit
        // crosses the threshold.
        .pragma("wal_autocheckpoint", "0")
        // Statement journals and sorts in memory: as files, each was created and deleted
        // within a commit (a tenth of the writer's time in the kernel).
        .pragma("temp_store", "memory")
        .pragma("cache_size", cache_size)
}

/// Page cache of a writer's connection: 8 MiB (SQLite's default is 2 MiB), so the hot pages
/// of the tables and indexes a commit touches stay cached.
const WRITE_CACHE: &str = "-8192";

/// Page cache of a reader's connection: 512 KiB. Under writes a reader's cache lasts one
/// transaction (SQLite drops it when the database changed since the last), so a bigger one
/// only held memory: with 8 MiB, the pages 5,000 activations read stayed in every reader
/// that read them, 2 – 3 KB of RSS per activated conversation.
const READ_CACHE: &str = "-512";

/// Turns on SQLite's query planner stability guarantee for a new connection. Without it a
/// statement with a bound LIMIT (sea-orm binds every LIMIT, `.one()`'s included) is parsed
/// and planned again at every execution, because its plan might depend on the value: that
/// was a tenth of the server's CPU. Plans here never depend on values (there are no
/// statistics), so nothing is lost.
#[allow(unsafe_code)]
async fn stable_plans(
    conn: &mut sea_orm::sqlx::SqliteConnection,
) -> std::result::Result<(), sea_orm::sqlx::Error> {
    let mut handle = conn.lock_handle().await?;
    let db = handle.as_raw_handle().as_ptr();
    // SAFETY: `db` is an open connection, held exclusively through the lock for this call;
    // SQLITE_DBCONFIG_ENABLE_QPSG takes an int and an optional int pointer.
    let rc = unsafe {
        libsqlite3_sys::sqlite3_db_config(
            db,
            libsqlite3_sys::SQLITE_DBCONFIG_ENABLE_QPSG,
            1 as std::ffi::c_int,
            std::ptr::null_mut::<std::ffi::c_int>(),
        )
    };
    if rc != libsqlite3_sys::SQLITE_OK {
        return Err(sea_orm::sqlx::Error::Configuration(
            format!("SQLite refused SQLITE_DBCONFIG_ENABLE_QPSG (code {rc})").into(),
        ));
    }
    Ok(())
}

/// The most rows one batched statement carries: under both databases' bind-parameter
/// limits (SQLite 32,766; Postgres 65,535) at the widest row (12 parameters).
const MAX_ROWS_PER_STATEMENT: usize = 256;

/// `items` in consecutive chunks whose lengths are powers of two (at most
/// [`MAX_ROWS_PER_STATEMENT`]): 37 rows go as 32, 4 and 1.
fn shaped_chunks<T>(items: &[T]) -> impl Iterator<Item = &[T]> {
    let mut rest = items;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let len = rest.len().min(MAX_ROWS_PER_STATEMENT);
        let size = 1 << len.ilog2();
        let (chunk, tail) = rest.split_at(size);
        rest = tail;
        Some(chunk)
    })
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The file path of a `sqlite://PATH?...` URL, for creating its directory.
fn sqlite_path(url: &str) -> Option<String> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split('?').next().unwrap_or_default();
    (!path.is_empty() && path != ":memory:").then(|| path.to_owned())
}

/// A fresh SQLite store for the library's unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::model::{ConversationRecord, Tenant};
    use chrono::TimeZone as _;

    /// The time every test row is stamped with.
    pub(crate) fn at() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0)
            .single()
            .expect("a time")
    }

    /// A migrated store in a directory of its own (removed first), with tenant `t` and the
    /// given conversations.
    pub(crate) async fn sqlite_store(
        name: &str,
        conversations: &[&str],
    ) -> (Store, std::path::PathBuf) {
        let (store, dir) = sqlite_unmigrated(name).await;
        store.migrate().await.expect("migrations apply");
        seed(&store, conversations).await;
        (store, dir)
    }

    /// An empty SQLite store in a directory of its own (removed first), no migration applied.
    pub(crate) async fn sqlite_unmigrated(name: &str) -> (Store, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("bedrock-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let store = Store::connect(&StoreOptions {
            url: format!("sqlite://{}?mode=rwc", dir.join("db.sqlite").display()),
            max_connections: 2,
            acquire_timeout: Duration::from_secs(5),
        })
        .await
        .expect("the store opens");
        (store, dir)
    }

    /// A migrated store in a fresh Postgres database, with tenant `t` and the given
    /// conversations, when BEDROCK_TEST_DATABASE_URL names a server; the database's name,
    /// for [`drop_postgres`]. (Named as the integration tests name theirs, so a run that dies
    /// leaves nothing their clean-up misses.)
    pub(crate) async fn postgres_store(conversations: &[&str]) -> Option<(Store, String)> {
        let (store, name) = postgres_unmigrated().await?;
        store.migrate().await.expect("migrations apply");
        seed(&store, conversations).await;
        Some((store, name))
    }

    /// An empty fresh Postgres database, no migration applied, when
    /// BEDROCK_TEST_DATABASE_URL names a server.
    pub(crate) async fn postgres_unmigrated() -> Option<(Store, String)> {
        let admin = std::env::var("BEDROCK_TEST_DATABASE_URL")
            .ok()
            .filter(|u| !u.is_empty())?;
        let name = format!("bedrock_t_{}", uuid::Uuid::now_v7().simple());
        let server = Database::connect(&admin).await.expect("the server answers");
        server
            .execute_unprepared(&format!("CREATE DATABASE {name}"))
            .await
            .expect("CREATE DATABASE works");
        let _ = server.close().await;
        let (base, query) = admin.split_at(admin.find('?').unwrap_or(admin.len()));
        let base = base.rsplit_once('/').map_or(base, |(server, _)| server);
        let store = Store::connect(&StoreOptions {
            url: format!("{base}/{name}{query}"),
            max_connections: 2,
            acquire_timeout: Duration::from_secs(5),
        })
        .await
        .expect("the store opens");
        Some((store, name))
    }

    /// Drops a database [`postgres_store`] made.
    pub(crate) async fn drop_postgres(store: Store, name: &str) {
        let _ = store.close().await;
        if let Some(admin) = std::env::var("BEDROCK_TEST_DATABASE_URL").ok()
            && let Ok(server) = Database::connect(&admin).await
        {
            let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
            let _ = server.execute_unprepared(&sql).await;
            let _ = server.close().await;
        }
    }

    /// Tenant `t` and the given conversations.
    async fn seed(store: &Store, conversations: &[&str]) {
        let tenant = Tenant {
            id: "t".into(),
            name: "t".into(),
        };
        store.ensure_tenant(&tenant, at()).await.expect("a tenant");
        for id in conversations {
            store
                .insert_conversation(&NewConversation::user(id, "t", "/tmp", "m", at()))
                .await
                .expect("a conversation");
        }
    }

    /// A conversation's row, which the test knows exists.
    pub(crate) async fn row(store: &Store, id: &str) -> ConversationRecord {
        store
            .conversation_by_id(id)
            .await
            .expect("reads")
            .expect("exists")
    }
}

/// Tenants found without something (a budget, an MCP server), each with when: for a while
/// after, the feature's per-use reads are skipped for them (a tenant that uses no budget or
/// no MCP server pays nothing for it). A change made on this node forgets the tenant at once;
/// one made on another node of a cluster applies here within the while.
#[derive(Clone, Debug, Default)]
struct Absent(Arc<std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>>);

impl Absent {
    fn map(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, std::time::Instant>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the tenant was found without it less than `fresh` ago.
    fn known(&self, tenant_id: &str, fresh: Duration) -> bool {
        let mut known = self.map();
        match known.get(tenant_id) {
            Some(at) if at.elapsed() < fresh => true,
            Some(_) => {
                known.remove(tenant_id);
                false
            }
            None => {
                if known.len() > 100_000 {
                    known.retain(|_, at| at.elapsed() < fresh);
                }
                false
            }
        }
    }

    /// The tenant was found without it, now.
    fn mark(&self, tenant_id: &str) {
        self.map()
            .insert(tenant_id.to_owned(), std::time::Instant::now());
    }

    /// The tenant may have it now (it was just given one on this node).
    fn forget(&self, tenant_id: &str) {
        self.map().remove(tenant_id);
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{at, drop_postgres, postgres_store, row, sqlite_store};
    use super::*;
    use crate::model::{MessageRecord, Tenant};
    use crate::state_machine::MessageContent;
    use entity::conversation_frames;
    use sea_orm::QuerySelect;

    /// A commit of `id` that stores one user message and its frame at `seq`, expecting the
    /// counters at `expected` (sequence and event ids move together here).
    fn user_turn(id: &str, seq: i64, expected: i64) -> Arc<ConversationCommit> {
        Arc::new(ConversationCommit {
            conversation_id: id.into(),
            state: None,
            messages: vec![MessageRecord {
                id: format!("{id}-m{seq}"),
                conversation_id: id.into(),
                sequence_id: seq,
                content: MessageContent::User {
                    text: format!("message {seq}"),
                    images: Vec::new(),
                },
                usage: None,
                client_message_id: None,
                created_at: at(),
            }],
            events: vec![crate::model::EventRecord {
                conversation_id: id.into(),
                event_id: seq,
                event_type: "message".into(),
                payload: serde_json::json!({"type": "message", "event_id": seq})
                    .to_string()
                    .into(),
                stored: StoredFrame::Message { sequence_id: seq },
                dedup_key: None,
                created_at: at(),
            }],
            usage: None,
            expected_next_sequence_id: expected,
            expected_next_event_id: expected,
            next_sequence_id: seq + 1,
            next_event_id: seq + 1,
            at: at(),
            lease: None,
            deliveries: Vec::new(),
            steps: Vec::new(),
        })
    }

    /// A group commit is one transaction: a stale guard or a failing insert anywhere in it
    /// leaves nothing of the batch behind, and the writer's next commit goes through.
    #[tokio::test]
    async fn a_failed_group_commit_writes_nothing_and_the_writer_goes_on() {
        let (store, dir) = sqlite_store("group-commit", &["c1", "c2"]).await;
        group_commits_are_whole(&store).await;
        let _ = std::fs::remove_dir_all(&dir);
        if let Some((store, name)) = postgres_store(&["c1", "c2"]).await {
            group_commits_are_whole(&store).await;
            drop_postgres(store, &name).await;
        }
    }

    async fn group_commits_are_whole(store: &Store) {
        let first = row(store, "c1").await.next_sequence_id;
        assert_eq!(
            first,
            row(store, "c2").await.next_event_id,
            "counters start equal"
        );
        let unchanged = |store: Store| async move {
            for id in ["c1", "c2"] {
                assert_eq!(store.count_messages(id).await.expect("counts"), 0, "{id}");
                assert_eq!(row(&store, id).await.next_sequence_id, first, "{id}");
                assert!(
                    store
                        .frames_after(id, 0, 10)
                        .await
                        .expect("reads")
                        .is_empty()
                );
            }
        };

        // c2's counters are stale: its guard fails after c1's update already ran.
        let stale = store
            .commit_batch(&[
                user_turn("c1", first, first),
                user_turn("c2", first, first + 5),
            ])
            .await;
        assert!(matches!(stale, Err(StoreError::Conflict(_))), "{stale:?}");
        unchanged(store.clone()).await;

        // c2's commit holds its message twice: the insert fails on the second (one message
        // per sequence id) after both updates and their guards passed.
        let mut clash = user_turn("c2", first, first);
        let messages = &mut Arc::get_mut(&mut clash).expect("not shared").messages;
        messages.push(messages[0].clone());
        let duplicate = store
            .commit_batch(&[user_turn("c1", first, first), clash])
            .await;
        assert!(duplicate.is_err(), "{duplicate:?}");
        unchanged(store.clone()).await;

        store
            .commit_batch(&[user_turn("c1", first, first), user_turn("c2", first, first)])
            .await
            .expect("the writer goes on");
        for id in ["c1", "c2"] {
            assert_eq!(store.count_messages(id).await.expect("counts"), 1, "{id}");
            assert_eq!(row(store, id).await.next_sequence_id, first + 1, "{id}");
        }
    }

    /// A batch of 33 commits (a chunk of 32, updated by one statement, and one of one,
    /// updated alone; issue 41): a stale guard in the large chunk fails the whole batch, and
    /// the same batch with good counters moves every row on, on both databases.
    #[tokio::test]
    async fn a_large_group_commit_is_whole_too() {
        let ids: Vec<String> = (0..33).map(|i| format!("c{i}")).collect();
        let names: Vec<&str> = ids.iter().map(String::as_str).collect();
        let (store, dir) = sqlite_store("large-group-commit", &names).await;
        large_group_commit(&store, &names).await;
        let _ = std::fs::remove_dir_all(&dir);
        if let Some((store, name)) = postgres_store(&names).await {
            large_group_commit(&store, &names).await;
            drop_postgres(store, &name).await;
        }
    }

    async fn large_group_commit(store: &Store, ids: &[&str]) {
        let first = row(store, ids[0]).await.next_sequence_id;
        let batch = |stale: Option<usize>| -> Vec<Arc<ConversationCommit>> {
            ids.iter()
                .enumerate()
                .map(|(i, id)| {
                    let expected = if stale == Some(i) { first + 5 } else { first };
                    user_turn(id, first, expected)
                })
                .collect()
        };
        let stale = store.commit_batch(&batch(Some(20))).await;
        assert!(matches!(stale, Err(StoreError::Conflict(_))), "{stale:?}");
        for id in ids {
            assert_eq!(store.count_messages(id).await.expect("counts"), 0, "{id}");
            assert_eq!(row(store, id).await.next_sequence_id, first, "{id}");
        }
        store
            .commit_batch(&batch(None))
            .await
            .expect("a good batch goes through");
        for id in ids {
            assert_eq!(store.count_messages(id).await.expect("counts"), 1, "{id}");
            let row = row(store, id).await;
            assert_eq!(
                (row.next_sequence_id, row.next_event_id),
                (first + 1, first + 1),
                "{id}"
            );
        }
    }

    /// Issue 41: a batch's usage is summed per key and written in the batch's transaction,
    /// in statements whose text does not depend on how many responses the batch holds (on
    /// SQLite each count made a new text, parsed again and cached); the budget's spend
    /// replaces the reservations, on both databases.
    #[tokio::test]
    async fn a_batch_records_its_usage_summed() {
        let (store, dir) = sqlite_store("batch-usage", &["c1"]).await;
        batch_usage(&store).await;
        let _ = std::fs::remove_dir_all(&dir);
        if let Some((store, name)) = postgres_store(&["c1"]).await {
            batch_usage(&store).await;
            drop_postgres(store, &name).await;
        }
    }

    async fn batch_usage(store: &Store) {
        use crate::config::BudgetPeriod;
        let now = Utc::now();
        let default = (0, BudgetPeriod::Month);
        store
            .set_tenant_budget("t", Some(10_000), None, BudgetPeriod::Month, now)
            .await
            .expect("a budget");
        let mut reservations = Vec::new();
        for _ in 0..3 {
            let reservation = store
                .reserve_budget("t", default, 1_000, now)
                .await
                .expect("reserves");
            assert!(
                matches!(reservation, Reservation::Reserved { .. }),
                "{reservation:?}"
            );
            reservations.push(reservation);
        }
        let record = |model: &str, tokens: (u64, u64), reservation: &Reservation| UsageRecord {
            tenant_id: "t".into(),
            model: model.into(),
            tokens,
            reservation: reservation.clone(),
            at: now,
        };
        let usage = [
            record("m1", (100, 10), &reservations[0]),
            record("m1", (200, 20), &reservations[1]),
            record("m2", (300, 30), &reservations[2]),
            record("m2", (5, 5), &Reservation::Unlimited),
        ];
        if store.backend() == DbBackend::Sqlite {
            // One statement for the days, one for the spends, whatever the batch's size.
            let one = Store::sqlite_usage_statements(&usage[..1]);
            let all = Store::sqlite_usage_statements(&usage);
            assert_eq!(one.len(), 2);
            assert_eq!(all.len(), 2);
            assert_eq!(one[1].sql, all[1].sql, "one spend key in both");
        }
        let first = row(store, "c1").await.next_sequence_id;
        store
            .write_batch(
                &[user_turn("c1", first, first)],
                &[],
                &usage,
                &WebhookResults::default(),
            )
            .await
            .expect("written")
            .wait()
            .await
            .expect("durable");
        // One response's usage on its own (a batch that failed is written again this way).
        store
            .record(&record("m1", (1, 1), &Reservation::Unlimited))
            .await
            .expect("recorded alone");
        let day = now.date_naive().format("%Y-%m-%d").to_string();
        let mut used = store.usage("t", &day, &day).await.expect("reads");
        used.sort_by(|a, b| a.model.cmp(&b.model));
        let used: Vec<(String, u64, u64)> = used
            .into_iter()
            .map(|u| (u.model, u.input_tokens, u.output_tokens))
            .collect();
        assert_eq!(
            used,
            [("m1".to_owned(), 301, 31), ("m2".to_owned(), 305, 35)]
        );
        let state = store
            .budget_state("t", default, now)
            .await
            .expect("reads")
            .expect("a budget");
        assert_eq!(state.used, 660, "the three reserved responses' tokens");
        // Nothing is held any more: with 28 tokens left (the usage rows count 672), a
        // request may still reserve; a reservation left behind would hold them.
        store
            .set_tenant_budget("t", Some(700), None, BudgetPeriod::Month, now)
            .await
            .expect("a smaller budget");
        let rest = store
            .reserve_budget("t", default, 1_000, now)
            .await
            .expect("reserves");
        assert!(matches!(rest, Reservation::Reserved { .. }), "{rest:?}");
    }

    /// SQLite: a group commit is written (and readable) before its log is synced, on the
    /// writer's connection alone, which commits with `synchronous = NORMAL` and leaves the
    /// sync to the log sync; every other connection keeps `FULL` (and a small page cache).
    /// Postgres: written is durable.
    #[tokio::test]
    async fn group_commits_are_synced_after_the_write() {
        let (store, dir) = sqlite_store("log-sync", &["c1"]).await;
        let first = row(&store, "c1").await.next_sequence_id;
        let durable = store
            .write_batch(
                &[user_turn("c1", first, first)],
                &[],
                &[],
                &WebhookResults::default(),
            )
            .await
            .expect("written");
        assert_eq!(
            row(&store, "c1").await.next_sequence_id,
            first + 1,
            "readable"
        );
        assert!(durable.syncs(), "a file database's commit waits for a sync");
        durable.wait().await.expect("synced");
        let writer = store.writer.as_ref().expect("SQLite has a writer");
        assert_eq!(
            writer.held_pragma("PRAGMA synchronous").await,
            Some(1),
            "NORMAL on the writer's"
        );
        let other: Option<i64> = sqlite::one_value(&store.db, "PRAGMA synchronous", 0)
            .await
            .expect("reads");
        assert_eq!(other, Some(2), "FULL elsewhere");
        // The writer's page cache is large, the readers' small (in KiB, negative).
        assert_eq!(writer.held_pragma("PRAGMA cache_size").await, Some(-8192));
        let other: Option<i64> = sqlite::one_value(&store.db, "PRAGMA cache_size", 0)
            .await
            .expect("reads");
        assert_eq!(other, Some(-512));
        store
            .sync_database()
            .await
            .expect("the database file syncs");
        let _ = std::fs::remove_dir_all(&dir);

        if let Some((store, name)) = postgres_store(&["c1"]).await {
            let first = row(&store, "c1").await.next_sequence_id;
            let durable = store
                .write_batch(
                    &[user_turn("c1", first, first)],
                    &[],
                    &[],
                    &WebhookResults::default(),
                )
                .await
                .expect("written");
            assert!(!durable.syncs(), "nothing more to wait for");
            store.sync_database().await.expect("nothing to do");
            drop_postgres(store, &name).await;
        }
    }

    #[test]
    fn batches_split_into_power_of_two_chunks_in_order() {
        let items: Vec<usize> = (0..600).collect();
        let sizes = |items: &[usize]| shaped_chunks(items).map(<[usize]>::len).collect::<Vec<_>>();
        assert_eq!(sizes(&items), [256, 256, 64, 16, 8]);
        assert_eq!(sizes(&items[..37]), [32, 4, 1]);
        assert_eq!(sizes(&items[..1]), [1]);
        assert!(sizes(&[]).is_empty());
        let joined: Vec<usize> = shaped_chunks(&items).flatten().copied().collect();
        assert_eq!(joined, items);
    }

    /// The compact-frames migration converts frames stored one per row: a message's frame
    /// becomes a reference to the message (which learns its frame's event id), a state frame
    /// its state, any other frame stays whole with its dedup key; the next one keys messages
    /// and frames by their conversation's internal key, and they still go with it; on both
    /// databases.
    #[tokio::test]
    async fn stored_frames_are_converted() {
        let (sqlite, dir) = testing::sqlite_unmigrated("convert").await;
        frames_are_converted(&sqlite).await;
        let _ = std::fs::remove_dir_all(&dir);
        if let Some((store, name)) = testing::postgres_unmigrated().await {
            frames_are_converted(&store).await;
            drop_postgres(store, &name).await;
        }
    }

    async fn frames_are_converted(store: &Store) {
        Migrator::up(&store.db, Some(4))
            .await
            .expect("the migrations before");
        store
            .ensure_tenant(
                &Tenant {
                    id: "t".into(),
                    name: "t".into(),
                },
                at(),
            )
            .await
            .expect("a tenant");
        let backend = store.backend();
        let run = |sql: &str| {
            let sql = if backend == DbBackend::Postgres {
                sql.to_owned()
            } else {
                sql.replace("::json", "")
            };
            async move {
                store
                    .db
                    .execute_unprepared(&sql)
                    .await
                    .unwrap_or_else(|e| panic!("{sql}: {e}"));
            }
        };
        run(
            "INSERT INTO conversations (id, tenant_id, slug, cwd, model, user_initiated, \
             require_approval, network, state, state_data, state_updated_at, created_at, \
             updated_at, archived, input_tokens, output_tokens, context_tokens, \
             next_sequence_id, next_event_id) VALUES ('c', 't', 'c', '/w', 'm', true, \
             '[]'::json, false, 'idle', '{\"Idle\":null}'::json, '2026-01-01T00:00:00Z', \
             '2026-01-01T00:00:00Z', '2026-01-01T00:00:00Z', false, 0, 0, 0, 2, 4)",
        )
        .await;
        run(
            "INSERT INTO messages (id, conversation_id, sequence_id, message_type, content, \
             created_at) VALUES ('m1', 'c', 1, 'user', \
             '{\"text\": \"hi\", \"images\": []}'::json, '2026-01-01T00:00:00Z')",
        )
        .await;
        let frames = [
            (
                1,
                "message",
                r#"{"type":"message","message":{"id":"m1","sequence_id":1},"event_id":1}"#,
                "NULL",
            ),
            (
                2,
                "state",
                r#"{"type":"state","state":{"kind":"idle"},"event_id":2}"#,
                "NULL",
            ),
            (
                3,
                "system_event",
                r#"{"type":"system_event","event":{"type":"user_request"},"event_id":3}"#,
                "'user_request:r1'",
            ),
        ];
        for (event_id, kind, payload, dedup) in frames {
            run(&format!(
                "INSERT INTO conversation_events (conversation_id, event_id, event_type, \
                 payload, dedup_key, created_at) VALUES ('c', {event_id}, '{kind}', \
                 '{payload}'::json, {dedup}, '2026-01-01T00:00:00Z')"
            ))
            .await;
        }
        store.migrate().await.expect("the compact-frames migration");

        let rows = store.frames_after("c", 0, 10).await.expect("reads");
        let items: Vec<(i64, i64, serde_json::Value)> = rows
            .iter()
            .map(|row| {
                let items = serde_json::from_str(&row.frames).expect("JSON items");
                (row.first_event_id, row.last_event_id, items)
            })
            .collect();
        assert_eq!(
            items,
            vec![
                (1, 1, serde_json::json!([{"m": 1}])),
                (2, 2, serde_json::json!([{"s": {"kind": "idle"}}])),
                (
                    3,
                    3,
                    serde_json::json!([{"f": {"type": "system_event", "event": {"type": "user_request"}, "event_id": 3}}])
                ),
            ]
        );
        let framed = store
            .messages_framed_between("c", 1, 3)
            .await
            .expect("reads");
        assert_eq!(framed.len(), 1);
        assert_eq!((framed[0].0, framed[0].1.id.as_str()), (1, "m1"));
        let created = conversation_frames::Entity::find()
            .all(&store.db)
            .await
            .map(|rows| rows.iter().map(|r| r.created_at).collect::<Vec<_>>());
        // On Postgres the items column is `json`, which the entity does not read: the
        // timestamps are checked on SQLite.
        if let Ok(created) = created {
            assert!(
                created.iter().all(|ms| *ms == at().timestamp_millis()),
                "{created:?}"
            );
        }
        // The dedup key came along: the same key again is refused.
        let again = store
            .db
            .execute_unprepared(
                "INSERT INTO conversation_frames (conversation_key, last_event_id, \
                 first_event_id, frames, dedup_key, created_at) \
                 VALUES ((SELECT internal_key FROM conversations WHERE id = 'c'), 9, 9, '[]', \
                 'user_request:r1', 0)",
            )
            .await;
        let error = again
            .as_ref()
            .err()
            .map(ToString::to_string)
            .unwrap_or_default();
        assert!(
            error.to_lowercase().contains("unique") || error.contains("duplicate"),
            "{again:?}"
        );
        // The message and the frames came along keyed by their conversation's key, and go
        // with it.
        assert_eq!(store.count_messages("c").await.expect("counts"), 1);
        run("DELETE FROM conversations WHERE id = 'c'").await;
        assert_eq!(store.count_messages("c").await.expect("counts"), 0);
        let left = conversation_frames::Entity::find()
            .select_only()
            .column(conversation_frames::Column::LastEventId)
            .into_tuple::<i64>()
            .all(&store.db)
            .await
            .expect("reads");
        assert!(left.is_empty(), "{left:?}");
    }
    /// Issue 40, migration 21: rows written before packing (JSON text) and packed rows read
    /// side by side, in order, through every reader of frames and steps; the new rows are
    /// packed and leave the text columns empty.
    #[tokio::test]
    async fn rows_written_before_packing_read_beside_packed_ones_on_each_database() {
        let (store, dir) = sqlite_store("packed-rows", &["c"]).await;
        old_and_packed_rows(&store, false).await;
        let _ = std::fs::remove_dir_all(&dir);
        if let Some((store, name)) = postgres_store(&["c"]).await {
            old_and_packed_rows(&store, true).await;
            drop_postgres(store, &name).await;
        }
    }

    async fn old_and_packed_rows(store: &Store, postgres: bool) {
        let first = row(store, "c").await.next_sequence_id;
        let step = |n: i64| crate::model::LoggedStep {
            n,
            json: format!(r#"{{"e":{{"continue":{{}}}},"d":"{n:016x}"}}"#),
        };
        // As written before migration 21: a row of frames with a step, a row of steps.
        let old_frames = r#"[{"s":{"kind":"idle"}}]"#;
        let old_steps = crate::model::LoggedStep::array(&[step(1)]);
        let key = "(SELECT internal_key FROM conversations WHERE id = 'c')";
        store
            .db
            .execute_unprepared(&format!(
                "INSERT INTO conversation_frames (conversation_key, last_event_id, \
                 first_event_id, frames, created_at, first_step, last_step, steps) \
                 VALUES ({key}, {e}, {e}, '{old_frames}', 0, 1, 1, '{old_steps}')",
                e = first - 1
            ))
            .await
            .expect("an old row of frames");
        store
            .db
            .execute_unprepared(&format!(
                "INSERT INTO conversation_steps (conversation_key, last_step, first_step, \
                 steps, created_at) VALUES ({key}, 2, 2, '{}', 0)",
                crate::model::LoggedStep::array(&[step(2)])
            ))
            .await
            .expect("an old row of steps");
        // Packed: a commit with frames and two steps, then one with a step and no frames.
        let mut framed = (*user_turn("c", first, first)).clone();
        framed.steps = vec![step(3), step(4)];
        let mut bare = (*user_turn("c", first + 1, first + 1)).clone();
        bare.messages.clear();
        bare.events.clear();
        bare.next_sequence_id = first + 1;
        bare.next_event_id = first + 1;
        bare.steps = vec![step(5)];
        store
            .commit_batch(&[Arc::new(framed)])
            .await
            .expect("a packed row of frames");
        store
            .commit_batch(&[Arc::new(bare)])
            .await
            .expect("a packed row of steps");

        let frames = store.frames_after("c", -1, 100).await.expect("frames read");
        let texts: Vec<(i64, &str)> = frames
            .iter()
            .map(|r| (r.last_event_id, r.frames.as_str()))
            .collect();
        let packed_text = format!(r#"[{{"m":{first}}}]"#);
        assert_eq!(
            texts,
            vec![(first - 1, old_frames), (first, packed_text.as_str())]
        );
        let digests = |rows: &[crate::replay::StepRow]| -> Vec<(i64, String)> {
            rows.iter()
                .flat_map(|row| row.steps.iter().map(|s| (s.n, s.d.clone())))
                .collect()
        };
        let expected: Vec<(i64, String)> = (1..=5).map(|n| (n, format!("{n:016x}"))).collect();
        assert_eq!(
            digests(&store.steps_of("c", 100).await.expect("steps")),
            expected
        );
        assert_eq!(
            digests(&store.steps_of("c", 3).await.expect("steps")),
            expected[..4]
        );
        let batch = store
            .replay_batch(&["c".to_owned()])
            .await
            .expect("a batch");
        assert_eq!(batch.len(), 1);
        assert_eq!(batch[0].unreadable, None);
        assert_eq!(digests(&batch[0].rows), expected);
        assert_eq!(store.next_step("c").await.expect("next"), 6);

        // The new rows hold their JSON packed only.
        let empty = if postgres { "IS NULL" } else { "= ''" };
        let count = |sql: String| async move {
            store
                .db
                .query_one_raw(sea_orm::Statement::from_string(store.backend(), sql))
                .await
                .expect("counts")
                .and_then(|r| r.try_get_by_index::<i64>(0).ok())
                .unwrap_or(-1)
        };
        assert_eq!(
            count(format!(
                "SELECT COUNT(*) FROM conversation_frames WHERE packed_frames IS NOT NULL \
                 AND packed_steps IS NOT NULL AND frames {empty} AND steps IS NULL"
            ))
            .await,
            1
        );
        assert_eq!(
            count(format!(
                "SELECT COUNT(*) FROM conversation_steps WHERE packed_steps IS NOT NULL \
                 AND steps {empty}"
            ))
            .await,
            1
        );
    }
}
