//! Cluster figures (issue 22): several `bedrock serve` processes on one Postgres, driven over
//! real HTTP and WebSocket like a load balancer would spread clients over them.
//!
//! - Throughput with 1, 2 and 3 nodes (`BENCH_NODES`): `BENCH_WORKERS` workers (default 50)
//!   each keep a conversation created on one node, follow it on the WebSocket of the next,
//!   and send each turn through the nodes in turn (with three nodes, two sends in three are
//!   carried to the owner and every frame reaches the client from another node). Each turn
//!   is one `think` call and an answer; and again "sticky" (a client's socket and sends on
//!   its conversation's node, as behind a load balancer with affinity). Printed: turns/s,
//!   turn latency p50/p99, the nodes' CPU per turn (all together) and the database's
//!   transactions per turn.
//! - Forwarded against local commands, three nodes: a send and a cancel of the running tool,
//!   through the owner or through another node, `BENCH_TRIALS` times each (default 30).
//!   Printed: the round trips' p50/p99 (a cancel answers once the conversation is idle).
//! - Failover, three nodes, 10 trials (`BENCH_FAILOVERS`): the owner of a conversation with
//!   a tool running is killed (SIGKILL, its own pid); the time until the client on another
//!   node gets the first frame from the new owner. The lease TTL is the server's (default
//!   5 s; `BEDROCK_CLUSTER__LEASE_TTL_MS` and the other `BEDROCK_*` settings reach the nodes).
//!
//! Run (BENCH_SECONDS=5 by default):
//!
//! ```text
//! BEDROCK_TEST_DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo bench --bench cluster
//! ```
//!
//! Postgres only (a cluster needs it): without BEDROCK_TEST_DATABASE_URL it says so and
//! stops. The fake LLM and the load run in this process; each node is its own process.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bedrock::testkit::{FakeLlm, Reply};
use common::live::{ServerProcess, Socket, answer, cpu_time, next_frame};
use common::{BenchDb, percentile, seconds};
use serde_json::{Value, json};

fn main() {
    bedrock::install_crypto();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(conduct());
}

/// Nodes on one fresh database with one shared workspace directory.
struct Nodes {
    db: BenchDb,
    workspace: PathBuf,
    llm_base: String,
    nodes: Vec<ServerProcess>,
}

impl Nodes {
    async fn start(n: usize, llm: &FakeLlm) -> Result<Nodes, String> {
        let db = BenchDb::postgres().await.ok_or("no Postgres")?;
        let workspace = std::env::temp_dir().join(format!(
            "bedrock-cluster-bench-{}",
            uuid::Uuid::now_v7().simple()
        ));
        let mut nodes = Nodes {
            db,
            workspace,
            llm_base: llm.base_url.clone(),
            nodes: Vec::new(),
        };
        for i in 0..n {
            let node = nodes.node(i);
            nodes.nodes.push(node);
        }
        Ok(nodes)
    }

    /// Node `i` (its id is `n<i>`), started.
    fn node(&self, i: usize) -> ServerProcess {
        ServerProcess::start(
            &self.db.url,
            &self.llm_base,
            &self.workspace,
            &[("BEDROCK_CLUSTER__NODE_ID", format!("n{i}"))],
        )
    }

    async fn end(self) {
        for node in self.nodes {
            node.stop();
        }
        let _ = std::fs::remove_dir_all(&self.workspace);
        self.db.drop_db().await;
    }
}

fn ws_base(base: &str) -> String {
    base.replacen("http://", "ws://", 1)
}

