//! SQLite's write path: a group commit in one round trip to the connection's thread.
//!
//! sqlx runs each SQLite connection on a thread of its own, and every statement is a round
//! trip to it: the statement goes over, the result comes back and wakes the task that waits
//! for it. A commit through sea-orm's transaction was six of them (checkout, BEGIN, three
//! statements, COMMIT), and on a busy machine each waits for a core: the writer, which holds
//! SQLite's one write lock, spent most of a flush waiting (1.9 ms a flush of 8 commits at
//! 4,000 commits/s, the connection's thread busy a fifth of that). Here the whole transaction,
//! BEGIN to COMMIT, goes over as one prepared multi-statement text, on a connection the writer
//! keeps checked out.
//!
//! What makes that possible:
//! - sqlx's SQLite driver runs the statements of one text in order and binds the arguments
//!   across them. (sqlx deprecates this for queries of several statements, which only its
//!   SQLite driver supports; the store's tests fail on an upgrade that drops it.)
//! - The guarded updates are checked inside the transaction, before COMMIT: after each, a
//!   row goes into a temporary table whose CHECK holds only when the update changed one row
//!   per commit (`changes()`). A failed check aborts the text, and the transaction is rolled
//!   back, as any failed statement's is.
//!
//! A commit is durable only once the log is on disk, but the sync need not hold up the next
//! batch: the held connection commits with `synchronous = NORMAL` (SQLite then writes the
//! transaction's frames to its write-ahead log without syncing it) and [`LogSync`] syncs the
//! log afterwards, on a thread of its own, while the writer already runs the next batch. A
//! batch is reported committed only after a sync that began once its COMMIT had returned,
//! so nothing is acknowledged before it is on disk, as with `synchronous = FULL`. What
//! differs: another connection may read a batch in the fraction of a millisecond before its
//! sync ends (a power loss then would lose data that a read saw, though no write that was
//! acknowledged). Syncs requested while one runs are served by the next, one for all. The
//! other connections keep `FULL`: their commits sync the log themselves, and checkpoints
//! sync the log before they copy from it. A sync that fails (an I/O error) answers its
//! batches as unavailable although they are written, like a commit whose connection broke
//! before its answer came (a retried commit that then conflicts looks at the row to see
//! whether the first try landed). With `FULL` it was no clearer: SQLite may replay such a
//! transaction from the log at the next start.

use std::path::PathBuf;
use std::sync::Arc;

use entity::conversations;
use sea_orm::sqlx::{self, Executor, Sqlite, SqliteConnection, pool::PoolConnection};
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbBackend, DbErr, EntityTrait, QueryTrait, RuntimeErr,
    Statement, Value, Values,
};
use sea_query_sqlx::SqlxValues;
use tokio::sync::{Mutex, oneshot};

use super::codec;
use super::{NewFrames, Result, StoreError, frame_rows, message_event_id, shaped_chunks, to_i64};
use crate::model::{ConversationCommit, MessageRecord, NewDelivery};

/// Statements kept prepared on the writer's connection. A batch's text depends on how many
/// rows each of its statements carries (powers of two), so a busy server sees a few hundred
/// texts; each is parsed and planned once.
pub(super) const WRITER_STATEMENTS: usize = 512;

/// The constraint that fails when a guarded update did not change one row per commit.
const GUARD: &str = "every_guarded_row_changed";

/// Creates, on a writer's connection, the table the guards write to (one row, replaced).
pub(super) async fn prepare(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    let sql = format!(
        "CREATE TEMP TABLE IF NOT EXISTS commit_guard \
         (id INTEGER PRIMARY KEY, ok INTEGER NOT NULL CONSTRAINT {GUARD} CHECK (ok))"
    );
    conn.execute(sqlx::AssertSqlSafe(sql)).await?;
    Ok(())
}

/// SQLite's writes: a pool of two connections. Group commits go through the one the writer
/// keeps checked out; the other writes (a new conversation, a new key) take the other.
#[derive(Clone, Debug)]
pub(super) struct Writer {
    pub(super) pool: DatabaseConnection,
    /// The database's file; `None` in memory.
    pub(super) file: Option<PathBuf>,
    held: Arc<Mutex<Option<Held>>>,
}

