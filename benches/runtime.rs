//! Runtime figures (the runtime issue):
//! - turns per second and orchestration overhead per turn, 50 concurrent conversations, a
//!   zero-latency fake LLM, one tool call per turn, durable persistence;
//! - cancel latency (cancel call to the stored Idle frame) with a CPU-bound tool running and
//!   1,000 other conversations active;
//! - interrupt-and-send latency (the interrupting send to the new turn's LLM request) with a
//!   tool running;
//! - how many conversations run concurrently, with a fake LLM of 200 ms, before the overhead
//!   doubles;
//! - memory per idle activated conversation.
//!
//!     cargo bench --bench runtime            (BENCH_SECONDS=5 by default)

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bedrock::model::{NewConversation, Tenant};
use bedrock::persistence::WriteJob;
use bedrock::runtime::{Runtime, UserMessage};
use bedrock::state_machine::IfBusy;
use bedrock::testkit::{FakeLlm, Reply};
use common::{BenchDb, heap_held_by, ms, percentile, rss_bytes, seconds};
use serde_json::{Value, json};

struct Bench {
    runtime: Runtime,
    llm: FakeLlm,
    tenant: String,
    workspace: std::path::PathBuf,
}

async fn start(db: &BenchDb) -> Bench {
    let llm = FakeLlm::start().await;
    llm.forget_requests();
    llm.time_requests();
    let workspace = std::env::temp_dir().join(format!(
        "bedrock-bench-ws-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&workspace).unwrap();
    let runtime = common::start_runtime(
        [
            ("BEDROCK_DATABASE_URL".into(), db.url.clone()),
            ("BEDROCK_LLM_BASE_URL".into(), llm.base_url.clone()),
            ("BEDROCK_LLM_API_KEY".into(), "k".into()),
            (
                "BEDROCK_WORKSPACE_ROOT".into(),
                workspace.display().to_string(),
            ),
            ("BEDROCK_LLM__MAX_CONCURRENCY".into(), "4096".into()),
            (
                "BEDROCK_CONVERSATIONS__IDLE_TIMEOUT_MS".into(),
                "3600000".into(),
            ),
            ("BEDROCK_DATABASE__MAX_CONNECTIONS".into(), "16".into()),
        ],
        16,
        Duration::from_secs(30),
    )
    .await;
    let tenant = uuid::Uuid::now_v7().to_string();
    runtime
        .persistence
        .write(WriteJob::EnsureTenant {
            tenant: Tenant {
                id: tenant.clone(),
                name: tenant.clone(),
            },
            at: chrono::Utc::now(),
        })
        .await
        .unwrap();
    Bench {
        runtime,
        llm,
        tenant,
        workspace,
    }
}

impl Bench {
    async fn conversations(&self, n: usize) -> Vec<String> {
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let id = uuid::Uuid::now_v7().to_string();
            self.runtime
                .persistence
                .write(WriteJob::CreateConversation(NewConversation::user(
                    &id,
                    &self.tenant,
                    self.workspace.display().to_string(),
                    "fake",
                    chrono::Utc::now(),
                )))
                .await
                .unwrap();
            ids.push(id);
        }
        ids
    }
}

/// One turn's timings: from the frames a client sees, and the fake LLM's own time.
#[derive(Clone, Copy, Debug, Default)]
struct Turn {
    total: Duration,
    /// From each `llm_requesting` frame to the stored answer's frame.
    llm: Duration,
    /// From the `tool_executing` frame to the stored result's frame.
    tool: Duration,
    /// What the fake LLM itself took over the turn's requests (latency included).
    served: Duration,
}

impl Turn {
    /// Orchestration overhead: the turn minus the LLM's own time. Everything else is the
    /// service's: the gateway's HTTP client, the commits, the actors, the `think` tool.
    fn overhead(self) -> Duration {
        self.total.saturating_sub(self.served)
    }

    /// The measure of earlier runs: the turn minus its LLM and tool phases as a client sees
    /// them, which count the gateway's work and the commit of each answer and result as LLM
    /// and tool time.
    fn overhead_outside_phases(self) -> Duration {
        self.total.saturating_sub(self.llm + self.tool)
    }
}

/// The message every turn of conversation `id` sends: the fake LLM times requests by their
/// first user message, so each conversation's is its own.
fn prompt(id: &str) -> String {
    format!("go {id}")
}

/// Sends a message and follows the frames until the conversation is idle again.
async fn turn(bench: &Bench, id: &str, frames: &mut bedrock::hub::Subscription) -> Turn {
    let runtime = &bench.runtime;
    let live = runtime.conversations.get_or_start(id).await.unwrap();
    let started = Instant::now();
    let sent = live
        .send(
            user_message(prompt(id), IfBusy::Reject),
            Duration::from_secs(60),
        )
        .await;
    assert!(matches!(sent, Ok(Ok(_))), "{sent:?}");
    let mut timing = Turn::default();
    let mut phase: Option<(Instant, bool)> = None;
    loop {
        let frame = frames.recv().await.unwrap();
        if frame.kind != "state" && frame.kind != "message" {
            continue;
        }
        let value: Value = serde_json::from_str(&frame.json).unwrap();
        let now = Instant::now();
        match (
            frame.kind.as_str(),
            value["state"]["kind"].as_str(),
            value["message"]["message_type"].as_str(),
        ) {
            ("state", Some("llm_requesting"), _) => phase = Some((now, true)),
            ("state", Some("tool_executing"), _) => phase = Some((now, false)),
            ("message", _, Some("agent" | "tool")) => {
                if let Some((since, llm)) = phase.take() {
                    if llm {
                        timing.llm += now - since
                    } else {
                        timing.tool += now - since
                    }
                }
            }
            ("state", Some("idle"), _) => break,
            _ => {}
        }
    }
    timing.total = started.elapsed();
    timing
}

/// Turns a bench conversation runs before a fresh one takes its place: a request then carries
/// at most this many turns of history (four messages each), however long the run, so runs of
/// different lengths and loads measure the same work.
const TURNS_PER_CONVERSATION: usize = 50;

/// Runs `n` new conversations doing turns back to back for `duration`, their first turns
/// spread evenly over `stagger`.
async fn load(
    bench: &Arc<Bench>,
    n: usize,
    duration: Duration,
    stagger: Duration,
) -> (f64, Vec<Turn>) {
    let first = bench.conversations(n).await;
    paced(
        bench,
        first,
        duration,
        None,
        stagger,
        TURNS_PER_CONVERSATION,
    )
    .await
}

/// Runs the conversations `first` for `duration`, each starting a turn every `every` (and at
/// once when its last turn ran late), or back to back when `every` is `None`. Their first
/// turns start spread evenly over `stagger`. Each runs `turns_each` turns, then a fresh one
/// takes its place.
async fn paced(
    bench: &Arc<Bench>,
    first: Vec<String>,
    duration: Duration,
    every: Option<Duration>,
    stagger: Duration,
    turns_each: usize,
) -> (f64, Vec<Turn>) {
    let n = first.len();
    let deadline = Instant::now() + duration;
    let _ = bench.llm.take_request_times();
    let mut tasks = Vec::new();
    for (i, first) in first.into_iter().enumerate() {
        let bench = bench.clone();
        let offset = stagger * i as u32 / n as u32;
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            if !offset.is_zero() {
                tokio::time::sleep(offset).await;
            }
            let mut next = tokio::time::Instant::now();
            // The first conversations run fewer turns, each its own number, so that the
            // conversations are replaced one at a time rather than all at once.
            let mut fresh = Some(first);
            let mut limit = turns_each - turns_each / n * i;
            while Instant::now() < deadline {
                let id = match fresh.take() {
                    Some(id) => id,
                    None => bench.conversations(1).await.remove(0),
                };
                let mut frames = bench.runtime.hub.subscribe(&id);
                let mut turns = Vec::new();
                while turns.len() < limit && Instant::now() < deadline {
                    if let Some(every) = every {
                        tokio::time::sleep_until(next).await;
                        next = (next + every).max(tokio::time::Instant::now());
                    }
                    turns.push(turn(&bench, &id, &mut frames).await);
                }
                done.push((id, turns));
                limit = turns_each;
            }
            done
        }));
    }
    let started = Instant::now();
    let mut done = Vec::new();
    for task in tasks {
        done.extend(task.await.unwrap());
    }
    let rate = done.iter().map(|(_, turns)| turns.len()).sum::<usize>() as f64
        / started.elapsed().as_secs_f64();
    (rate, with_served(bench, done))
}

