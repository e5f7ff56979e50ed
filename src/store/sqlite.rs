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

use std::sync::Arc;

use sea_orm::sqlx::{self, Executor, Sqlite, SqliteConnection, pool::PoolConnection};
use sea_orm::{DatabaseConnection, DbErr, RuntimeErr, Statement, Values};
use sea_query_sqlx::SqlxValues;
use tokio::sync::Mutex;

use super::{Result, StoreError};

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
    held: Arc<Mutex<Option<PoolConnection<Sqlite>>>>,
}

impl Writer {
    pub(super) fn new(pool: DatabaseConnection) -> Writer {
        Writer {
            pool,
            held: Arc::default(),
        }
    }

    /// Gives the held connection back and closes the pool (closing waits for every
    /// connection to come back).
    pub(super) async fn close(&self) -> Result<()> {
        drop(self.held.lock().await.take());
        self.pool.clone().close().await?;
        Ok(())
    }

    /// Writes `updates` (each with the rows it must change) and `inserts` in one transaction.
    pub(super) async fn commit(
        &self,
        updates: Vec<(Statement, u64)>,
        inserts: Vec<Statement>,
    ) -> Result<()> {
        let mut sql = String::from("BEGIN");
        let mut values = Vec::new();
        let mut append = |statement: Statement| {
            sql.push_str(";\n");
            sql.push_str(&statement.sql);
            if let Some(Values(v)) = statement.values {
                values.extend(v);
            }
        };
        for (statement, rows) in updates {
            append(statement);
            append(Statement::from_sql_and_values(
                sea_orm::DbBackend::Sqlite,
                "INSERT OR REPLACE INTO temp.commit_guard (id, ok) VALUES (1, changes() = ?)",
                [sea_orm::Value::from(
                    i64::try_from(rows).unwrap_or(i64::MAX),
                )],
            ));
        }
        inserts.into_iter().for_each(&mut append);
        sql.push_str(";\nCOMMIT");

        let mut held = self.held.lock().await;
        let conn = match &mut *held {
            Some(conn) => conn,
            None => held.insert(
                self.pool
                    .get_sqlite_connection_pool()
                    .acquire()
                    .await
                    .map_err(store_error)?,
            ),
        };
        let query = sqlx::query_with(sqlx::AssertSqlSafe(sql), SqlxValues(Values(values)));
        let Err(error) = conn.execute(query).await else {
            return Ok(());
        };
        // The transaction is still open when a statement before COMMIT failed. A connection
        // that cannot roll back is closed, and the next commit checks out another.
        if let Err(e) = conn.execute("ROLLBACK").await
            && !e.to_string().contains("no transaction is active")
        {
            tracing::warn!(error = %e, "rollback failed; closing the writer's connection");
            if let Some(conn) = held.take() {
                drop(conn.detach());
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

fn store_error(error: sqlx::Error) -> StoreError {
    DbErr::Exec(RuntimeErr::SqlxError(Arc::new(error))).into()
}