/// Column `index` of the row an SQLite statement without arguments answers; `None` for no row.
pub(super) async fn one_value<T: sea_orm::TryGetable>(
    db: &DatabaseConnection,
    sql: &str,
    index: usize,
) -> Result<Option<T>> {
    let row = db
        .query_one_raw(Statement::from_string(DbBackend::Sqlite, sql))
        .await?;
    Ok(row.map(|row| row.try_get_by_index(index)).transpose()?)
}

/// The file of a pool's database, as SQLite resolved it; `None` in memory.
async fn database_file(pool: &DatabaseConnection) -> Result<Option<PathBuf>> {
    let sql = "SELECT file FROM pragma_database_list WHERE name = 'main'";
    let file: Option<String> = one_value(pool, sql, 0).await?;
    Ok(file.filter(|f| !f.is_empty()).map(PathBuf::from))
}

/// `fdatasync` of `file`, opened for it (the database file, synced rarely; the log's sync
/// thread keeps its descriptor, see [`LogSync`]).
fn fdatasync(file: &std::path::Path) -> std::result::Result<(), String> {
    std::fs::File::open(file)
        .and_then(|f| f.sync_data())
        .map_err(|e| format!("syncing {}: {e}", file.display()))
}

/// `fdatasync` of the log through `kept`, opened first when it is not; it is kept only
/// after a sync that succeeded.
fn sync_kept(
    kept: &mut Option<std::fs::File>,
    log: &std::path::Path,
) -> std::result::Result<(), String> {
    kept.take()
        .map_or_else(|| std::fs::File::open(log), Ok)
        .and_then(|file| {
            file.sync_data()?;
            *kept = Some(file);
            Ok(())
        })
        .map_err(|e| format!("syncing {}: {e}", log.display()))
}

/// [`fdatasync`] on a blocking thread.
pub(super) async fn sync_file(file: PathBuf) -> Result<()> {
    tokio::task::spawn_blocking(move || fdatasync(&file).map_err(StoreError::Unavailable))
        .await
        .map_err(|e| StoreError::Other(format!("the sync task failed: {e}")))?
}

/// The connection group commits go through, and what syncs its log.
#[derive(Debug)]
struct Held {
    conn: PoolConnection<Sqlite>,
    /// `None` for a database without a log file (in memory), whose commits stay `FULL`.
    log: Option<Arc<LogSync>>,
}

/// What a written batch waits for before it is durable.
#[derive(Debug, Default)]
#[must_use = "a written batch is durable only once `wait` returns"]
pub(crate) struct Durable(Option<Arc<LogSync>>);

impl Durable {
    /// Whether `wait` has a sync to wait for.
    #[cfg(test)]
    pub(crate) fn syncs(&self) -> bool {
        self.0.is_some()
    }

    /// Waits until the batch is on disk.
    pub(crate) async fn wait(self) -> Result<()> {
        match self.0 {
            Some(log) => log.sync().await,
            None => Ok(()),
        }
    }
}

/// A request for a sync of the log, answered once one that began after it ends.
type SyncRequest = oneshot::Sender<std::result::Result<(), String>>;

/// Syncs a write-ahead log on a thread of its own (see the module's comment).
#[derive(Debug)]
struct LogSync {
    requests: std::sync::mpsc::Sender<SyncRequest>,
}

impl LogSync {
    fn start(log: PathBuf) -> std::io::Result<LogSync> {
        let (requests, waiting) = std::sync::mpsc::channel::<SyncRequest>();
        std::thread::Builder::new()
            .name("bedrock-log-sync".into())
            .spawn(move || {
                // The log, opened at the first sync (SQLite makes it at its first write) and
                // kept: two system calls less a sync than opening it each time (issue 41).
                // The descriptor is the file SQLite writes to for as long as the writer holds
                // its connection: SQLite deletes a log only as the database's last
                // connection closes (checkpoints reset it in place), and a path another
                // process replaced would name a file SQLite does not write to. The thread
                // may outlive the connection while a written batch still waits for its
                // sync; a log deleted by then was checkpointed and synced as it closed. A
                // sync that fails drops the descriptor, and the next opens the log again.
                let mut file: Option<std::fs::File> = None;
                // Ends when the writer drops its connection (every sender is gone).
                while let Ok(first) = waiting.recv() {
                    let served: Vec<SyncRequest> =
                        std::iter::once(first).chain(waiting.try_iter()).collect();
                    let outcome = sync_kept(&mut file, &log);
                    for request in served {
                        let _ = request.send(outcome.clone());
                    }
                }
            })?;
        Ok(LogSync { requests })
    }