/// The turns of each conversation with the fake LLM's own time in each, from the times it
/// took since they were last taken: a turn is two requests, and a conversation's turns run
/// one after another.
fn with_served(bench: &Bench, done: Vec<(String, Vec<Turn>)>) -> Vec<Turn> {
    let mut times = bench.llm.take_request_times();
    let mut all = Vec::new();
    for (id, mut turns) in done {
        let served = times.remove(&prompt(&id)).unwrap_or_default();
        assert_eq!(served.len(), 2 * turns.len(), "two LLM requests a turn");
        for (turn, pair) in turns.iter_mut().zip(served.chunks(2)) {
            turn.served = pair.iter().sum();
        }
        all.extend(turns);
    }
    all
}

fn summary(turns: &[Turn], f: impl Fn(&Turn) -> Duration) -> (Duration, Duration) {
    let mut values: Vec<Duration> = turns.iter().map(f).collect();
    values.sort();
    (percentile(&values, 50.0), percentile(&values, 99.0))
}

/// Prints a load's rate, turn time and overhead on one line.
fn report(label: &str, rate: f64, turns: &[Turn]) {
    let (total50, total99) = summary(turns, |t| t.total);
    let (over50, over99) = summary(turns, |t| t.overhead());
    let (outside50, outside99) = summary(turns, |t| t.overhead_outside_phases());
    println!(
        "{label}: {rate:.0} turns/s, turn time p50 {} p99 {}, overhead p50 {} p99 {} (outside the phases: p50 {} p99 {})",
        ms(total50),
        ms(total99),
        ms(over50),
        ms(over99),
        ms(outside50),
        ms(outside99)
    );
}

