//! Transitions committed per second for 1 and 100 concurrent conversations, on SQLite and on
//! Postgres (where BEDROCK_TEST_DATABASE_URL is set), with commit latency percentiles.
//! Synchronous commit is on (SQLite: WAL with synchronous=FULL; Postgres: its default).
//!
//!     cargo bench --bench persistence

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bedrock::metrics::Metrics;
use bedrock::model::{NewConversation, Tenant};
use bedrock::persistence::{Persistence, PersistenceActor, WriteJob};
use bedrock::runtime::{apply_commit, plan_commit};
use bedrock::state_machine::{ConvContext, Event, IfBusy, TurnId, TurnLimits, transition};
use bedrock::store::{Store, StoreOptions};
use common::{BenchDb, ms, percentile, seconds};
use ractor::Actor;

/// Run before each measurement and left out of it.
const WARM_UP: Duration = Duration::from_secs(1);

/// `rate`: transitions per second per conversation (`None`: back to back, saturated).
async fn run(
    db: &BenchDb,
    concurrency: usize,
    duration: Duration,
    rate: Option<f64>,
) -> (f64, Duration, Duration) {
    let store = Store::connect(&StoreOptions {
        url: db.url.clone(),
        max_connections: 8,
        acquire_timeout: Duration::from_secs(10),
    })
    .await
    .unwrap();
    store.migrate().await.unwrap();
    let metrics = Arc::new(Metrics::default());
    let (actor, _) = Actor::spawn(None, PersistenceActor, (store.clone(), metrics.clone()))
        .await
        .unwrap();
    let persistence = Persistence::new(actor.clone(), Duration::from_secs(30));
    let tenant = Tenant {
        id: uuid::Uuid::now_v7().to_string(),
        name: format!("bench-{}", uuid::Uuid::now_v7().simple()),
    };
    persistence
        .write(WriteJob::EnsureTenant {
            tenant: tenant.clone(),
            at: chrono::Utc::now(),
        })
        .await
        .unwrap();
    let mut tasks = Vec::new();
    // The first second warms the pool's connections and caches up; it is not measured.
    let measured_from = Instant::now() + WARM_UP;
    let deadline = measured_from + duration;
    for _ in 0..concurrency {
        let id = uuid::Uuid::now_v7().to_string();
        persistence
            .write(WriteJob::CreateConversation(NewConversation::user(
                &id,
                &tenant.id,
                "/tmp",
                "m",
                chrono::Utc::now(),
            )))
            .await
            .unwrap();
        let mut record = store.conversation_by_id(&id).await.unwrap().unwrap();
        let persistence = persistence.clone();
        tasks.push(tokio::spawn(async move {
            let ctx = ConvContext {
                conversation_id: id.clone(),
                working_dir: "/tmp".into(),
                model_id: "m".into(),
                is_sub_agent: false,
                limits: TurnLimits::default(),
                context_window: 128_000,
                context_tokens: 0,
                continuation_permille: 0,
                require_approval: Vec::new(),
                mcp_tools: Vec::new(),
                tools: None,
                permissions: Vec::new(),
                client_tools: Vec::new(),
            };
            let mut latencies = Vec::new();
            let mut n = 0u64;
            let start = Instant::now();
            // Spread the conversations' phases so an offered load is smooth.
            let period = rate.map(|r| Duration::from_secs_f64(1.0 / r));
            if let Some(period) = period {
                tokio::time::sleep(period.mul_f64(rand_fraction(&id))).await;
            }
            let start = if period.is_some() { Instant::now() } else { start };
            while Instant::now() < deadline {
                if let Some(period) = period {
                    let due = start + period * n as u32;
                    tokio::time::sleep_until(due.into()).await;
                }
                // Alternate a user message (state + message + two frames) and a cancel
                // (state + one frame): what real transitions write.
                let event = if n.is_multiple_of(2) {
                    Event::UserMessage {
                        turn: TurnId::new(format!("t{n}")),
                        text: "a user message of a realistic length, about a hundred bytes or so, for the benchmark".into(),
                        images: vec![],
                        if_busy: IfBusy::Reject,
                    }
                } else {
                    Event::UserCancel
                };
                n += 1;
                let result = transition(&record.state, &ctx, event).unwrap();
                let plan = plan_commit(
                    &bedrock::wire::Frames,
                    &record,
                    result,
                    128_000,
                    chrono::Utc::now(),
                    None,
                );
                let commit = plan.commit.unwrap();
                let started = Instant::now();
                persistence.commit(commit.clone()).await.unwrap();
                if started >= measured_from {
                    latencies.push(started.elapsed());
                }
                apply_commit(&mut record, &commit);
            }
            latencies
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    let elapsed = measured_from.elapsed().max(duration);
    all.sort();
    if std::env::var("BENCH_VERBOSE").is_ok() {
        let text = metrics.encode();
        let value = |name: &str| -> f64 {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                .unwrap_or(0.0)
        };
        let flushes = value("bedrock_commit_latency_seconds_count");
        println!(
            "  flushes {flushes}, mean flush {:.2} ms, mean batch {:.1}",
            value("bedrock_commit_latency_seconds_sum") / flushes * 1000.0,
            value("bedrock_commit_batch_size_sum") / flushes
        );
    }
    actor.stop(None);
    let _ = store.close().await;
    (
        all.len() as f64 / elapsed.as_secs_f64(),
        percentile(&all, 50.0),
        percentile(&all, 99.0),
    )
}

/// A fraction in [0, 1) derived from an id, to spread start times.
fn rand_fraction(id: &str) -> f64 {
    let hash = id
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    (hash % 1000) as f64 / 1000.0
}

#[tokio::main]
async fn main() {
    bedrock::install_crypto();
    let duration = seconds();
    println!(
        "# persistence: transitions committed per second (group commit, synchronous commit on)"
    );
    println!("| backend | conversations | load | transitions/s | commit p50 | commit p99 |");
    println!("|---|---|---|---|---|---|");
    for db in BenchDb::all().await {
        for concurrency in [1, 100] {
            let (rate, p50, p99) = run(&db, concurrency, duration, None).await;
            let label = db.label;
            println!(
                "| {label} | {concurrency} | saturated | {rate:.0} | {} | {} |",
                ms(p50),
                ms(p99)
            );
        }
        // 100 conversations offering 5,000 transitions/s together (50/s each).
        let (rate, p50, p99) = run(&db, 100, duration, Some(50.0)).await;
        let label = db.label;
        println!(
            "| {label} | 100 | offered 5,000/s | {rate:.0} | {} | {} |",
            ms(p50),
            ms(p99)
        );
        db.drop_db().await;
    }
}