    async fn sync(&self) -> Result<()> {
        let (answer, answered) = oneshot::channel();
        let stopped = || StoreError::Unavailable("the log sync thread stopped".into());
        self.requests.send(answer).map_err(|_| stopped())?;
        answered
            .await
            .map_err(|_| stopped())?
            .map_err(StoreError::Unavailable)
    }
}

impl Held {
    /// Checks out the writer's connection: commits on it leave the sync to [`LogSync`].
    async fn acquire(pool: &DatabaseConnection, file: Option<&PathBuf>) -> Result<Held> {
        let mut conn = pool
            .get_sqlite_connection_pool()
            .acquire()
            .await
            .map_err(store_error)?;
        let Some(file) = file else {
            return Ok(Held { conn, log: None });
        };
        let mut log = file.clone().into_os_string();
        log.push("-wal");
        let log = LogSync::start(PathBuf::from(log))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the log sync: {e}")))?;
        conn.execute("PRAGMA synchronous = NORMAL")
            .await
            .map_err(store_error)?;
        Ok(Held {
            conn,
            log: Some(Arc::new(log)),
        })
    }
}

impl Writer {
    pub(super) async fn new(pool: DatabaseConnection) -> Result<Writer> {
        Ok(Writer {
            file: database_file(&pool).await?,
            pool,
            held: Arc::default(),
        })
    }

    /// Closes the held connection (it commits without syncing: it is not given back to the
    /// pool) and then the pool (closing waits for every connection to come back).
    pub(super) async fn close(&self) -> Result<()> {
        if let Some(writer) = self.held.lock().await.take() {
            drop(writer.conn.detach());
        }
        self.pool.clone().close().await?;
        Ok(())
    }

    /// A pragma's value (`sql` reads it) on the held connection, once one is held (for tests).
    #[cfg(test)]
    pub(super) async fn held_pragma(&self, sql: &'static str) -> Option<i64> {
        let mut held = self.held.lock().await;
        let writer = held.as_mut()?;
        sqlx::query_scalar(sql)
            .fetch_one(&mut *writer.conn)
            .await
            .ok()
    }

    /// Writes `commits` in one transaction; they are durable once the answer's `wait` returns,
    /// and the writer is free for the next batch at once.
    pub(super) async fn write(
        &self,
        commits: &[Arc<ConversationCommit>],
        created: Vec<conversations::ActiveModel>,
        more: Vec<Statement>,
        alone: Vec<Statement>,
    ) -> Result<Durable> {
        let (sql, values) = batch(commits, created, more, alone.is_empty())?;
        let mut held = self.held.lock().await;
        let writer = match &mut *held {
            Some(writer) => writer,
            None => held.insert(Held::acquire(&self.pool, self.file.as_ref()).await?),
        };
        let written = async {
            let query = sqlx::query_with(sqlx::AssertSqlSafe(sql), SqlxValues(Values(values)));
            writer.conn.execute(query).await?;
            let last = alone.len().saturating_sub(1);
            for (n, statement) in alone.into_iter().enumerate() {
                let sql = if n == last {
                    format!("{};\nCOMMIT", statement.sql)
                } else {
                    statement.sql
                };
                let values = statement.values.unwrap_or(Values(Vec::new()));
                let query = sqlx::query_with(sqlx::AssertSqlSafe(sql), SqlxValues(values));
                writer.conn.execute(query).await?;
            }
            Ok::<(), sqlx::Error>(())
        }
        .await;
        let Err(error) = written else {
            return Ok(Durable(writer.log.clone()));
        };
        // The transaction is still open when a statement before COMMIT failed. A connection
        // that cannot roll back is closed, and the next commit checks out another.
        if let Err(e) = writer.conn.execute("ROLLBACK").await
            && !e.to_string().contains("no transaction is active")
        {
            tracing::warn!(error = %e, "rollback failed; closing the writer's connection");
            if let Some(writer) = held.take() {
                drop(writer.conn.detach());
            }
        }
        if error.to_string().contains(GUARD) {
            return Err(StoreError::Conflict(
                "a conversation was deleted or changed by another writer".into(),
            ));
        }
        Err(store_error(error))
    }
}

