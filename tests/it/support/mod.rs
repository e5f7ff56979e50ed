//! Shared test support: fresh databases, settings, and a running actor tree.

#![allow(dead_code)]

pub mod app;
pub mod db;
pub mod process;
pub mod rt;
pub mod ws;

pub use app::TestApp;
pub use db::TestDb;
pub use rt::TestRuntime;

use std::future::Future;
use std::time::Duration;

/// Polls `probe` until it returns `Some`, or fails the test after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
}

/// Generous: tests must not be flaky on a busy 2-core machine.
pub const WAIT: Duration = Duration::from_secs(30);
