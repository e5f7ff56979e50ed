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

/// SQLite result codes that mean "try later": SQLITE_BUSY and SQLITE_LOCKED (busy), and
/// SQLITE_FULL and SQLITE_IOERR (the disk is full, or a write failed: both clear once space
/// is freed). Extended codes keep the primary code in the low byte. SQLite's codes are short
/// numbers; a Postgres SQLSTATE always has five characters.
fn sqlite_busy(code: &str) -> bool {
    code.len() < 5
        && code
            .parse::<i32>()
            .is_ok_and(|code| matches!(code & 0xff, 5 | 6 | 10 | 13))
}

/// Postgres SQLSTATEs that mean the server cannot serve us right now.
fn postgres_unavailable(code: &str) -> bool {
    code.starts_with("08") // connection exception
        || code.starts_with("57P") // admin shutdown, crash shutdown, cannot connect now
        || code.starts_with("28") // invalid authorization (e.g. role set to NOLOGIN)
        || code.starts_with("53") // insufficient resources: disk full, out of memory, too many connections
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A full disk or a failed write is waited out like a busy database (events that must
    /// not be lost are retried until it clears); the codes of one database never pass for
    /// the other's.
    #[test]
    fn transient_codes_are_told_apart_per_database() {
        // SQLITE_BUSY, SQLITE_LOCKED, SQLITE_IOERR, SQLITE_FULL, SQLITE_BUSY_SNAPSHOT (517),
        // SQLITE_IOERR_WRITE (778).
        for code in ["5", "6", "10", "13", "517", "778"] {
            assert!(sqlite_busy(code), "{code}");
        }
        // SQLITE_CONSTRAINT (19), SQLITE_CORRUPT (11), and Postgres SQLSTATEs.
        for code in ["19", "11", "53100", "23505", "40001"] {
            assert!(!sqlite_busy(code), "{code}");
        }
        for code in ["53100", "53200", "53300", "08006", "57P01", "40001"] {
            assert!(postgres_unavailable(code), "{code}");
        }
        for code in ["23505", "42P01", "22001"] {
            assert!(!postgres_unavailable(code), "{code}");
        }
    }
}
