//! End-to-end figures, seen from outside the way users see Bedrock (issue 21): the release
//! `bedrock serve` as its own process, the testkit's fake LLM as a second process, and a load
//! generator in a third, over real HTTP and WebSocket. Each turn: POST a message, wait on the
//! conversation's WebSocket for the turn's final state, check the answer. The fake asks for
//! one `think` call per turn and then answers `done: <the user's text>`.
//!
//! Two modes: reused conversations (each worker keeps one conversation and one WebSocket,
//! turn after turn, and moves to a new one after `BENCH_TURNS_PER_CONVERSATION` turns,
//! default 50: every LLM request carries the whole history, so without a bound the cost of a
//! turn would grow with the length of the run; 0 = never) and a new conversation per turn
//! (create, connect, send, wait, close). Each at 1 and at 50 workers. Printed: turns/s, turn latency p50/p99/max, the server process's
//! own CPU per turn (from /proc, the server's pid only) and its RSS, as a table and as one
//! JSON line.
//!
//!     cargo bench --bench e2e            (BENCH_SECONDS=5 by default)
//!
//! SQLite by default; with BEDROCK_TEST_DATABASE_URL also Postgres (a fresh database each),
//! `BENCH_DB=sqlite|postgres` keeps one. `BENCH_MODES=reused,new,scale`, `BENCH_WORKERS=1,50`
//! and `BENCH_SCALE=1000,5000,10000` (conversations, each with a client, in the scale mode)
//! choose the rows. The server gets the bench's own `BEDROCK_*` settings (e.g.
//! `BEDROCK_EVENTS__RETAIN=7d` for a frame retention window), and runs under
//! `BENCH_SERVER_WRAP` when set (e.g. `heaptrack -o /tmp/heap`; its CPU and RSS figures are
//! then the wrapper's). `BENCH_AGENT_RULES=N` creates every conversation from an agent with
//! N permission rules (issue 38); `BENCH_WEBHOOK=1` subscribes an endpoint on a local
//! receiver to `turn.completed` (issue 39; the server needs
//! `BEDROCK_EGRESS__ALLOW='["127.0.0.1"]'`). After each
//! mode the server stops and the database's growth per turn is printed (SQLite's file with
//! its log checkpointed, Postgres's `pg_database_size`); `BENCH_STORED_DETAIL=1` adds each
//! Postgres relation's (table, index, TOAST table) growth per turn.
//!
//! The one binary plays three parts, by `BEDROCK_E2E_ROLE`: unset, it is the conductor that
//! starts the other two and the server; `fake-llm` and `load` are the other processes.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::live::{Owned, ServerProcess, Socket, answer, cpu_time, next_frame};
use common::{BenchDb, percentile, seconds};
use futures::SinkExt;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

const ROLE: &str = "BEDROCK_E2E_ROLE";

fn main() {
    match std::env::var(ROLE).as_deref() {
        Ok("fake-llm") => common::live::serve_fake_llm(),
        Ok("load") => load(),
        _ => conduct(),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

// ---------------------------------------------------------------------------------------
// The fake LLM process.

// ---------------------------------------------------------------------------------------
// The load generator process.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Each worker keeps one conversation and its WebSocket.
    Reused,
    /// Each turn creates a conversation, connects, sends, waits, closes.
    New,
    /// Every conversation (`BENCH_SCALE` of them) is created and connected first, each
    /// with a client; then all take turns, sent over their WebSockets.
    Scale,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Reused => "reused",
            Mode::New => "new",
            Mode::Scale => "scale",
        }
    }

    fn parse(name: &str) -> Option<Mode> {
        match name {
            "reused" => Some(Mode::Reused),
            "new" => Some(Mode::New),
            "scale" => Some(Mode::Scale),
            _ => None,
        }
    }
}

struct Client {
    http: reqwest::Client,
    base: String,
    ws_base: String,
    /// What a new conversation is created with: `{}`, or `{"agent": ...}`.
    create_body: Value,
}