/// The text of a batch, BEGIN to COMMIT (to before it unless `commit`), and its arguments. A
/// few statements for the whole batch, not a few per commit; their row counts are powers of
/// two, so the texts repeat and stay prepared (every new text is parsed and planned again).
/// `more` (the usage of LLM responses) goes last, in the same transaction.
///
/// The connection keeps a text's statements prepared under the whole text, so each mix of
/// row counts is a text of its own: the webhooks' statements, whose counts vary apart from
/// the commits', run after it, each a text of its own (`Writer::write`). In the text they
/// multiplied the mixes past what the connection keeps, and a subscribed tenant's batches
/// were parsed again nearly every time (8% of the server's CPU under load).
fn batch(
    commits: &[Arc<ConversationCommit>],
    created: Vec<conversations::ActiveModel>,
    more: Vec<Statement>,
    commit: bool,
) -> Result<(String, Vec<Value>)> {
    let mut sql = String::from("BEGIN");
    let mut values = Vec::new();
    let mut append = |statement: Statement| {
        sql.push_str(";\n");
        sql.push_str(&statement.sql);
        if let Some(Values(v)) = statement.values {
            values.extend(v);
        }
    };
    for chunk in shaped_chunks(&created) {
        append(conversations::Entity::insert_many(chunk.to_vec()).build(DbBackend::Sqlite));
    }
    for chunk in shaped_chunks(commits) {
        // A chunk of up to `ONE_BY_ONE` commits as an update each (see
        // `update_conversations`): the text still depends only on the chunks' sizes.
        let parts = if chunk.len() <= ONE_BY_ONE {
            chunk.chunks(1)
        } else {
            chunk.chunks(chunk.len())
        };
        for part in parts {
            append(update_conversations(part)?);
            append(Statement::from_sql_and_values(
                DbBackend::Sqlite,
                "INSERT OR REPLACE INTO temp.commit_guard (id, ok) VALUES (1, changes() = ?)",
                [Value::from(i64::try_from(part.len()).unwrap_or(i64::MAX))],
            ));
        }
    }
    let message_rows: Vec<(&ConversationCommit, &MessageRecord)> = commits
        .iter()
        .flat_map(|c| c.messages.iter().map(move |m| (c.as_ref(), m)))
        .collect();
    for chunk in shaped_chunks(&message_rows) {
        append(insert_messages(chunk));
    }
    let frames: Vec<NewFrames<'_>> = commits.iter().flat_map(|c| frame_rows(c)).collect();
    for chunk in shaped_chunks(&frames) {
        append(insert_frames(chunk));
    }
    let steps: Vec<&ConversationCommit> = commits
        .iter()
        .map(AsRef::as_ref)
        .filter(|c| super::steps_row(c))
        .collect();
    for chunk in shaped_chunks(&steps) {
        append(insert_steps(chunk));
    }
    for statement in more {
        append(statement);
    }
    if commit {
        sql.push_str(";\nCOMMIT");
    }
    Ok((sql, values))
}

/// A row's conversation key, found by the conversation's id (the first of its values).
const KEY_OF: &str = "(SELECT internal_key FROM conversations WHERE id = ?)";

/// The statements that insert the webhook deliveries of `commits`: run after the batch's
/// text, each alone (see [`batch`]).
pub(super) fn insert_deliveries(commits: &[Arc<ConversationCommit>]) -> Vec<Statement> {
    let deliveries: Vec<&NewDelivery> = commits.iter().flat_map(|c| &c.deliveries).collect();
    shaped_chunks(&deliveries)
        .map(|chunk| {
            Statement::from_sql_and_values(
                DbBackend::Sqlite,
                super::webhooks::insert_deliveries_sql(chunk.len(), false),
                super::webhooks::delivery_values(chunk),
            )
        })
        .collect()
}

