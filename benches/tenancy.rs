//! Noisy neighbours (the multi-tenant security issue; docs/security.md, "Quotas"): a quiet
//! tenant's one-tool turn and its cancel, alone, then while another tenant floods the node
//! with CPU-burning tools, once with the default quotas and once with the quotas out of the
//! way (what the node did before them).
//!
//!     cargo bench --bench tenancy          (BENCH_TURNS=20, BENCH_FLOOD=150 by default)
//!
//! The server runs in this process on SQLite with the sandbox as configured (enforced when
//! the kernel has it), auth required, two tenants; the fake LLM follows each message's
//! instruction (`call bash {...}`). A turn is timed from the POST of its message to the
//! conversation's state at rest (polled every millisecond); a cancel from the POST of the
//! cancel to the state at rest, with `sleep 30` running.
//! Targets: the quiet tenant's p50 within 1.5x of its p50 alone; cancel under 100 ms.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use bedrock::app::{Application, create_tenant};
use bedrock::config::Settings;
use bedrock::testkit::FakeLlm;
use common::{ms, percentile};
use serde_json::{Value, json};

struct Node {
    base: String,
    http: reqwest::Client,
    quiet: String,
    noisy: String,
    shutdown: tokio_util::sync::CancellationToken,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
    workspace: std::path::PathBuf,
}

