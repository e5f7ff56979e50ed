//! Schedules at scale (issue 39): `BENCH_SCHEDULES` (10,000 by default) agent schedules of
//! `every: 1m` on one node (the release `bedrock serve`, SQLite by default or
//! `BENCH_DB=postgres` with BEDROCK_TEST_DATABASE_URL), each firing a new conversation and a
//! one-answer turn from the fake LLM (in this process). After `BENCH_MINUTES` (1 by default)
//! of firings plus a minute's margin, every schedule's runs are read: each firing's lag (its
//! work's start minus its fire time) as p50, p99 and max, the firings per second, how many
//! started, failed or were skipped, and the server's CPU per firing.
//!
//!     cargo bench --bench schedules

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::live::{ServerProcess, cpu_time};
use common::{BenchDb, percentile};
use serde_json::{Value, json};

fn main() {
    bedrock::install_crypto();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run());
}

async fn run() {
    let count: usize = std::env::var("BENCH_SCHEDULES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10_000);
    let minutes: u64 = std::env::var("BENCH_MINUTES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    let db = match std::env::var("BENCH_DB").as_deref() {
        Ok("postgres") => BenchDb::postgres()
            .await
            .expect("BEDROCK_TEST_DATABASE_URL"),
        _ => BenchDb::sqlite(),
    };
    let llm = bedrock::testkit::FakeLlm::start().await;
    llm.fallback(bedrock::testkit::Reply::text("the report"));
    let workspace = std::env::temp_dir().join(format!(
        "bedrock-schedules-{}",
        uuid::Uuid::now_v7().simple()
    ));
    let server = ServerProcess::start(&db.url, &llm.base_url, &workspace, &[]);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .unwrap();
    let base = server.base.clone();
    let made = http
        .post(format!("{base}/v1/agents"))
        .json(&json!({"name": "reporter", "model": "fake-model"}))
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), 201);
    let started = Instant::now();
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(32));
    let ids: Vec<String> = futures::future::join_all((0..count).map(|_| {
        let (http, base, gate) = (http.clone(), base.clone(), gate.clone());
        async move {
            let _permit = gate.acquire().await.unwrap();
            let made: Value = http
                .post(format!("{base}/v1/schedules"))
                .json(&json!({"agent": "reporter", "message": "report", "every": "1m"}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            made["id"].as_str().expect("a schedule").to_owned()
        }
    }))
    .await;
    println!(
        "{count} schedules made in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let (user0, sys0) = cpu_time(server.pid());
    let wait = Duration::from_secs(60 * minutes + 45);
    println!("firing for {} s", wait.as_secs());
    tokio::time::sleep(wait).await;
    let (user1, sys1) = cpu_time(server.pid());
    let runs: Vec<Vec<Value>> = futures::future::join_all(ids.iter().map(|id| {
        let (http, base, gate) = (http.clone(), base.clone(), gate.clone());
        async move {
            let _permit = gate.acquire().await.unwrap();
            let page: Value = http
                .get(format!("{base}/v1/schedules/{id}/runs"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            page["runs"].as_array().cloned().unwrap_or_default()
        }
    }))
    .await;
    let time = |v: &Value| {
        chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap_or_default())
            .map(|t| t.timestamp_millis())
            .ok()
    };
    let mut lags = Vec::new();
    let (mut started_n, mut failed, mut skipped, mut other) = (0, 0, 0, 0);
    for run in runs.iter().flatten() {
        match run["status"].as_str() {
            Some("started") => {
                started_n += 1;
                if let (Some(fire), Some(at)) = (time(&run["fire_at"]), time(&run["started_at"])) {
                    lags.push(Duration::from_millis(u64::try_from(at - fire).unwrap_or(0)));
                }
            }
            Some("failed") => failed += 1,
            Some("skipped") => skipped += 1,
            _ => other += 1,
        }
    }
    lags.sort();
    let firings = started_n + failed + skipped;
    let cpu = (user1 + sys1).saturating_sub(user0 + sys0);
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "| db | schedules | firings | started | failed | skipped | unfinished | lag p50 | lag p99 | lag max | firings/s | server CPU per firing |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {count} | {firings} | {started_n} | {failed} | {skipped} | {other} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} | {:.2} ms |",
        db.label,
        ms(percentile(&lags, 50.0)),
        ms(percentile(&lags, 99.0)),
        ms(lags.last().copied().unwrap_or_default()),
        firings as f64 / wait.as_secs_f64(),
        ms(cpu) / firings.max(1) as f64,
    );
    println!(
        "{}",
        json!({"bench": "schedules", "db": db.label, "schedules": count, "firings": firings,
            "started": started_n, "failed": failed, "skipped": skipped,
            "lag_p50_ms": ms(percentile(&lags, 50.0)), "lag_p99_ms": ms(percentile(&lags, 99.0)),
            "lag_max_ms": ms(lags.last().copied().unwrap_or_default()),
            "server_cpu_per_firing_ms": ms(cpu) / firings.max(1) as f64})
    );
    server.stop();
    let _ = std::fs::remove_dir_all(&workspace);
    db.drop_db().await;
}
