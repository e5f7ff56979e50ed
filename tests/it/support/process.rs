//! The `bedrock` binary run as a real process.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use bedrock::testkit::FakeLlm;
use serde_json::Value;

use super::{TestDb, WAIT};

/// The `bedrock` binary, started as a real process.
pub struct Server {
    pub child: Child,
    pub base: String,
    /// The operator listener (`GET /metrics`).
    pub metrics_base: String,
    /// Every line the server wrote to stderr (its logs).
    pub logs: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

pub fn command(db: &TestDb, llm: &FakeLlm, workspace: &std::path::Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bedrock"));
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("BEDROCK_DATABASE_URL", &db.url)
        .env("BEDROCK_LLM_BASE_URL", &llm.base_url)
        .env("BEDROCK_LLM_API_KEY", "k")
        .env("BEDROCK_WORKSPACE_ROOT", workspace)
        .env("BEDROCK_DATA_DIR", format!("{}-data", workspace.display()))
        .env("BEDROCK_AUTH", "dev")
        .env("BEDROCK_LISTEN", "127.0.0.1:0")
        .env("BEDROCK_METRICS__LISTEN", "127.0.0.1:0")
        .env("BEDROCK_CLUSTER__NODE_ID", super::app::node_id(workspace))
        .env("BEDROCK_LOG_FORMAT", "json")
        // These tests drive one tenant (dev) through dozens of turns at once to test
        // durability and failover, not quotas (tests/it/tenancy.rs tests those).
        .env("BEDROCK_QUOTAS__CONCURRENT_TURNS", "100000")
        .env("RUST_LOG", "info");
    cmd
}

impl Server {
    pub fn start(db: &TestDb, llm: &FakeLlm, workspace: &std::path::Path) -> Server {
        Self::start_with(command(db, llm, workspace))
    }

    /// Starts `serve` with the given command (environment and all).
    pub fn start_with(mut cmd: Command) -> Server {
        let mut child = cmd
            .arg("serve")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        let logs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                kept.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(line.clone());
                if let Ok(value) = serde_json::from_str::<Value>(&line)
                    && let Some(addr) = value["fields"]["addr"].as_str()
                {
                    let metrics = value["fields"]["metrics_addr"].as_str().unwrap_or_default();
                    let _ = tx.send((addr.to_owned(), metrics.to_owned()));
                }
            }
        });
        let (addr, metrics) = rx.recv_timeout(WAIT).expect("the server logs its address");
        Server {
            child,
            base: format!("http://{addr}"),
            metrics_base: format!("http://{metrics}"),
            logs,
        }
    }

    pub fn kill_hard(mut self) {
        self.child.kill().expect("SIGKILL");
        let _ = self.child.wait();
    }

    /// POSTs `path` (under /v1) with a JSON body and returns the JSON answer.
    pub async fn post(&self, path: &str, body: Value) -> Value {
        reqwest::Client::new()
            .post(format!("{}/v1{path}", self.base))
            .json(&body)
            .send()
            .await
            .expect("the server answers")
            .json()
            .await
            .expect("a JSON answer")
    }

    /// GETs `path` (under /v1); `None` when there is no JSON answer (yet).
    pub async fn get(&self, path: &str) -> Option<Value> {
        reqwest::get(format!("{}/v1{path}", self.base))
            .await
            .ok()?
            .json()
            .await
            .ok()
    }

    /// Sends a user message to conversation `id` and expects it accepted.
    pub async fn send(&self, id: &str, text: &str) {
        let sent = reqwest::Client::new()
            .post(format!("{}/v1/conversations/{id}/messages", self.base))
            .json(&serde_json::json!({ "text": text }))
            .send()
            .await
            .expect("the server answers");
        assert_eq!(sent.status(), 202);
    }

    /// A new conversation (dev tenant); returns its JSON.
    pub async fn conversation(&self) -> Value {
        self.post("/conversations", serde_json::json!({})).await
    }

    /// SIGTERM, then waits for the process to exit.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap_or(0));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        self.child.wait().expect("the server exits")
    }
}

/// A server a failed test leaves behind is killed (by its own pid) rather than left running.
impl Drop for Server {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Removes a test's workspace and the data dir beside it.
pub fn remove_workspace(workspace: &std::path::Path) {
    let _ = std::fs::remove_dir_all(workspace);
    let _ = std::fs::remove_dir_all(format!("{}-data", workspace.display()));
}