/// `statements` as one text (none when there are none).
pub(super) fn one_text(statements: Vec<(String, Vec<Value>)>) -> Option<Statement> {
    let mut statements = statements.into_iter();
    let (mut sql, mut values) = statements.next()?;
    for (text, more) in statements {
        sql.push_str(";\n");
        sql.push_str(&text);
        values.extend(more);
    }
    Some(Statement::from_sql_and_values(
        DbBackend::Sqlite,
        sql,
        values,
    ))
}

/// The statement that inserts messages, each with its frame's event id.
fn insert_messages(rows: &[(&ConversationCommit, &MessageRecord)]) -> Statement {
    let mut values: Vec<Value> = Vec::with_capacity(rows.len() * 9);
    for (commit, message) in rows {
        values.extend([
            Value::from(message.conversation_id.as_str()),
            Value::from(message.sequence_id),
            Value::from(message.id.as_str()),
            Value::from(message.content.message_type().as_str()),
            Value::Json(Some(Box::new(codec::content(&message.content)))),
            Value::Json(message.usage.as_ref().map(|u| Box::new(codec::usage(u)))),
            Value::String(message.client_message_id.clone()),
            Value::ChronoDateTimeUtc(Some(message.created_at)),
            Value::BigInt(message_event_id(commit, message.sequence_id)),
        ]);
    }
    let sql = format!(
        "INSERT OR FAIL INTO messages (conversation_key, sequence_id, id, message_type, content, \
         usage_data, client_message_id, created_at, event_id) VALUES {}",
        vec![format!("({KEY_OF}, ?, ?, ?, ?, ?, ?, ?, ?)"); rows.len()].join(", ")
    );
    Statement::from_sql_and_values(DbBackend::Sqlite, sql, values)
}

