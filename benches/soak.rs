//! The soak (issue 27): `bedrock serve` (the release binary) under mixed work for
//! `SOAK_SECONDS` (default 600) with `SOAK_CONVERSATIONS` conversations (default 1,000)
//! and `SOAK_WORKERS` clients at once (default 40):
//! text turns, tool turns, sub-agents, cancels, background tools, WebSocket clients that
//! connect and drop, clients that send over a WebSocket and then stop reading, and a fake
//! LLM that fails 2.5% of requests with a 500 and stalls 2.5% (the gateway's idle timeout
//! ends those).
//!
//! It prints, per report period (`SOAK_REPORT_SECONDS`, default 60): turns ended, turns in
//! error by kind, refusals (busy), the server's RSS and open file descriptors, the
//! database's size, the runtime's live tasks and the running conversation actors. Then it
//! drains and checks: RSS and file descriptors flat after warm-up (every later report within
//! 10% of the first after the warm-up), every conversation at rest (nothing stuck busy),
//! every stored chain valid (sub-agents' too), no acknowledged message lost.
//!
//!     cargo bench --bench soak            (BENCH_DB=sqlite|postgres as for the others)

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bedrock::state_machine::{MessageContent, validate_chain};
use bedrock::store::{Store, StoreOptions};
use bedrock::testkit::FakeLlm;
use common::BenchDb;
use common::live::{ServerProcess, next_frame};
use futures::SinkExt;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// xorshift64*: each worker its own, so runs are alike.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

#[derive(Default)]
struct Tally {
    turns: u64,
    errors: BTreeMap<String, u64>,
    busy: u64,
    /// (conversation, message_id) of every acknowledged message.
    acked: Vec<(String, String)>,
    failures: Vec<String>,
}

struct Soak {
    base: String,
    ws_base: String,
    http: reqwest::Client,
    conversations: Vec<String>,
    tally: Mutex<Tally>,
}

impl Soak {
    fn note_failure(&self, what: String) {
        let mut tally = self.tally.lock().unwrap();
        if tally.failures.len() < 20 {
            tally.failures.push(what);
        }
    }

    async fn state(&self, id: &str) -> Option<Value> {
        let answer = self
            .http
            .get(format!("{}/v1/conversations/{id}", self.base))
            .send()
            .await
            .ok()?;
        answer
            .json::<Value>()
            .await
            .ok()
            .map(|c| c["state"].clone())
    }

    /// Sends `text`; true when acknowledged (and noted).
    async fn send(&self, id: &str, text: &str) -> bool {
        let key = uuid::Uuid::now_v7().to_string();
        let answer = self
            .http
            .post(format!("{}/v1/conversations/{id}/messages", self.base))
            .json(&json!({"text": text, "message_id": key}))
            .send()
            .await;
        match answer.map(|a| a.status().as_u16()) {
            Ok(200 | 202) => {
                self.tally.lock().unwrap().acked.push((id.to_owned(), key));
                true
            }
            Ok(409) => {
                self.tally.lock().unwrap().busy += 1;
                false
            }
            Ok(status) => {
                self.note_failure(format!("send: HTTP {status}"));
                false
            }
            Err(e) => {
                self.note_failure(format!("send: {e}"));
                false
            }
        }
    }

    /// Waits for `id` to rest; counts the turn and its error kind.
    async fn settle(&self, id: &str) {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(120) {
            if let Some(state) = self.state(id).await {
                match state["kind"].as_str() {
                    Some("idle") => {
                        self.tally.lock().unwrap().turns += 1;
                        return;
                    }
                    Some("error") => {
                        let mut tally = self.tally.lock().unwrap();
                        tally.turns += 1;
                        let kind = state["error_kind"].as_str().unwrap_or("?").to_owned();
                        *tally.errors.entry(kind).or_default() += 1;
                        return;
                    }
                    _ => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.note_failure(format!("{id} still busy after 120 s"));
    }

    async fn socket(&self, id: &str) -> Option<common::live::Socket> {
        tokio_tungstenite::connect_async(format!("{}/v1/conversations/{id}/ws", self.ws_base))
            .await
            .ok()
            .map(|(socket, _)| socket)
    }

    /// One piece of mixed work on a random conversation.
    async fn act(self: &Arc<Self>, rng: &mut Rng) {
        let id = &self.conversations[rng.below(self.conversations.len() as u64) as usize];
        match rng.below(100) {
            0..40 => {
                if self.send(id, "hello").await {
                    self.settle(id).await;
                }
            }
            40..65 => {
                if self.send(id, r#"call bash {"command": "echo soak"}"#).await {
                    self.settle(id).await;
                }
            }
            65..70 => {
                let spawn = r#"call spawn_sub_agents {"tasks": [{"prompt": "a sub task"}, {"prompt": "another"}]}"#;
                if self.send(id, spawn).await {
                    self.settle(id).await;
                }
            }
            70..75 => {
                let background =
                    r#"call bash {"command": "sleep 1; echo later", "background": true}"#;
                if self.send(id, background).await {
                    self.settle(id).await;
                }
            }
            75..85 => {
                if self.send(id, r#"call bash {"command": "sleep 5"}"#).await {
                    tokio::time::sleep(Duration::from_millis(100 + rng.below(300))).await;
                    let _ = self
                        .http
                        .post(format!("{}/v1/conversations/{id}/cancel", self.base))
                        .send()
                        .await;
                    self.settle(id).await;
                }
            }
            85..95 => {
                // A client that connects, reads a little and goes.
                if let Some(mut socket) = self.socket(id).await {
                    let _ =
                        tokio::time::timeout(Duration::from_millis(200), next_frame(&mut socket))
                            .await;
                }
            }
            _ => {
                // A client that sends over its socket, then stops reading for 20 s.
                if let Some(mut socket) = self.socket(id).await {
                    let key = uuid::Uuid::now_v7().to_string();
                    let frame = json!({"type": "user_message", "text": "then I stop reading", "message_id": key});
                    if socket.send(Message::text(frame.to_string())).await.is_ok() {
                        let soak = Arc::clone(self);
                        let id = id.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_secs(20)).await;
                            drop(socket);
                            // Whether the frame's message was taken is not known here (it
                            // is not acknowledged); the turn is still counted when it ends.
                            soak.settle(&id).await;
                        });
                    }
                }
            }
        }
    }
}