impl Client {
    /// With `BENCH_AGENT_RULES=N`, conversations are created from an agent whose N
    /// permission rules every tool call is checked against (N - 1 that never match, then
    /// one that allows everything): the cost of agents and their rules (issue 38).
    async fn use_agent(&mut self) {
        let Some(rules) = std::env::var("BENCH_AGENT_RULES")
            .ok()
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|n| *n > 0)
        else {
            return;
        };
        let probe = self.create().await.unwrap();
        let conversation: Value = self
            .http
            .get(format!("{}/v1/conversations/{probe}", self.base))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let mut permissions: Vec<Value> = (1..rules)
            .map(|i| json!({"tool": "bash", "input": {"command": format!("never-{i} *")}, "action": "deny"}))
            .collect();
        permissions.push(json!({"tool": "*", "action": "allow"}));
        let name = format!("bench-{}", std::process::id());
        let made = self
            .http
            .post(format!("{}/v1/agents", self.base))
            .json(
                &json!({"name": name, "model": conversation["model"], "permissions": permissions}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(made.status(), 201, "the bench's agent is made");
        self.create_body = json!({ "agent": name });
    }

    /// With `BENCH_WEBHOOK=1` (and `BEDROCK_EGRESS__ALLOW='["127.0.0.1"]'` for the server),
    /// an endpoint on a receiver here is subscribed to `turn.completed`: the cost of a
    /// subscribed tenant's turns (issue 39), and whether deliveries keep up. Returns the
    /// receiver's count.
    async fn use_webhook(&self) -> Option<std::sync::Arc<std::sync::atomic::AtomicUsize>> {
        if std::env::var("BENCH_WEBHOOK").ok().as_deref() != Some("1") {
            return None;
        }
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = count.clone();
        let router = axum::Router::new().route(
            "/hook",
            axum::routing::post(move || {
                let counted = counted.clone();
                async move {
                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    "ok"
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        let made = self
            .http
            .post(format!("{}/v1/webhooks", self.base))
            .json(&json!({"url": format!("http://{addr}/hook"), "events": ["turn.completed"]}))
            .send()
            .await
            .unwrap();
        assert_eq!(
            made.status(),
            201,
            "the bench's webhook is made (egress allowed?)"
        );
        Some(count)
    }

    async fn create(&self) -> Result<String, String> {
        let response = self
            .http
            .post(format!("{}/v1/conversations", self.base))
            .json(&self.create_body)
            .send()
            .await
            .map_err(|e| format!("create: {e}"))?;
        if response.status() != 201 {
            return Err(format!("create answered {}", response.status()));
        }
        let body: Value = response.json().await.map_err(|e| e.to_string())?;
        body["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| "create: no id".to_owned())
    }

    /// Connects to the conversation's WebSocket and reads its snapshot.
    async fn connect(&self, id: &str) -> Result<Socket, String> {
        let (mut socket, _) =
            tokio_tungstenite::connect_async(format!("{}/v1/conversations/{id}/ws", self.ws_base))
                .await
                .map_err(|e| format!("connect: {e}"))?;
        let first = next_frame(&mut socket).await?;
        if first["type"] != "snapshot" {
            return Err(format!("the first frame is not a snapshot: {first}"));
        }
        Ok(socket)
    }

    /// One turn on a connected conversation: send `text` over REST, wait for the state that
    /// ends the turn, check the answer.
    async fn turn(&self, id: &str, socket: &mut Socket, text: &str) -> Result<(), String> {
        let response = self
            .http
            .post(format!("{}/v1/conversations/{id}/messages", self.base))
            .json(&json!({ "text": text }))
            .send()
            .await
            .map_err(|e| format!("send: {e}"))?;
        if response.status() != 202 {
            return Err(format!("send answered {}", response.status()));
        }
        let sent: Value = response.json().await.map_err(|e| e.to_string())?;
        let message_id = sent["message"]["id"].clone();
        answer(socket, text, |message| message["id"] == message_id).await
    }
}

/// One turn sent over the conversation's WebSocket (a `user_message` frame).
async fn turn_over_socket(socket: &mut Socket, text: &str) -> Result<(), String> {
    let frame = json!({"type": "user_message", "text": text}).to_string();
    socket
        .send(Message::Text(frame.into()))
        .await
        .map_err(|e| format!("send: {e}"))?;
    answer(socket, text, |message| {
        message["message_type"] == "user" && message["content"]["text"] == text
    })
    .await
}

/// What one worker did in the measured window.
#[derive(Default)]
struct Tally {
    latencies: Vec<Duration>,
    errors: Vec<String>,
    /// Turns completed in the whole run, the window's and the others.
    total: u64,
}

impl Tally {
    /// Counts a turn that began at `began` and has just ended with `outcome`.
    fn count(&mut self, outcome: Result<(), String>, began: Instant, window: Window) {
        let ended = Instant::now();
        match outcome {
            Ok(()) => {
                self.total += 1;
                if began >= window.start && ended < window.stop {
                    self.latencies.push(ended - began);
                }
            }
            Err(e) => self.errors.push(e),
        }
    }
}

/// One worker: turns back to back until `stop`; turns that end inside the window
/// `[start, stop)` are counted.
async fn worker(
    client: std::sync::Arc<Client>,
    mode: Mode,
    n: usize,
    window: Window,
    turns_per_conversation: usize,
) -> Tally {
    let mut tally = Tally::default();
    let mut kept: Option<(String, Socket)> = None;
    for k in 0usize.. {
        if turns_per_conversation > 0
            && k % turns_per_conversation == 0
            && let Some((_, mut socket)) = kept.take()
        {
            let _ = socket.close(None).await;
        }
        let began = Instant::now();
        if began >= window.stop {
            break;
        }
        let text = format!("worker {n} turn {k}");
        let outcome = async {
            match mode {
                Mode::Reused => {
                    if kept.is_none() {
                        let id = client.create().await?;
                        let socket = client.connect(&id).await?;
                        kept = Some((id, socket));
                    }
                    let (id, socket) = kept.as_mut().ok_or("no conversation")?;
                    client.turn(id, socket, &text).await
                }
                Mode::New => {
                    let id = client.create().await?;
                    let mut socket = client.connect(&id).await?;
                    client.turn(&id, &mut socket, &text).await?;
                    let _ = socket.close(None).await;
                    Ok(())
                }
                Mode::Scale => Err("scale runs its own workers".to_owned()),
            }
        }
        .await;
        if outcome.is_err() {
            kept = None;
        }
        tally.count(outcome, began, window);
    }
    if let Some((_, mut socket)) = kept {
        let _ = socket.close(None).await;
    }
    tally
}

#[derive(Clone, Copy)]
struct Window {
    start: Instant,
    stop: Instant,
}

/// Runs the workers; prints `start` when the measured window opens and `stop` when it
/// closes (the conductor reads the server's CPU at both), then one JSON line of results.
fn load() {
    bedrock::install_crypto();
    let arg = |name: &str| std::env::var(name).unwrap();
    let base = arg("E2E_BASE");
    let mode = Mode::parse(&arg("E2E_MODE")).unwrap();
    let workers: usize = arg("E2E_WORKERS").parse().unwrap();
    let warmup = Duration::from_millis(arg("E2E_WARMUP_MS").parse().unwrap());
    let measure = Duration::from_millis(arg("E2E_MEASURE_MS").parse().unwrap());
    let turns_per_conversation: usize = arg("E2E_TURNS_PER_CONVERSATION").parse().unwrap();
    runtime().block_on(async move {
        let mut client = Client {
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(workers * 2)
                .tcp_nodelay(true)
                .build()
                .unwrap(),
            ws_base: base.replacen("http://", "ws://", 1),
            base,
            create_body: json!({}),
        };
        client.use_agent().await;
        let delivered = client.use_webhook().await;
        let client = std::sync::Arc::new(client);
        let (tasks, told): (Vec<tokio::task::JoinHandle<Tally>>, _) = if mode == Mode::Scale {
            let sockets = connect_all(&client, workers).await;
            let (window, told) = window_after(warmup, measure);
            let tasks = sockets
                .into_iter()
                .enumerate()
                .map(|(n, socket)| {
                    tokio::spawn(scale_worker(
                        client.clone(),
                        socket,
                        n,
                        window,
                        turns_per_conversation,
                    ))
                })
                .collect();
            (tasks, told)
        } else {
            let (window, told) = window_after(warmup, measure);
            let tasks = (0..workers)
                .map(|n| {
                    tokio::spawn(worker(
                        client.clone(),
                        mode,
                        n,
                        window,
                        turns_per_conversation,
                    ))
                })
                .collect();
            (tasks, told)
        };
        let mut all = Tally::default();
        for task in tasks {
            let tally = task.await.unwrap();
            all.latencies.extend(tally.latencies);
            all.errors.extend(tally.errors);
            all.total += tally.total;
        }
        all.latencies.sort();
        // `stop` first: the workers may see the window closed before its timer fires.
        told.await.unwrap();
        if let Some(delivered) = delivered {
            // Every finished turn's event reaches the receiver: how long the rest takes.
            let stopped = Instant::now();
            let total = all.total as usize;
            while delivered.load(std::sync::atomic::Ordering::Relaxed) < total
                && stopped.elapsed() < Duration::from_secs(60)
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            eprintln!(
                "webhooks: {} deliveries of {} turns' turn.completed; the last {} ms after the load stopped",
                delivered.load(std::sync::atomic::Ordering::Relaxed),
                total,
                stopped.elapsed().as_millis()
            );
        }
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!(
            "{}",
            json!({
                "turns": all.latencies.len(),
                "turns_total": all.total,
                "p50_ms": ms(percentile(&all.latencies, 50.0)),
                "p99_ms": ms(percentile(&all.latencies, 99.0)),
                "max_ms": ms(all.latencies.last().copied().unwrap_or_default()),
                "errors": all.errors.len(),
                "first_error": all.errors.first(),
            })
        );
    });
}

/// The measured window after `warmup`; prints `start` and `stop` when it opens and closes
/// (the conductor reads the server's CPU at both), in the task returned.
fn window_after(warmup: Duration, measure: Duration) -> (Window, tokio::task::JoinHandle<()>) {
    let start = Instant::now() + warmup;
    let window = Window {
        start,
        stop: start + measure,
    };
    let told = tokio::spawn(async move {
        tokio::time::sleep_until(window.start.into()).await;
        println!("start");
        tokio::time::sleep_until(window.stop.into()).await;
        println!("stop");
    });
    (window, told)
}

/// Creates `n` conversations and connects a client to each, a few at a time; prints
/// `created` and `connected` when each step is done (the conductor reads the server's RSS).
async fn connect_all(client: &std::sync::Arc<Client>, n: usize) -> Vec<Socket> {
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(32));
    let created = futures::future::join_all((0..n).map(|_| {
        let (client, gate) = (client.clone(), gate.clone());
        async move {
            let _permit = gate.acquire().await.unwrap();
            client.create().await.unwrap()
        }
    }))
    .await;
    println!("created");
    let sockets = futures::future::join_all(created.iter().map(|id| {
        let (client, gate) = (client.clone(), gate.clone());
        async move {
            let _permit = gate.acquire().await.unwrap();
            client.connect(id).await.unwrap()
        }
    }))
    .await;
    println!("connected");
    sockets
}

/// The scale mode's workers start this far apart (2,000 a second), and its warm-up is one
/// second plus twice this per worker: every worker has started and taken a turn or so.
const SCALE_STAGGER: Duration = Duration::from_micros(500);

/// A worker of the scale mode: turns over its WebSocket until the window closes, moving to
/// a new conversation (and client) after `turns_per_conversation` turns like the reused
/// mode, so the histories are as long at 50 conversations as at 10,000.
async fn scale_worker(
    client: std::sync::Arc<Client>,
    mut socket: Socket,
    n: usize,
    window: Window,
    turns_per_conversation: usize,
) -> Tally {
    let mut tally = Tally::default();
    // Started one after another at about the rate the server answers, so the turns of
    // thousands of workers do not come in waves.
    tokio::time::sleep(SCALE_STAGGER * n as u32).await;
    for k in 0usize.. {
        let began = Instant::now();
        if began >= window.stop {
            break;
        }
        let outcome = async {
            if k > 0 && turns_per_conversation > 0 && k % turns_per_conversation == 0 {
                let _ = socket.close(None).await;
                let id = client.create().await?;
                socket = client.connect(&id).await?;
            }
            turn_over_socket(&mut socket, &format!("worker {n} turn {k}")).await
        }
        .await;
        tally.count(outcome, began, window);
    }
    let _ = socket.close(None).await;
    tally
}

// ---------------------------------------------------------------------------------------
// The conductor.

fn this_binary(role: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(ROLE, role);
    cmd
}

/// The process's resident memory, in bytes.
fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|kb| kb.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

struct Row {
    db: &'static str,
    mode: Mode,
    workers: usize,
    turns: u64,
    seconds: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    cpu_per_turn_ms: f64,
    /// The part of it spent in the kernel.
    sys_per_turn_ms: f64,
    rss_mib: f64,
    errors: u64,
    first_error: Value,
    /// Turns completed in the whole run (window or not).
    turns_total: u64,
    /// Scale mode: the server's RSS per conversation created, and per client connected.
    rss_per_conversation_kb: Option<f64>,
    rss_per_client_kb: Option<f64>,
    /// The database's growth over the mode's run, per turn completed in it.
    bytes_per_turn: Option<f64>,
}

fn read_line(out: &mut BufReader<ChildStdout>) -> String {
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    line.trim().to_owned()
}

fn measure(server: &ServerProcess, db: &'static str, mode: Mode, workers: usize) -> Row {
    let measure = seconds();
    let warmup = match mode {
        Mode::Scale => Duration::from_secs(1) + SCALE_STAGGER * 2 * workers as u32,
        Mode::Reused | Mode::New => Duration::from_secs(1),
    };
    let rss_before = rss(server.pid());
    let mut child = this_binary("load")
        .env("E2E_BASE", &server.base)
        .env("E2E_MODE", mode.name())
        .env("E2E_WORKERS", workers.to_string())
        .env("E2E_WARMUP_MS", warmup.as_millis().to_string())
        .env("E2E_MEASURE_MS", measure.as_millis().to_string())
        .env(
            "E2E_TURNS_PER_CONVERSATION",
            turns_per_conversation().to_string(),
        )
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let load = Owned(child);
    let (mut created, mut connected) = (None, None);
    loop {
        match read_line(&mut out).as_str() {
            "created" => created = Some(rss(server.pid())),
            "connected" => connected = Some(rss(server.pid())),
            "start" => break,
            other => panic!("the load generator said {other:?}"),
        }
    }
    let (cpu0, t0) = (cpu_time(server.pid()), Instant::now());
    assert_eq!(read_line(&mut out), "stop");
    let (cpu1, t1) = (cpu_time(server.pid()), Instant::now());
    let rss_now = rss(server.pid());
    let result: Value = serde_json::from_str(&read_line(&mut out)).unwrap();
    drop(load);
    let turns = result["turns"].as_u64().unwrap_or(0);
    let seconds = (t1 - t0).as_secs_f64();
    let per = |bytes: i64| bytes as f64 / 1024.0 / workers.max(1) as f64;
    Row {
        db,
        mode,
        workers,
        turns,
        seconds,
        p50_ms: result["p50_ms"].as_f64().unwrap_or(0.0),
        p99_ms: result["p99_ms"].as_f64().unwrap_or(0.0),
        max_ms: result["max_ms"].as_f64().unwrap_or(0.0),
        cpu_per_turn_ms: ((cpu1.0 + cpu1.1) - (cpu0.0 + cpu0.1)).as_secs_f64() * 1000.0
            / turns.max(1) as f64,
        sys_per_turn_ms: (cpu1.1 - cpu0.1).as_secs_f64() * 1000.0 / turns.max(1) as f64,
        rss_mib: rss_now as f64 / (1024.0 * 1024.0),
        errors: result["errors"].as_u64().unwrap_or(0),
        first_error: result["first_error"].clone(),
        turns_total: result["turns_total"].as_u64().unwrap_or(0),
        rss_per_conversation_kb: created.map(|c| per(c as i64 - rss_before as i64)),
        rss_per_client_kb: created
            .zip(connected)
            .map(|(c, k)| per(k as i64 - c as i64)),
        bytes_per_turn: None,
    }
}

/// The bytes a database takes once its log is checkpointed (SQLite: the file, its log
/// copied back and emptied first; Postgres: `pg_database_size` after a CHECKPOINT).
fn stored_bytes(db: &BenchDb) -> u64 {
    if db.label == "sqlite" {
        runtime().block_on(async {
            use sea_orm::ConnectionTrait as _;
            if let Ok(conn) = sea_orm::Database::connect(&db.url).await {
                let _ = conn
                    .execute_unprepared("PRAGMA wal_checkpoint(TRUNCATE)")
                    .await;
                let _ = conn.close().await;
            }
        });
        let path = db.url.trim_start_matches("sqlite://");
        let path = path.split('?').next().unwrap_or_default();
        ["", "-wal"]
            .iter()
            .filter_map(|suffix| std::fs::metadata(format!("{path}{suffix}")).ok())
            .map(|m| m.len())
            .sum()
    } else {
        let sql = "SELECT pg_database_size(current_database())::bigint AS n";
        let size = runtime().block_on(common::postgres_number(&db.url, &["CHECKPOINT"], sql));
        size as u64
    }
}

/// Postgres's relations and their sizes when `BENCH_STORED_DETAIL` is set (empty otherwise).
fn relation_sizes(db: &BenchDb) -> Vec<(String, i64)> {
    if db.label == "sqlite" || std::env::var_os("BENCH_STORED_DETAIL").is_none() {
        return Vec::new();
    }
    runtime().block_on(common::postgres_relation_sizes(&db.url, &["CHECKPOINT"]))
}

/// Each relation's growth per turn, largest first (`BENCH_STORED_DETAIL`, Postgres).
fn print_relation_growth(before: &[(String, i64)], after: &[(String, i64)], turns: u64) {
    let mut growth: Vec<(&str, i64)> = after
        .iter()
        .map(|(name, n)| {
            let was = before
                .iter()
                .find(|(b, _)| b == name)
                .map_or(0, |(_, b)| *b);
            (name.as_str(), n - was)
        })
        .filter(|(_, grew)| *grew != 0)
        .collect();
    growth.sort_by_key(|(_, grew)| -grew);
    for (name, grew) in growth {
        println!(
            "  {name}: {:.0} bytes a turn",
            grew as f64 / turns.max(1) as f64
        );
    }
}

/// Turns a reused conversation takes before its worker moves to a new one (0: never).
fn turns_per_conversation() -> usize {
    std::env::var("BENCH_TURNS_PER_CONVERSATION")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(50)
}

fn list<T>(name: &str, default: &str, parse: impl Fn(&str) -> Option<T>) -> Vec<T> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(|item| {
            parse(item.trim()).unwrap_or_else(|| panic!("{name}: {item:?} is not understood"))
        })
        .collect()
}

fn conduct() {
    bedrock::install_crypto();
    let modes = list("BENCH_MODES", "reused,new,scale", Mode::parse);
    let workers = list("BENCH_WORKERS", "1,50", |w| w.parse::<usize>().ok());
    let mut fake = this_binary("fake-llm")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let llm_base = read_line(&mut BufReader::new(fake.stdout.take().unwrap()));
    let _fake = Owned(fake);
    let scale = list("BENCH_SCALE", "1000,5000,10000", |n| {
        n.parse::<usize>().ok()
    });
    let mut rows = Vec::new();
    let labels: Vec<&'static str> = runtime()
        .block_on(BenchDb::all())
        .into_iter()
        .map(|db| {
            let label = db.label;
            runtime().block_on(db.drop_db());
            label
        })
        .collect();
    for label in labels {
        // A fresh database and server for each mode, and for each size of the scale mode, so
        // its bytes per turn and its memory are its own.
        let runs = modes.iter().flat_map(|&mode| match mode {
            Mode::Scale => scale.iter().map(|&n| (mode, vec![n])).collect::<Vec<_>>(),
            Mode::Reused | Mode::New => vec![(mode, workers.clone())],
        });
        for (mode, sizes) in runs {
            let db = runtime()
                .block_on(BenchDb::all())
                .into_iter()
                .find(|db| db.label == label)
                .unwrap();
            let workspace =
                std::env::temp_dir().join(format!("bedrock-e2e-{}", uuid::Uuid::now_v7().simple()));
            let server = ServerProcess::start(&db.url, &llm_base, &workspace, &[]);
            let empty = stored_bytes(&db);
            let relations_before = relation_sizes(&db);
            let first = rows.len();
            for n in sizes {
                let row = measure(&server, db.label, mode, n);
                print_row(&row);
                rows.push(row);
            }
            server.stop();
            let _ = std::fs::remove_dir_all(&workspace);
            let turns: u64 = rows[first..].iter().map(|r| r.turns_total).sum();
            let bytes = stored_bytes(&db).saturating_sub(empty);
            println!(
                "{label} {}: {bytes} bytes stored for {turns} turns: {:.0} bytes a turn",
                mode.name(),
                bytes as f64 / turns.max(1) as f64
            );
            print_relation_growth(&relations_before, &relation_sizes(&db), turns);
            for row in &mut rows[first..] {
                row.bytes_per_turn = Some(bytes as f64 / turns.max(1) as f64);
            }
            runtime().block_on(db.drop_db());
        }
    }
    let json: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "db": r.db,
                "mode": r.mode.name(),
                "workers": r.workers,
                "turns": r.turns,
                "turns_per_s": r.turns as f64 / r.seconds,
                "p50_ms": r.p50_ms,
                "p99_ms": r.p99_ms,
                "max_ms": r.max_ms,
                "server_cpu_per_turn_ms": r.cpu_per_turn_ms,
                "server_sys_per_turn_ms": r.sys_per_turn_ms,
                "server_rss_mib": r.rss_mib,
                "rss_per_conversation_kb": r.rss_per_conversation_kb,
                "rss_per_client_kb": r.rss_per_client_kb,
                "bytes_per_turn": r.bytes_per_turn,
                "errors": r.errors,
            })
        })
        .collect();
    println!(
        "{}",
        json!({"bench": "e2e", "turns_per_conversation": turns_per_conversation(), "seconds": seconds().as_secs(), "rows": json})
    );
}

