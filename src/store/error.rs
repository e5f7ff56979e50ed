//! Store errors, classified by what the caller can do about them.

use sea_orm::{DbErr, RuntimeErr, SqlErr};

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or is locked: try again later (HTTP 503).
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
    /// A uniqueness rule or a concurrent writer refused the write.
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("not found")]
    NotFound,
    /// A stored row that cannot be read back.
    #[error("corrupt data: {0}")]
    Corrupt(String),
    #[error("database error: {0}")]
    Other(String),
}

impl StoreError {
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }
}

/// SQLite result codes that mean "busy, try later" (SQLITE_BUSY, SQLITE_LOCKED and their
/// extended codes end in 5 or 6 in the low byte).
fn sqlite_busy(code: &str) -> bool {
    code.parse::<i32>()
        .is_ok_and(|code| matches!(code & 0xff, 5 | 6))
}

/// Postgres SQLSTATEs that mean the server cannot serve us right now.
fn postgres_unavailable(code: &str) -> bool {
    code.starts_with("08") // connection exception
        || code.starts_with("57P") // admin shutdown, crash shutdown, cannot connect now
        || code.starts_with("28") // invalid authorization (e.g. role set to NOLOGIN)
        || code == "53300" // too many connections
        || code == "40001" // serialization failure
        || code == "40P01" // deadlock detected
}

impl From<DbErr> for StoreError {
    // DbErr and sqlx's Error are non-exhaustive; anything not named here is `Other`.
    #[allow(clippy::wildcard_enum_match_arm)]
    fn from(err: DbErr) -> Self {
        if let Some(SqlErr::UniqueConstraintViolation(what)) = err.sql_err() {
            return StoreError::Conflict(what);
        }
        let text = err.to_string();
        match &err {
            DbErr::ConnectionAcquire(_) | DbErr::Conn(_) => StoreError::Unavailable(text),
            DbErr::Exec(RuntimeErr::SqlxError(sqlx))
            | DbErr::Query(RuntimeErr::SqlxError(sqlx)) => {
                use sea_orm::sqlx::Error;
                match sqlx.as_ref() {
                    Error::Io(_)
                    | Error::Tls(_)
                    | Error::Protocol(_)
                    | Error::PoolTimedOut
                    | Error::PoolClosed
                    | Error::WorkerCrashed => StoreError::Unavailable(text),
                    Error::Database(db) => match db.code() {
                        Some(code) if sqlite_busy(&code) || postgres_unavailable(&code) => {
                            StoreError::Unavailable(text)
                        }
                        Some(code) if code == super::postgres::GUARD_FAILED => {
                            StoreError::Conflict(text)
                        }
                        Some(_) | None => StoreError::Other(text),
                    },
                    _ => StoreError::Other(text),
                }
            }
            DbErr::RecordNotFound(_) => StoreError::NotFound,
            _ => StoreError::Other(text),
        }
    }
}
