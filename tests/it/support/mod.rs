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

/// The messages of a chat-completions request the fake LLM recorded (none if it has none).
pub fn request_messages(request: &serde_json::Value) -> &[serde_json::Value] {
    request["messages"].as_array().map_or(&[], Vec::as_slice)
}

/// The names of the tools a recorded request offers.
pub fn tool_names(request: &serde_json::Value) -> Vec<String> {
    request["tools"]
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The roles of a recorded request's messages, in order.
pub fn roles(request: &serde_json::Value) -> Vec<&str> {
    request_messages(request)
        .iter()
        .filter_map(|m| m["role"].as_str())
        .collect()
}

/// Generous: tests must not be flaky on a busy 2-core machine.
pub const WAIT: Duration = Duration::from_secs(30);

/// A command that sleeps like `sleep 300` and that [`running`] can find in the host's /proc,
/// whatever PID namespace the sandbox put it in (its `$$` is the namespace's, not the host's).
pub fn unique_sleep() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("sleep 300.{}{n:04}", std::process::id())
}

/// Whether a live (not zombie) process has exactly `command` (split on spaces) as its
/// command line.
pub fn running(command: &str) -> bool {
    let wanted: Vec<u8> = command
        .split(' ')
        .flat_map(|part| part.bytes().chain([0]))
        .collect();
    any_process(|line| line == wanted.as_slice())
}

/// Whether a live process's command line contains `text`.
pub fn running_containing(text: &str) -> bool {
    any_process(|line| String::from_utf8_lossy(line).contains(text))
}

/// Whether a live (not zombie) process of the host has a command line that `matches`.
fn any_process(matches: impl Fn(&[u8]) -> bool) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|entry| {
        let dir = entry.path();
        std::fs::read(dir.join("cmdline")).is_ok_and(|line| matches(&line))
            && std::fs::read_to_string(dir.join("stat")).is_ok_and(|s| !s.contains(") Z "))
    })
}

/// Waits until a process with exactly `command` as its command line runs.
pub async fn wait_running(command: &str) {
    eventually(&format!("`{command}` to run"), WAIT, || async {
        running(command).then_some(())
    })
    .await
}