/// One report: resources of the server process and the database.
struct Sample {
    rss: u64,
    fds: u64,
}

fn process_sample(pid: u32) -> Sample {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
    Sample { rss, fds }
}

async fn database_bytes(db: &BenchDb) -> u64 {
    if db.label == "postgres" {
        let sql = "SELECT pg_database_size(current_database())::bigint AS n";
        return u64::try_from(common::postgres_number(&db.url, &[], sql).await).unwrap_or(0);
    }
    let file = db
        .url
        .trim_start_matches("sqlite://")
        .split('?')
        .next()
        .unwrap_or_default()
        .to_owned();
    ["", "-wal"]
        .iter()
        .filter_map(|suffix| std::fs::metadata(format!("{file}{suffix}")).ok())
        .map(|m| m.len())
        .sum()
}

/// A gauge's value from the Prometheus text of /metrics.
async fn gauge(http: &reqwest::Client, base: &str, name: &str) -> u64 {
    let Ok(answer) = http.get(format!("{base}/metrics")).send().await else {
        return 0;
    };
    let text = answer.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

#[tokio::main]
async fn main() {
    bedrock::install_crypto();
    let seconds = env_number("SOAK_SECONDS", 600);
    let n = env_number("SOAK_CONVERSATIONS", 1000);
    let workers = env_number("SOAK_WORKERS", 40);
    let period = Duration::from_secs(env_number("SOAK_REPORT_SECONDS", 60));
    for db in BenchDb::all().await {
        let llm = FakeLlm::start().await;
        llm.forget_requests();
        llm.follow_instructions();
        llm.faults(25, 25);
        let workspace =
            std::env::temp_dir().join(format!("bedrock-soak-{}", uuid::Uuid::now_v7().simple()));
        let server = ServerProcess::start(
            &db.url,
            &llm.base_url,
            &workspace,
            &[
                ("BEDROCK_LLM__FIRST_BYTE_TIMEOUT_MS", "2000".into()),
                ("BEDROCK_LLM__IDLE_TIMEOUT_MS", "2000".into()),
                ("BEDROCK_LLM__MAX_CONCURRENCY", "512".into()),
                ("BEDROCK_SERVER__CLIENT_LAG_FRAMES", "64".into()),
            ],
        );
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let mut conversations = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let conv: Value = http
                .post(format!("{}/v1/conversations", server.base))
                .json(&json!({}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            conversations.push(conv["id"].as_str().unwrap().to_owned());
        }
        let soak = Arc::new(Soak {
            ws_base: server.base.replacen("http://", "ws://", 1),
            base: server.base.clone(),
            http: http.clone(),
            conversations,
            tally: Mutex::new(Tally::default()),
        });
        println!(
            "\n# soak on {}: {n} conversations, {workers} clients at once, {seconds} s (report every {} s)",
            db.label,
            period.as_secs()
        );
        println!(
            "| t | turns | in error (by kind) | busy | server RSS | fds | database | tasks alive | actors |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let mut tasks = Vec::new();
        for w in 0..workers {
            let soak = soak.clone();
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (w + 1));
                while Instant::now() < deadline {
                    soak.act(&mut rng).await;
                }
            }));
        }
        let started = Instant::now();
        let mut samples = Vec::new();
        let mut last = (0u64, BTreeMap::new(), 0u64);
        while Instant::now() < deadline {
            tokio::time::sleep(period.min(deadline.saturating_duration_since(Instant::now())))
                .await;
            let sample = process_sample(server.pid());
            let (turns, errors, busy) = {
                let tally = soak.tally.lock().unwrap();
                (tally.turns, tally.errors.clone(), tally.busy)
            };
            let new_errors: Vec<String> = errors
                .iter()
                .map(|(kind, count)| format!("{kind} {}", count - last.1.get(kind).unwrap_or(&0)))
                .collect();
            println!(
                "| {} s | {} | {} | {} | {:.1} MiB | {} | {:.1} MiB | {} | {} |",
                started.elapsed().as_secs(),
                turns - last.0,
                if new_errors.is_empty() {
                    "-".to_owned()
                } else {
                    new_errors.join(", ")
                },
                busy - last.2,
                sample.rss as f64 / (1 << 20) as f64,
                sample.fds,
                database_bytes(&db).await as f64 / (1 << 20) as f64,
                gauge(&http, &server.base, "bedrock_runtime_tasks_alive").await,
                gauge(&http, &server.base, "bedrock_conversations_running").await,
            );
            samples.push(sample);
            last = (turns, errors, busy);
        }
        for task in tasks {
            let _ = task.await;
        }
        // Drain: everything comes to rest (stalled readers' turns included).
        let mut stuck = Vec::new();
        for id in &soak.conversations {
            let mut rested = false;
            for _ in 0..1200 {
                match soak
                    .state(id)
                    .await
                    .as_ref()
                    .and_then(|s| s["kind"].as_str().map(str::to_owned))
                {
                    Some(kind) if kind == "idle" || kind == "error" => {
                        rested = true;
                        break;
                    }
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            if !rested {
                stuck.push(id.clone());
            }
        }
        // Checks.
        let mut verdicts = Vec::new();
        let warm = samples.len().min(2);
        if samples.len() >= warm + 2 {
            let base = &samples[warm];
            let rss_max = samples[warm..].iter().map(|s| s.rss).max().unwrap_or(0);
            let fds_max = samples[warm..].iter().map(|s| s.fds).max().unwrap_or(0);
            let rss_ok = rss_max as f64 <= base.rss as f64 * 1.10;
            let fds_ok = fds_max as f64 <= (base.fds as f64 * 1.10).max(base.fds as f64 + 8.0);
            verdicts.push((rss_ok, format!("RSS flat after warm-up: {:.1} MiB at the first report after it, {:.1} MiB at most later", base.rss as f64 / 1048576.0, rss_max as f64 / 1048576.0)));
            verdicts.push((
                fds_ok,
                format!(
                    "file descriptors flat after warm-up: {} then at most {}",
                    base.fds, fds_max
                ),
            ));
        } else {
            println!(
                "(too short to judge RSS and fds: {} reports; warm-up is the first {warm})",
                samples.len()
            );
        }
        verdicts.push((
            stuck.is_empty(),
            format!(
                "every conversation at rest after the drain: {} stuck {:?}",
                stuck.len(),
                &stuck[..stuck.len().min(5)]
            ),
        ));
        let store = Store::connect(&StoreOptions {
            url: db.url.clone(),
            max_connections: 2,
            acquire_timeout: Duration::from_secs(10),
        })
        .await
        .unwrap();
        let (acked, failures) = {
            let tally = soak.tally.lock().unwrap();
            (tally.acked.clone(), tally.failures.clone())
        };
        let mut broken = Vec::new();
        let mut lost = Vec::new();
        let mut checked = 0;
        let mut by_conversation: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (id, key) in &acked {
            by_conversation.entry(id).or_default().push(key);
        }
        for id in &soak.conversations {
            let mut ids = vec![id.clone()];
            ids.extend(store.children(id).await.unwrap().into_iter().map(|c| c.id));
            for conv in &ids {
                let messages = store.messages_between(conv, 1, i64::MAX).await.unwrap();
                let contents: Vec<&MessageContent> = messages.iter().map(|m| &m.content).collect();
                checked += 1;
                if let Err(e) = validate_chain(contents, false) {
                    broken.push(format!("{conv}: {e}"));
                }
                if conv == id {
                    for key in by_conversation.get(id.as_str()).into_iter().flatten() {
                        if !messages
                            .iter()
                            .any(|m| m.client_message_id.as_deref() == Some(*key))
                        {
                            lost.push(format!("{id}/{key}"));
                        }
                    }
                }
            }
        }
        verdicts.push((broken.is_empty(), format!("every stored chain valid: {checked} conversations (sub-agents included), {} broken {:?}", broken.len(), &broken[..broken.len().min(3)])));
        verdicts.push((
            lost.is_empty(),
            format!(
                "no acknowledged message lost: {} acknowledged, {} lost {:?}",
                acked.len(),
                lost.len(),
                &lost[..lost.len().min(3)]
            ),
        ));
        {
            let tally = soak.tally.lock().unwrap();
            println!(
                "\nturns ended: {}, in error: {:?}, refused busy: {}; client-side failures: {:?}",
                tally.turns, tally.errors, tally.busy, failures
            );
        }
        let mut pass = true;
        for (ok, what) in &verdicts {
            println!("{} {what}", if *ok { "PASS" } else { "FAIL" });
            pass &= ok;
        }
        let _ = store.close().await;
        server.stop();
        let _ = std::fs::remove_dir_all(&workspace);
        db.drop_db().await;
        assert!(pass, "the soak failed on one of its checks (above)");
    }
}