async fn create(http: &reqwest::Client, base: &str) -> Result<String, String> {
    let body: Value = http
        .post(format!("{base}/v1/conversations"))
        .json(&json!({}))
        .send()
        .await
        .map_err(|e| format!("create: {e}"))?
        .json()
        .await
        .map_err(|e| format!("create: {e}"))?;
    body["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("create: {body}"))
}

/// The conversation's WebSocket on the node at `base`, its snapshot read.
async fn connect(base: &str, id: &str) -> Result<Socket, String> {
    let url = format!("{}/v1/conversations/{id}/ws", ws_base(base));
    let (mut socket, _) = tokio_tungstenite::connect_async(url)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let first = next_frame(&mut socket).await?;
    if first["type"] != "snapshot" {
        return Err(format!("the first frame is not a snapshot: {first}"));
    }
    Ok(socket)
}

/// POSTs a command and returns its status and how long the round trip took.
async fn command(
    http: &reqwest::Client,
    url: String,
    body: Value,
) -> Result<(u16, Duration), String> {
    let began = Instant::now();
    let response = http
        .post(url)
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let _ = response.bytes().await;
    Ok((status, began.elapsed()))
}

/// Frames until one is the state `kind`.
async fn until_state(socket: &mut Socket, kind: &str) -> Result<Value, String> {
    loop {
        let frame = next_frame(socket).await?;
        if frame["type"] == "state" && frame["state"]["kind"] == kind {
            return Ok(frame);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Throughput.

struct Throughput {
    nodes: usize,
    /// Each client on one node (its conversation's), not spread over them.
    sticky: bool,
    /// The nodes' CPU, all of them together.
    cpu_per_turn: Duration,
    /// The database's transactions (statements outside one count as one each).
    transactions_per_turn: f64,
    turns: usize,
    seconds: f64,
    p50: Duration,
    p99: Duration,
    errors: usize,
    first_error: Option<String>,
}

/// One worker: a conversation created on one node, followed on the next, its turns sent
/// through each node in turn; the turns that end inside `[start, stop)` are timed.
async fn worker(
    http: reqwest::Client,
    bases: Vec<String>,
    w: usize,
    sticky: bool,
    start: Instant,
    stop: Instant,
) -> (Vec<Duration>, Vec<String>) {
    let n = bases.len();
    // Spread: the socket on the next node, each send through the next again. Sticky: all on
    // the conversation's node.
    let spread = usize::from(!sticky);
    let (mut times, mut errors) = (Vec::new(), Vec::new());
    let mut kept: Option<(String, Socket)> = None;
    for k in w.. {
        let began = Instant::now();
        if began >= stop {
            break;
        }
        let text = format!("worker {w} turn {k}");
        let outcome = async {
            if kept.is_none() {
                let id = create(&http, &bases[w % n]).await?;
                let socket = connect(&bases[(w + spread) % n], &id).await?;
                kept = Some((id, socket));
            }
            let (id, socket) = kept.as_mut().ok_or("no conversation")?;
            let url = format!(
                "{}/v1/conversations/{id}/messages",
                bases[(w + k * spread) % n]
            );
            let response = http
                .post(url)
                .json(&json!({ "text": text }))
                .send()
                .await
                .map_err(|e| format!("send: {e}"))?;
            if response.status() != 202 {
                return Err(format!("send answered {}", response.status()));
            }
            let sent: Value = response.json().await.map_err(|e| e.to_string())?;
            let message_id = sent["message"]["id"].clone();
            answer(socket, &text, |m| m["id"] == message_id).await
        }
        .await;
        let ended = Instant::now();
        match outcome {
            Ok(()) if began >= start && ended < stop => times.push(ended - began),
            Ok(()) => {}
            Err(error) => {
                errors.push(error);
                kept = None;
            }
        }
    }
    (times, errors)
}

async fn throughput(n: usize, workers: usize, sticky: bool) -> Result<Throughput, String> {
    let llm = FakeLlm::start().await;
    llm.forget_requests();
    llm.auto_tool_turns("think", json!({"thoughts": "one tool call per turn"}));
    let nodes = Nodes::start(n, &llm).await?;
    let bases: Vec<String> = nodes.nodes.iter().map(|s| s.base.clone()).collect();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(workers * 2)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let start = Instant::now() + Duration::from_secs(2);
    let stop = start + seconds();
    let tasks: Vec<_> = (0..workers)
        .map(|w| tokio::spawn(worker(http.clone(), bases.clone(), w, sticky, start, stop)))
        .collect();
    // The nodes' CPU and the database's transactions over the window.
    let pids: Vec<u32> = nodes.nodes.iter().map(ServerProcess::pid).collect();
    let cpu = || -> Duration {
        pids.iter()
            .map(|&pid| {
                let (user, system) = cpu_time(pid);
                user + system
            })
            .sum()
    };
    tokio::time::sleep_until(start.into()).await;
    let (cpu0, xacts0) = (cpu(), transactions(&nodes.db.url).await);
    tokio::time::sleep_until(stop.into()).await;
    let (cpu1, xacts1) = (cpu(), transactions(&nodes.db.url).await);
    let (mut times, mut errors) = (Vec::new(), Vec::new());
    for task in tasks {
        let (t, e) = task.await.unwrap();
        times.extend(t);
        errors.extend(e);
    }
    times.sort();
    nodes.end().await;
    Ok(Throughput {
        nodes: n,
        sticky,
        cpu_per_turn: (cpu1 - cpu0) / times.len().max(1) as u32,
        transactions_per_turn: (xacts1 - xacts0) as f64 / times.len().max(1) as f64,
        turns: times.len(),
        seconds: (stop - start).as_secs_f64(),
        p50: percentile(&times, 50.0),
        p99: percentile(&times, 99.0),
        errors: errors.len(),
        first_error: errors.into_iter().next(),
    })
}

/// The transactions committed in the database at `url` so far.
async fn transactions(url: &str) -> i64 {
    let sql = "SELECT xact_commit AS n FROM pg_stat_database WHERE datname = current_database()";
    common::postgres_number(url, &[], sql).await
}

// ---------------------------------------------------------------------------------------
// Forwarded and local commands.

#[derive(Default)]
struct Latencies {
    local_send: Vec<Duration>,
    forwarded_send: Vec<Duration>,
    local_cancel: Vec<Duration>,
    forwarded_cancel: Vec<Duration>,
}

/// Sends (each starting a long tool) and cancels, through the owner and through another
/// node in turn.
async fn commands(trials: usize) -> Result<Latencies, String> {
    let llm = FakeLlm::start().await;
    llm.forget_requests();
    llm.fallback(Reply::bash("call_sleep", "sleep 30"));
    let nodes = Nodes::start(3, &llm).await?;
    let (owner, other) = (&nodes.nodes[0].base, &nodes.nodes[1].base);
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let id = create(&http, owner).await?;
    let mut socket = connect(owner, &id).await?;
    let mut latencies = Latencies::default();
    // Two rounds first, not counted: the nodes' first connections to each other.
    for t in 0..trials * 2 + 2 {
        let forwarded = t % 2 == 1;
        let via = if forwarded { other } else { owner };
        let (status, sent) = command(
            &http,
            format!("{via}/v1/conversations/{id}/messages"),
            json!({"text": format!("trial {t}")}),
        )
        .await?;
        assert_eq!(status, 202, "a send");
        until_state(&mut socket, "tool_executing").await?;
        let (status, cancelled) = command(
            &http,
            format!("{via}/v1/conversations/{id}/cancel"),
            json!({}),
        )
        .await?;
        assert_eq!(status, 202, "a cancel");
        until_state(&mut socket, "idle").await?;
        if t < 2 {
            continue;
        }
        let (send, cancel) = if forwarded {
            (
                &mut latencies.forwarded_send,
                &mut latencies.forwarded_cancel,
            )
        } else {
            (&mut latencies.local_send, &mut latencies.local_cancel)
        };
        send.push(sent);
        cancel.push(cancelled);
    }
    nodes.end().await;
    for samples in [
        &mut latencies.local_send,
        &mut latencies.forwarded_send,
        &mut latencies.local_cancel,
        &mut latencies.forwarded_cancel,
    ] {
        samples.sort();
    }
    Ok(latencies)
}

// ---------------------------------------------------------------------------------------
// Failover.

/// Each trial: a conversation whose tool runs on node 0, followed from node 1; node 0 is
/// killed, and the time until node 1's client gets a frame from the new owner is taken.
/// Node 0 then comes back (under the same id) for the next trial.
async fn failover(trials: usize) -> Result<Vec<Duration>, String> {
    let llm = FakeLlm::start().await;
    llm.forget_requests();
    llm.fallback(Reply::bash("call_sleep", "sleep 20"));
    let mut nodes = Nodes::start(3, &llm).await?;
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let mut times = Vec::new();
    for _ in 0..trials {
        let (victim, watcher) = (nodes.nodes[0].base.clone(), nodes.nodes[1].base.clone());
        let id = create(&http, &victim).await?;
        let mut socket = connect(&watcher, &id).await?;
        let (status, _) = command(
            &http,
            format!("{victim}/v1/conversations/{id}/messages"),
            json!({"text": "a long job"}),
        )
        .await?;
        assert_eq!(status, 202);
        until_state(&mut socket, "tool_executing").await?;
        let killed = Instant::now();
        nodes.nodes.remove(0).kill();
        // The first frame after the kill is the new owner's repair of the turn.
        next_frame(&mut socket).await?;
        times.push(killed.elapsed());
        until_state(&mut socket, "idle").await?;
        let back = nodes.node(0);
        nodes.nodes.insert(0, back);
    }
    nodes.end().await;
    times.sort();
    Ok(times)
}

// ---------------------------------------------------------------------------------------

fn routing(row: &Throughput) -> &'static str {
    match (row.nodes, row.sticky) {
        (1, _) => "-",
        (_, true) => "sticky",
        (_, false) => "spread",
    }
}

fn env_list(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(|n| n.trim().parse().unwrap())
        .collect()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn conduct() {
    let Some(probe) = BenchDb::postgres().await else {
        println!(
            "SKIPPED: the cluster bench needs Postgres; set BEDROCK_TEST_DATABASE_URL (e.g. postgres://postgres@127.0.0.1:5432/postgres)"
        );
        return;
    };
    probe.drop_db().await;
    let workers = env_list("BENCH_WORKERS", "50")[0];
    let trials = env_list("BENCH_TRIALS", "30")[0];
    let failovers = env_list("BENCH_FAILOVERS", "10")[0];
    let mut rows = Vec::new();
    println!(
        "| nodes | routing | workers | turns/s | p50 | p99 | nodes' CPU/turn | db transactions/turn | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let runs = env_list("BENCH_NODES", "1,2,3").into_iter().flat_map(|n| {
        if n == 1 {
            vec![(n, false)]
        } else {
            vec![(n, false), (n, true)]
        }
    });
    for (n, sticky) in runs {
        let row = throughput(n, workers, sticky)
            .await
            .expect("the throughput run");
        println!(
            "| {} | {} | {workers} | {:.0} | {:.2} ms | {:.2} ms | {:.3} ms | {:.1} | {} |",
            row.nodes,
            routing(&row),
            row.turns as f64 / row.seconds,
            ms(row.p50),
            ms(row.p99),
            ms(row.cpu_per_turn),
            row.transactions_per_turn,
            row.errors
        );
        if let Some(error) = &row.first_error {
            eprintln!("first error: {error}");
        }
        rows.push(row);
    }
    let latencies = commands(trials).await.expect("the command latencies");
    println!("| command (3 nodes, {trials} each) | p50 | p99 | max |");
    println!("|---|---|---|---|");
    let figures = |samples: &[Duration]| {
        (
            ms(percentile(samples, 50.0)),
            ms(percentile(samples, 99.0)),
            ms(samples.last().copied().unwrap_or_default()),
        )
    };
    let mut commands = Vec::new();
    for (name, samples) in [
        ("send, local", &latencies.local_send),
        ("send, forwarded", &latencies.forwarded_send),
        ("cancel, local", &latencies.local_cancel),
        ("cancel, forwarded", &latencies.forwarded_cancel),
    ] {
        let (p50, p99, max) = figures(samples);
        println!("| {name} | {p50:.2} ms | {p99:.2} ms | {max:.2} ms |");
        commands.push(json!({"command": name, "p50_ms": p50, "p99_ms": p99, "max_ms": max}));
    }
    let failover = failover(failovers).await.expect("the failover trials");
    let (p50, p99, max) = figures(&failover);
    println!(
        "failover (kill -9 of the owner to the new owner's first frame, {failovers} trials): p50 {p50:.0} ms, p99 {p99:.0} ms, max {max:.0} ms"
    );
    let single = rows
        .iter()
        .find(|r| r.nodes == 1)
        .map(|r| r.turns as f64 / r.seconds);
    let json_rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "nodes": r.nodes,
                "routing": routing(r),
                "turns_per_s": r.turns as f64 / r.seconds,
                "of_one_node": single.map(|s| r.turns as f64 / r.seconds / s),
                "p50_ms": ms(r.p50),
                "p99_ms": ms(r.p99),
                "nodes_cpu_per_turn_ms": ms(r.cpu_per_turn),
                "db_transactions_per_turn": r.transactions_per_turn,
                "errors": r.errors,
            })
        })
        .collect();
    println!(
        "{}",
        json!({
            "bench": "cluster",
            "workers": workers,
            "seconds": seconds().as_secs(),
            "throughput": json_rows,
            "commands": commands,
            "failover_ms": {"p50": p50, "p99": p99, "max": max, "trials": failovers},
        })
    );
}