fn count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn start(llm: &FakeLlm, open_quotas: bool) -> Node {
    let workspace =
        std::env::temp_dir().join(format!("bedrock-bench-tenancy-{}", uuid::Uuid::now_v7()));
    let mut env: Vec<(String, String)> = vec![
        ("BEDROCK_LISTEN".into(), "127.0.0.1:0".into()),
        ("BEDROCK_AUTH".into(), "required".into()),
        (
            "BEDROCK_DATABASE_URL".into(),
            format!("sqlite://{}/bedrock.db?mode=rwc", workspace.display()),
        ),
        ("BEDROCK_LLM_BASE_URL".into(), llm.base_url.clone()),
        ("BEDROCK_LLM_API_KEY".into(), "k".into()),
        (
            "BEDROCK_WORKSPACE_ROOT".into(),
            workspace.join("ws").display().to_string(),
        ),
        (
            "BEDROCK_DATA_DIR".into(),
            workspace.join("data").display().to_string(),
        ),
    ];
    if open_quotas {
        env.extend(
            common::OPEN_QUOTAS
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
    }
    std::fs::create_dir_all(&workspace).unwrap();
    let settings = Settings::load_from(None, env).unwrap();
    let (_, quiet) = create_tenant(&settings, "quiet").await.unwrap();
    let (_, noisy) = create_tenant(&settings, "noisy").await.unwrap();
    let app = Application::build(settings).await.unwrap();
    let base = format!("http://{}", app.addr);
    let shutdown = app.shutdown_token();
    let server = tokio::spawn(app.run_until_stopped());
    Node {
        base,
        http: reqwest::Client::new(),
        quiet,
        noisy,
        shutdown,
        server,
        workspace,
    }
}

impl Node {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        key: &str,
        body: Value,
    ) -> (u16, Value) {
        let mut request = self
            .http
            .request(method, format!("{}/v1{path}", self.base))
            .bearer_auth(key);
        if !body.is_null() {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    async fn conversation(&self, key: &str) -> Option<String> {
        let (status, body) = self
            .call(reqwest::Method::POST, "/conversations", key, json!({}))
            .await;
        (status == 201).then(|| body["id"].as_str().unwrap().to_owned())
    }

    async fn send(&self, key: &str, id: &str, command: &str) -> u16 {
        let text = format!(
            "call bash {}",
            json!({ "command": command, "timeout_ms": 120000 })
        );
        self.call(
            reqwest::Method::POST,
            &format!("/conversations/{id}/messages"),
            key,
            json!({ "text": text }),
        )
        .await
        .0
    }

    async fn kind(&self, key: &str, id: &str) -> String {
        let (_, body) = self
            .call(
                reqwest::Method::GET,
                &format!("/conversations/{id}"),
                key,
                Value::Null,
            )
            .await;
        body["state"]["kind"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    async fn until(&self, key: &str, id: &str, done: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if done(&self.kind(key, id).await) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the conversation did not get there"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// The quiet tenant's one-tool turns and cancels: (turn times, cancel times).
    async fn quiet(&self, turns: usize, cancels: usize) -> (Vec<Duration>, Vec<Duration>) {
        let key = self.quiet.clone();
        let id = self.conversation(&key).await.unwrap();
        let at_rest = |kind: &str| matches!(kind, "idle" | "error");
        let mut times = Vec::new();
        for _ in 0..turns {
            let started = Instant::now();
            assert_eq!(self.send(&key, &id, "true").await, 202);
            self.until(&key, &id, at_rest).await;
            times.push(started.elapsed());
        }
        let mut cancel_times = Vec::new();
        for _ in 0..cancels {
            assert_eq!(self.send(&key, &id, "sleep 30").await, 202);
            self.until(&key, &id, |kind| kind == "tool_executing").await;
            // The tool has started (or waits for a slot): give it a moment to be running.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let started = Instant::now();
            self.call(
                reqwest::Method::POST,
                &format!("/conversations/{id}/cancel"),
                &key,
                Value::Null,
            )
            .await;
            self.until(&key, &id, at_rest).await;
            cancel_times.push(started.elapsed());
        }
        times.sort();
        cancel_times.sort();
        (times, cancel_times)
    }

    /// The noisy tenant starts `flood` conversations each running a CPU-burning tool;
    /// returns its conversations and how many sends were refused.
    async fn flood(&self, flood: usize) -> (Vec<String>, usize) {
        let key = self.noisy.clone();
        let mut ids = Vec::new();
        let mut refused = 0;
        for _ in 0..flood {
            let Some(id) = self.conversation(&key).await else {
                refused += 1;
                continue;
            };
            if self
                .send(&key, &id, "timeout 300 sh -c 'while :; do :; done'")
                .await
                == 202
            {
                ids.push(id);
            } else {
                refused += 1;
            }
        }
        (ids, refused)
    }

    async fn stop(self, noisy: &[String]) {
        for id in noisy {
            self.call(
                reqwest::Method::POST,
                &format!("/conversations/{id}/cancel"),
                &self.noisy,
                Value::Null,
            )
            .await;
        }
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(30), self.server).await;
        let _ = std::fs::remove_dir_all(&self.workspace);
    }
}

fn report(what: &str, turns: &[Duration], cancels: &[Duration], alone: Duration) {
    let p50 = percentile(turns, 50.0);
    println!(
        "{what}: one-tool turn p50 {} p90 {} ({:.2}x alone); cancel p50 {} max {}",
        ms(p50),
        ms(percentile(turns, 90.0)),
        p50.as_secs_f64() / alone.as_secs_f64().max(1e-9),
        ms(percentile(cancels, 50.0)),
        ms(cancels.last().copied().unwrap_or_default()),
    );
}

#[tokio::main]
async fn main() {
    let turns = count("BENCH_TURNS", 20);
    let flood = count("BENCH_FLOOD", 150);
    let cancels = 5;
    let llm = FakeLlm::start().await;
    llm.follow_instructions();
    llm.forget_requests();
    for open in [false, true] {
        let node = start(&llm, open).await;
        let quotas = if open {
            "quotas out of the way"
        } else {
            "default quotas"
        };
        // Warm up, then alone.
        node.quiet(3, 0).await;
        let (alone, alone_cancels) = node.quiet(turns, cancels).await;
        report(
            &format!("alone ({quotas})"),
            &alone,
            &alone_cancels,
            percentile(&alone, 50.0),
        );
        let (noisy, refused) = node.flood(flood).await;
        // Let the flood's tools start.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (flooded, flooded_cancels) = node.quiet(turns, cancels).await;
        report(
            &format!(
                "beside {} CPU-burning turns of another tenant ({quotas}; {refused} of its sends refused)",
                noisy.len()
            ),
            &flooded,
            &flooded_cancels,
            percentile(&alone, 50.0),
        );
        node.stop(&noisy).await;
    }
}