fn print_row(row: &Row) {
    static HEADER: std::sync::Once = std::sync::Once::new();
    HEADER.call_once(|| {
        println!(
            "reused conversations take {} turns each (BENCH_TURNS_PER_CONVERSATION; 0 = no limit)",
            turns_per_conversation()
        );
        println!(
            "| db | conversations | workers | turns/s | p50 | p99 | max | server CPU/turn (kernel) | server RSS | RSS per conversation / client | errors |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
    });
    let per = match (row.rss_per_conversation_kb, row.rss_per_client_kb) {
        (Some(conversation), Some(client)) => format!("{conversation:.1} / {client:.1} KB"),
        _ => "-".to_owned(),
    };
    println!(
        "| {} | {} | {} | {:.0} | {:.2} ms | {:.2} ms | {:.2} ms | {:.3} ms ({:.3}) | {:.1} MiB | {per} | {} |",
        row.db,
        row.mode.name(),
        row.workers,
        row.turns as f64 / row.seconds,
        row.p50_ms,
        row.p99_ms,
        row.max_ms,
        row.cpu_per_turn_ms,
        row.sys_per_turn_ms,
        row.rss_mib,
        row.errors,
    );
    if row.errors > 0 {
        eprintln!("first error: {}", row.first_error);
    }
}
