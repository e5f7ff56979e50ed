//! The soak (issue 27): `bedrock serve` (the release binary) under mixed work for
//! `SOAK_SECONDS` (default 600) with `SOAK_CONVERSATIONS` conversations (default 1,000)
//! and `SOAK_WORKERS` clients at once (default 40). A conversation that has taken
//! `SOAK_TURNS_EACH` messages (default 40) is replaced by a new one, as users start new
//! conversations: a conversation's history is kept in memory while it is active and grows
//! with it, so without this the server's memory would grow with the run by design:
//! text turns, tool turns, sub-agents, cancels, background tools, WebSocket clients that
//! connect and drop, clients that send over a WebSocket and then stop reading, and a fake
//! LLM that fails 2.5% of requests with a 500 and stalls 2.5% (the gateway's idle timeout
//! ends those).
//!
//! It prints, per report period (`SOAK_REPORT_SECONDS`, default 60): turns ended, turns in
//! error by kind, refusals (busy), the server's RSS and open file descriptors, the
//! database's size, the runtime's live tasks and the running conversation actors. Then it
//! drains and checks: RSS and file descriptors flat after warm-up (the mean of the second
//! half of the reports after it within 10% of the first half's; `SOAK_WARMUP_SECONDS`, default 240: until the
//! conversations activated early have idled out once, the number of running actors grows), every conversation at rest (nothing stuck busy),
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
    /// The pool clients pick from, with the messages each has taken.
    pool: Mutex<Vec<(String, u64)>>,
    /// Every conversation ever in the pool, for the checks.
    all: Mutex<Vec<String>>,
    turns_each: u64,
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

    /// A random conversation of the pool; one that has had its turns is replaced first.
    async fn pick(&self, rng: &mut Rng) -> String {
        let slot = {
            let pool = self.pool.lock().unwrap();
            rng.below(pool.len() as u64) as usize
        };
        let worn = {
            let mut pool = self.pool.lock().unwrap();
            pool[slot].1 += 1;
            (pool[slot].1 > self.turns_each).then(|| pool[slot].0.clone())
        };
        if let Some(old) = worn {
            let fresh = self.create().await;
            let mut pool = self.pool.lock().unwrap();
            if pool[slot].0 == old {
                pool[slot] = (fresh.clone(), 1);
            }
            self.all.lock().unwrap().push(fresh);
        }
        self.pool.lock().unwrap()[slot].0.clone()
    }

    async fn create(&self) -> String {
        let conv: Value = self
            .http
            .post(format!("{}/v1/conversations", self.base))
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        conv["id"].as_str().unwrap().to_owned()
    }

    /// One piece of mixed work on a random conversation.
    async fn act(self: &Arc<Self>, rng: &mut Rng) {
        let id = &self.pick(rng).await;
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
    at: Duration,
    rss: u64,
    fds: u64,
}

fn process_sample(pid: u32, at: Duration) -> Sample {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
    Sample { at, rss, fds }
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

/// A gauge's value from the Prometheus text of the operator listener's /metrics.
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
    let warm_up = Duration::from_secs(env_number("SOAK_WARMUP_SECONDS", 240));
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
        let soak = Arc::new(Soak {
            ws_base: server.base.replacen("http://", "ws://", 1),
            base: server.base.clone(),
            http: http.clone(),
            pool: Mutex::new(Vec::new()),
            all: Mutex::new(Vec::new()),
            turns_each: env_number("SOAK_TURNS_EACH", 40),
            tally: Mutex::new(Tally::default()),
        });
        for _ in 0..n {
            let id = soak.create().await;
            soak.pool.lock().unwrap().push((id.clone(), 0));
            soak.all.lock().unwrap().push(id);
        }
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
            let sample = process_sample(server.pid(), started.elapsed());
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
                gauge(&http, &server.metrics_base, "bedrock_runtime_tasks_alive").await,
                gauge(&http, &server.metrics_base, "bedrock_conversations_running").await,
            );
            samples.push(sample);
            last = (turns, errors, busy);
        }
        for task in tasks {
            let _ = task.await;
        }
        // Drain: everything comes to rest (stalled readers' turns included).
        let all = soak.all.lock().unwrap().clone();
        let mut stuck = Vec::new();
        for id in &all {
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
        let warm = samples.iter().take_while(|s| s.at < warm_up).count();
        if samples.len() >= warm + 2 {
            // Gauges that move with the load (open sockets, say) are compared by their means:
            // the second half of the reports after the warm-up against the first half.
            let later = &samples[warm..];
            let (first, second) = later.split_at(later.len() / 2);
            let mean = |part: &[Sample], f: fn(&Sample) -> u64| {
                part.iter().map(f).sum::<u64>() as f64 / part.len().max(1) as f64
            };
            let (rss1, rss2) = (mean(first, |s| s.rss), mean(second, |s| s.rss));
            let (fds1, fds2) = (mean(first, |s| s.fds), mean(second, |s| s.fds));
            verdicts.push((
                rss2 <= rss1 * 1.10,
                format!(
                    "RSS flat after warm-up: {:.1} MiB on average in the first half of the reports after it, {:.1} MiB in the second ({:+.1}%)",
                    rss1 / 1048576.0,
                    rss2 / 1048576.0,
                    (rss2 / rss1 - 1.0) * 100.0
                ),
            ));
            verdicts.push((
                fds2 <= fds1 * 1.10,
                format!(
                    "file descriptors flat after warm-up: {fds1:.0} then {fds2:.0} on average ({:+.1}%)",
                    (fds2 / fds1 - 1.0) * 100.0
                ),
            ));
        } else {
            println!(
                "(too short to judge RSS and fds: {} reports, {warm} of them in the warm-up)",
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
        for id in &all {
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