const OFFERED: &str = "50 conversations offered 1,000 turns/s";

/// After a warm-up, 50 conversations doing turns back to back, then 50 fresh ones offered
/// 1,000 turns/s in all (one turn every 50 ms each): the overhead at the target rate, short
/// of saturation.
async fn fifty(bench: &Arc<Bench>, duration: Duration) -> [(f64, Vec<Turn>); 2] {
    let warm_up = duration.min(Duration::from_secs(1));
    let _ = load(bench, 50, warm_up, Duration::ZERO).await;
    let back_to_back = load(bench, 50, duration, Duration::ZERO).await;
    let every = Duration::from_millis(50);
    // A second at the offered rate, not counted: the saturating load before it leaves work
    // behind (the database's and the kernel's write-back) that is not this load's.
    let first = bench.conversations(50).await;
    let settle = duration.min(Duration::from_secs(1));
    let _ = paced(
        bench,
        first,
        settle,
        Some(every),
        every,
        TURNS_PER_CONVERSATION,
    )
    .await;
    let first = bench.conversations(50).await;
    let offered = paced(
        bench,
        first,
        duration,
        Some(every),
        every,
        TURNS_PER_CONVERSATION,
    )
    .await;
    [back_to_back, offered]
}

/// Cancels measured per load: enough that p99 is not one late cancel (with 100 it was the
/// second-slowest).
const CANCELS: usize = 400;