/// The statement that inserts rows of frames; their items go in as the JSON text they are.
fn insert_frames(rows: &[NewFrames<'_>]) -> Statement {
    let mut values: Vec<Value> = Vec::with_capacity(rows.len() * 9);
    for row in rows {
        values.extend([
            Value::from(row.conversation_id),
            Value::from(row.last_event_id),
            Value::from(row.first_event_id),
            Value::Bytes(Some(row.packed_frames.clone())),
            Value::String(row.dedup_key.map(str::to_owned)),
            Value::from(row.created_at),
            Value::BigInt(row.first_step),
            Value::BigInt(row.last_step),
            Value::Bytes(row.packed_steps.clone()),
        ]);
    }
    // `frames` is `NOT NULL` in SQLite's table: a packed row leaves it `''`.
    let sql = format!(
        "INSERT OR FAIL INTO conversation_frames \
         (conversation_key, last_event_id, first_event_id, frames, packed_frames, dedup_key, \
         created_at, first_step, last_step, packed_steps) VALUES {}",
        vec![format!("({KEY_OF}, ?, ?, '', ?, ?, ?, ?, ?, ?)"); rows.len()].join(", ")
    );
    Statement::from_sql_and_values(DbBackend::Sqlite, sql, values)
}

/// The statement that writes each commit's steps (the replay log, issue 40) as one row.
fn insert_steps(commits: &[&ConversationCommit]) -> Statement {
    let mut values: Vec<Value> = Vec::with_capacity(commits.len() * 5);
    for commit in commits {
        let first = commit.steps.first().map_or(0, |step| step.n);
        let last = commit.steps.last().map_or(0, |step| step.n);
        values.extend([
            Value::from(commit.conversation_id.as_str()),
            Value::from(last),
            Value::from(first),
            Value::Bytes(Some(super::packed_steps(commit))),
            Value::from(commit.at.timestamp_millis()),
        ]);
    }
    // `steps` is `NOT NULL` in SQLite's table: a packed row leaves it `''`.
    let sql = format!(
        "INSERT OR FAIL INTO conversation_steps \
         (conversation_key, last_step, first_step, steps, packed_steps, created_at) VALUES {}",
        vec![format!("({KEY_OF}, ?, ?, '', ?, ?)"); commits.len()].join(", ")
    );
    Statement::from_sql_and_values(DbBackend::Sqlite, sql, values)
}

/// The most commits of a batch's chunk whose rows are updated one statement each.
const ONE_BY_ONE: usize = 16;

/// The statement that updates the rows of `commits`, each guarded by its expected counters:
/// the guard after it checks that it changed one row per commit.
///
/// One commit's is a plain `UPDATE ... WHERE id = ?`: SQLite runs an `UPDATE ... FROM` (the
/// form several rows need) through temporary tables it makes and drops for every run, which
/// cost a one-row update more than the update itself (issue 41), and more than one plain
/// update and its guard a row up to a chunk of [`ONE_BY_ONE`] at least (measured with
/// Python's sqlite3 on the same table: 14 against 18 µs a batch of one row, 21 against 27 of
/// two, 35 against 43 of four, 62 – 65 against 73 of eight, the caller's own cost removed).
fn update_conversations(commits: &[Arc<ConversationCommit>]) -> Result<Statement> {
    if let [commit] = commits {
        // Its values in the order they appear: the nine set, then the three guarding.
        let [id, exp_seq, exp_evt, rest @ ..] = conversation_values(commit)?;
        let mut values = Vec::from(rest);
        values.extend([id, exp_seq, exp_evt]);
        return Ok(Statement::from_sql_and_values(
            DbBackend::Sqlite,
            "UPDATE OR FAIL conversations SET \
               next_sequence_id = ?, next_event_id = ?, updated_at = ?, \
               state = COALESCE(?, state), \
               state_data = COALESCE(?, state_data), \
               state_updated_at = COALESCE(?, state_updated_at), \
               input_tokens = COALESCE(?, input_tokens), \
               output_tokens = COALESCE(?, output_tokens), \
               context_tokens = COALESCE(?, context_tokens) \
             WHERE id = ? AND next_sequence_id = ? AND next_event_id = ?",
            values,
        ));
    }
    let mut values: Vec<Value> = Vec::with_capacity(commits.len() * 12);
    let mut rows = Vec::with_capacity(commits.len());
    for commit in commits {
        rows.push("(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)");
        values.extend(conversation_values(commit)?);
    }
    let sql = format!(
        "WITH v(id, exp_seq, exp_evt, next_seq, next_evt, updated_at, state, state_data, state_at, \
         input_tokens, output_tokens, context_tokens) AS (VALUES {}) \
         UPDATE OR FAIL conversations SET \
           next_sequence_id = v.next_seq, next_event_id = v.next_evt, updated_at = v.updated_at, \
           state = COALESCE(v.state, conversations.state), \
           state_data = COALESCE(v.state_data, conversations.state_data), \
           state_updated_at = COALESCE(v.state_at, conversations.state_updated_at), \
           input_tokens = COALESCE(v.input_tokens, conversations.input_tokens), \
           output_tokens = COALESCE(v.output_tokens, conversations.output_tokens), \
           context_tokens = COALESCE(v.context_tokens, conversations.context_tokens) \
         FROM v WHERE conversations.id = v.id \
           AND conversations.next_sequence_id = v.exp_seq AND conversations.next_event_id = v.exp_evt",
        rows.join(", ")
    );
    Ok(Statement::from_sql_and_values(
        DbBackend::Sqlite,
        sql,
        values,
    ))
}

/// A commit's values for its conversation's row: its id and the two counters it expects,
/// then the nine it sets. The state goes in as its JSON text (what SQLite stores for a JSON
/// value), written straight from the state.
fn conversation_values(commit: &ConversationCommit) -> Result<[Value; 12]> {
    let state_data = commit
        .state
        .as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(|e| StoreError::Other(format!("state does not serialise: {e}")))?;
    let usage = commit.usage;
    Ok([
        Value::from(commit.conversation_id.clone()),
        Value::from(commit.expected_next_sequence_id),
        Value::from(commit.expected_next_event_id),
        Value::from(commit.next_sequence_id),
        Value::from(commit.next_event_id),
        Value::from(commit.at),
        Value::String(commit.state.as_ref().map(|s| s.kind().to_owned())),
        Value::String(state_data),
        Value::ChronoDateTimeUtc(commit.state.as_ref().map(|_| commit.at)),
        Value::BigInt(usage.map(|u| to_i64(u.input_tokens))),
        Value::BigInt(usage.map(|u| to_i64(u.output_tokens))),
        Value::BigInt(usage.map(|u| to_i64(u.context_tokens))),
    ])
}

fn store_error(error: sqlx::Error) -> StoreError {
    DbErr::Exec(RuntimeErr::SqlxError(Arc::new(error))).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch's text is the same whatever webhook deliveries its commits carry, and each
    /// statement of the deliveries is a text of one shape: the connection keeps statements
    /// prepared per text, and the mixes of both had thrown them out under load (issue 39).
    #[test]
    fn a_batchs_text_does_not_vary_with_its_deliveries() {
        let commit = |deliveries: usize| {
            Arc::new(ConversationCommit {
                conversation_id: "c1".into(),
                state: None,
                messages: Vec::new(),
                events: Vec::new(),
                usage: None,
                expected_next_sequence_id: 1,
                expected_next_event_id: 1,
                next_sequence_id: 1,
                next_event_id: 1,
                at: chrono::DateTime::UNIX_EPOCH,
                lease: None,
                deliveries: (0..deliveries)
                    .map(|n| NewDelivery {
                        id: format!("d{n}"),
                        webhook_id: "wh".into(),
                        tenant_id: "t".into(),
                        conversation_id: "c1".into(),
                        event_seq: i64::try_from(n).expect("small"),
                        event_type: "turn.completed",
                        payload: "{}".into(),
                        created_at: 1,
                        expires_at: 2,
                        claimed: None,
                    })
                    .collect(),
                steps: Vec::new(),
            })
        };
        let text = |deliveries: usize| {
            batch(&[commit(deliveries)], Vec::new(), Vec::new(), false)
                .expect("a batch")
                .0
        };
        assert_eq!(text(0), text(1));
        assert_eq!(text(0), text(3));
        assert!(!text(3).contains("webhook_deliveries"));
        // Three deliveries: a statement of two rows and one of one.
        let alone = insert_deliveries(&[commit(3)]);
        assert_eq!(alone.len(), 2);
        assert_eq!(
            alone[0].sql,
            super::super::webhooks::insert_deliveries_sql(2, false)
        );
        assert_eq!(
            alone[1].sql,
            super::super::webhooks::insert_deliveries_sql(1, false)
        );
        assert!(insert_deliveries(&[commit(0)]).is_empty());
        // The results' statements go as one text.
        let joined = one_text(vec![
            ("UPDATE a".into(), vec![Value::from(1)]),
            ("UPDATE b".into(), vec![Value::from(2), Value::from(3)]),
        ])
        .expect("a text");
        assert_eq!(joined.sql, "UPDATE a;\nUPDATE b");
        assert_eq!(joined.values.map(|v| v.0.len()), Some(3));
        assert!(one_text(Vec::new()).is_none());
    }

    /// Every request waiting when a sync begins is answered by it; a log that cannot be synced
    /// fails every commit waiting for it, as unavailable (the commit is retried, never
    /// acknowledged).
    #[tokio::test]
    async fn log_syncs_answer_every_waiting_commit_and_report_failures() {
        let dir = std::env::temp_dir().join(format!("bedrock-log-sync-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let log = dir.join("db.sqlite-wal");
        std::fs::write(&log, b"frames").expect("a log file");
        let sync = Arc::new(LogSync::start(log.clone()).expect("the sync thread starts"));
        let waiting: Vec<_> = (0..16)
            .map(|_| {
                let sync = Arc::clone(&sync);
                tokio::spawn(async move { sync.sync().await })
            })
            .collect();
        for outcome in futures::future::join_all(waiting).await {
            outcome.expect("joins").expect("synced");
        }

        // The log is kept open: a path replaced under it does not change what is synced,
        // the file SQLite writes to.
        std::fs::remove_file(&log).expect("removed");
        Durable(Some(Arc::clone(&sync)))
            .wait()
            .await
            .expect("the kept log is synced");
        let _ = std::fs::remove_dir_all(&dir);

        // A log that cannot be opened fails the commits waiting for it; once it is there,
        // the next sync opens it.
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let sync = Arc::new(LogSync::start(log.clone()).expect("the sync thread starts"));
        let failed = Durable(Some(Arc::clone(&sync))).wait().await;
        assert!(
            matches!(&failed, Err(StoreError::Unavailable(why)) if why.contains("db.sqlite-wal")),
            "{failed:?}"
        );
        std::fs::write(&log, b"frames").expect("a log file");
        Durable(Some(sync)).wait().await.expect("opened and synced");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