/// Starts a CPU-bound tool `n` times and cancels it; the time from the cancel call to the
/// stored Idle frame, sorted.
async fn cancel_latency(bench: &Bench, target: &str, n: usize) -> Vec<Duration> {
    let runtime = &bench.runtime;
    let live = runtime.conversations.get_or_start(target).await.unwrap();
    let mut frames = runtime.hub.subscribe(target);
    let mut latencies = Vec::with_capacity(n);
    for _ in 0..n {
        let sent = live
            .send(
                user_message("spin".into(), IfBusy::Reject),
                Duration::from_secs(60),
            )
            .await;
        assert!(matches!(sent, Ok(Ok(_))));
        loop {
            let frame = frames.recv().await.unwrap();
            if frame.kind == "state" && frame.json.contains("tool_executing") {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await; // let the tool spin
        let started = Instant::now();
        let answer = live.cancel_turn();
        loop {
            let frame = frames.recv().await.unwrap();
            if frame.kind == "state" && frame.json.contains("\"idle\"") {
                break;
            }
        }
        latencies.push(started.elapsed());
        answer.await.unwrap();
    }
    latencies.sort();
    latencies
}

/// Interrupts measured: as many as cancels.
const INTERRUPTS: usize = CANCELS;

/// Runs a turn whose tool sleeps, `n` times in a row, each interrupted by the next message
/// (`if_busy=interrupt`); the time from the interrupting send to the arrival of the new
/// turn's first LLM request at the fake LLM, sorted.
async fn interrupt_latency(bench: &Bench, n: usize) -> Vec<Duration> {
    let runtime = &bench.runtime;
    let target = bench.conversations(1).await.remove(0);
    // Every request of the conversation (routed by its first message) asks for a sleep.
    let key = "sleep, to be interrupted";
    bench.llm.route(
        key,
        std::iter::repeat_n(Reply::bash("sleeper", "sleep 600"), n + 10),
    );
    let live = runtime.conversations.get_or_start(&target).await.unwrap();
    let mut frames = runtime.hub.subscribe(&target);
    bench.llm.record_arrivals();
    let mut latencies = Vec::with_capacity(n);
    for i in 0..=n {
        let (text, if_busy) = if i == 0 {
            (key.to_owned(), IfBusy::Reject)
        } else {
            let running = live.cancel.running_turn();
            (format!("instead {i}"), IfBusy::Interrupt { running })
        };
        let _ = bench.llm.take_arrivals();
        let started = Instant::now();
        let sent = live
            .send(user_message(text, if_busy), Duration::from_secs(60))
            .await;
        assert!(matches!(sent, Ok(Ok(_))), "{sent:?}");
        let arrived = loop {
            if let Some(at) = bench
                .llm
                .take_arrivals()
                .remove(key)
                .and_then(|at| at.first().copied())
            {
                break at;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        };
        if i > 0 {
            latencies.push(arrived.saturating_duration_since(started));
        }
        loop {
            let frame = frames.recv().await.unwrap();
            if frame.kind == "state" && frame.json.contains("tool_executing") {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await; // let the tool start
    }
    let answer = live.cancel_turn();
    answer.await.unwrap();
    latencies.sort();
    latencies
}

#[tokio::main]
async fn main() {
    bedrock::install_crypto();
    let duration = seconds();
    for db in BenchDb::all().await {
        let bench = Arc::new(start(&db).await);
        println!("\n# runtime on {}", db.label);

        // Throughput and overhead: 50 conversations, zero-latency LLM, one tool call a turn.
        bench
            .llm
            .auto_tool_turns("think", json!({"thoughts": "one tool call per turn"}));
        let only = std::env::var("BENCH_ONLY").unwrap_or_default();
        // `load`: the two 50-conversation measures alone, a line each (for quick A/B runs).
        if only == "load" {
            let [(rate, turns), (paced_rate, paced_turns)] = fifty(&bench, duration).await;
            report("50 conversations back to back", rate, &turns);
            report(OFFERED, paced_rate, &paced_turns);
            finish(bench, db).await;
            continue;
        }
        // `concurrency`: the 200 ms LLM's sweep alone.
        if only == "concurrency" {
            concurrency(&bench, duration).await;
            finish(bench, db).await;
            continue;
        }
        // `memory` and `cancel` skip the turns (their conversations are still created).
        if only != "memory" && only != "cancel" {
            let [(rate, turns), (paced_rate, paced_turns)] = fifty(&bench, duration).await;
            let (total50, total99) = summary(&turns, |t| t.total);
            let (served50, served99) = summary(&turns, |t| t.served);
            let (over50, over99) = summary(&turns, |t| t.overhead());
            let (llm50, _) = summary(&turns, |t| t.llm);
            let (outside50, outside99) = summary(&turns, |t| t.overhead_outside_phases());
            println!("| measure | p50 | p99 |");
            println!("|---|---|---|");
            println!(
                "| turn time (50 concurrent, zero-latency LLM, 1 tool call) | {} | {} |",
                ms(total50),
                ms(total99)
            );
            println!(
                "| the fake LLM's own time in a turn (2 requests) | {} | {} |",
                ms(served50),
                ms(served99)
            );
            println!(
                "| orchestration overhead (turn - the LLM's own time) | {} | {} |",
                ms(over50),
                ms(over99)
            );
            println!(
                "| LLM phases as a client sees them (2 requests, each through its commit) | {} | - |",
                ms(llm50)
            );
            println!(
                "| turn - LLM phases - tool phase (the earlier measure) | {} | {} |",
                ms(outside50),
                ms(outside99)
            );
            println!("turns/s with 50 concurrent conversations: {rate:.0}");
            report(OFFERED, paced_rate, &paced_turns);
            // The same turn with nothing else running: the latency a turn adds, unqueued.
            let (rate, turns) = load(&bench, 1, duration, Duration::ZERO).await;
            report("one conversation alone", rate, &turns);
            // What history costs: one conversation alone, 1,000 turns (4,000 messages) into
            // its life, so that every request carries all of them.
            let id = bench.conversations(1).await.remove(0);
            let mut frames = bench.runtime.hub.subscribe(&id);
            for _ in 0..1000 {
                turn(&bench, &id, &mut frames).await;
            }
            drop(frames);
            let (rate, turns) =
                paced(&bench, vec![id], duration, None, Duration::ZERO, usize::MAX).await;
            report(
                "one conversation alone, 1,000 turns into its history",
                rate,
                &turns,
            );
        }

        if only == "turns" {
            finish(bench, db).await;
            continue;
        }
        // Memory per idle activated conversation.
        let idle = bench.conversations(5000).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = rss_bytes();
        let ((), held) = heap_held_by(async {
            for id in &idle {
                bench.runtime.conversations.get_or_start(id).await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        })
        .await;
        let after = rss_bytes();
        println!(
            "memory per idle activated conversation: {:.1} KB ({} activated, RSS {} -> {} MB; Rust heap held {:.1} KB each)",
            (after.saturating_sub(before)) as f64 / idle.len() as f64 / 1024.0,
            idle.len(),
            before / 1_048_576,
            after / 1_048_576,
            held as f64 / idle.len() as f64 / 1024.0,
        );
        if only == "memory" {
            // Everything activated is still held: a heap profiler's view at exit is theirs.
            std::process::exit(0);
        }

        // Cancel latency: a CPU-bound tool running, with the activated conversations above
        // (over 1,000) around it; then again while 50 of them also run turns back to back.
        let target = bench.conversations(1).await.remove(0);
        bench.llm.route(
            "spin",
            std::iter::repeat_n(
                Reply::bash("spin", "while :; do :; done"),
                2 * CANCELS + 100,
            ),
        );
        let quiet = cancel_latency(&bench, &target, CANCELS).await;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut background = Vec::new();
        for id in bench.conversations(50).await {
            let (bench, mut stop) = (bench.clone(), stop_rx.clone());
            background.push(tokio::spawn(async move {
                let mut frames = bench.runtime.hub.subscribe(&id);
                while !*stop.borrow_and_update() {
                    turn(&bench, &id, &mut frames).await;
                }
            }));
        }
        let loaded = cancel_latency(&bench, &target, CANCELS).await;
        let _ = stop_tx.send(true);
        for task in background {
            let _ = task.await;
        }
        let active = bench.runtime.conversations.count();
        println!(
            "cancel latency (cancel call to the Idle frame, CPU-bound tool running, {active} conversations activated): p50 {} p99 {}",
            ms(percentile(&quiet, 50.0)),
            ms(percentile(&quiet, 99.0))
        );
        println!(
            "cancel latency, as above while 50 conversations run turns back to back: p50 {} p99 {}",
            ms(percentile(&loaded, 50.0)),
            ms(percentile(&loaded, 99.0))
        );
        let interrupts = interrupt_latency(&bench, INTERRUPTS).await;
        println!(
            "interrupt-and-send latency (the interrupting send to the new turn's LLM request, a sleeping tool running): p50 {} p99 {}",
            ms(percentile(&interrupts, 50.0)),
            ms(percentile(&interrupts, 99.0))
        );
        if only == "cancel" {
            finish(bench, db).await;
            continue;
        }

        // The sandbox's cost per tool run: `true` through bash, unconfined and confined.
        let cwd =
            std::env::temp_dir().join(format!("bedrock-bench-sandbox-{}", std::process::id()));
        std::fs::create_dir_all(&cwd).unwrap();
        let confined = bench.runtime.tool_limits.bash(Duration::from_secs(30));
        let mut unconfined = confined.clone();
        unconfined.sandbox = None;
        for (what, limits) in [("unconfined", &unconfined), ("sandboxed", &confined)] {
            let mut samples = Vec::new();
            for _ in 0..200 {
                let started = Instant::now();
                // Opened at each run, as a tool run opens its conversation's directory.
                let pinned = bedrock::workspace::Pinned::trusted(&cwd).unwrap();
                let outcome =
                    bedrock::tools::run_bash("true", &pinned, limits, Default::default(), None)
                        .await;
                assert!(outcome.ok(), "{outcome:?}");
                samples.push(started.elapsed());
            }
            samples.sort();
            println!(
                "bash tool run of `true`, {what}: p50 {} p99 {}",
                ms(percentile(&samples, 50.0)),
                ms(percentile(&samples, 99.0))
            );
        }
        let _ = std::fs::remove_dir_all(&cwd);

        concurrency(&bench, duration).await;
        finish(bench, db).await;
    }
}

/// A 200 ms LLM: how many conversations run at once before the overhead per turn doubles
/// (from its value at 50). Each load's first turns start spread over one turn's LLM time, as
/// independent clients would, not all in the same instant: started together, conversations
/// with a fixed LLM latency stay in step, and every turn's commits queue behind the others'.
async fn concurrency(bench: &Arc<Bench>, duration: Duration) {
    let latency = Duration::from_millis(200);
    bench.llm.latency(latency);
    println!("| concurrent conversations (200 ms LLM) | turns/s | overhead p50 | overhead p99 |");
    println!("|---|---|---|---|");
    let mut baseline = None;
    for n in [50usize, 100, 200, 400, 800, 1600] {
        let (rate, turns) = load(bench, n, duration.max(Duration::from_secs(3)), 2 * latency).await;
        let (over50, over99) = summary(&turns, |t| t.overhead());
        println!("| {n} | {rate:.0} | {} | {} |", ms(over50), ms(over99));
        let base = *baseline.get_or_insert(over50);
        if over50 >= base * 2 {
            println!(
                "overhead doubled (from {} at 50) at {n} concurrent conversations",
                ms(base)
            );
            break;
        }
    }
    bench.llm.latency(Duration::ZERO);
}

/// Stops the server, removes its workspace and drops the bench's database.
async fn finish(bench: Arc<Bench>, db: BenchDb) {
    let bench = Arc::try_unwrap(bench).ok().unwrap();
    bench.runtime.shutdown(Duration::from_secs(10)).await;
    let _ = std::fs::remove_dir_all(&bench.workspace);
    db.drop_db().await;
}

/// A text message for [`bedrock::runtime::Live::send`].
fn user_message(text: String, if_busy: IfBusy) -> UserMessage {
    UserMessage {
        text,
        images: vec![],
        client_message_id: None,
        if_busy,
    }
}
