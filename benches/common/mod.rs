//! Shared benchmark helpers: databases, percentiles, an output table.

#![allow(dead_code, clippy::print_stdout, clippy::print_stderr)]

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use sea_orm::{ConnectionTrait, Database};

pub mod live;

/// Quotas out of the way: these benchmarks measure one tenant driving the whole node (its
/// quotas would cap it; the tenancy bench measures them). Settings may override them.
pub const OPEN_QUOTAS: [(&str, &str); 10] = [
    ("BEDROCK_QUOTAS__SCHEDULES", "1000000"),
    ("BEDROCK_QUOTAS__WEBHOOKS", "1000"),
    ("BEDROCK_QUOTAS__CONVERSATIONS", "1000000000"),
    ("BEDROCK_QUOTAS__CONCURRENT_TURNS", "1000000"),
    ("BEDROCK_QUOTAS__TOOL_PROCESSES", "4096"),
    ("BEDROCK_QUOTAS__BACKGROUND_TASKS", "4096"),
    ("BEDROCK_QUOTAS__STREAMS", "1000000"),
    ("BEDROCK_QUOTAS__MCP_SERVERS", "1000"),
    ("BEDROCK_QUOTAS__LLM_CONCURRENCY", "4096"),
    ("BEDROCK_QUOTAS__WORKSPACE_BYTES", "1000000000000000"),
];

/// An in-process runtime on `settings` (over [`OPEN_QUOTAS`]), its database migrated, with
/// a pool of `max_connections` that waits `acquire_timeout` for one.
pub async fn start_runtime(
    settings: impl IntoIterator<Item = (String, String)>,
    max_connections: u32,
    acquire_timeout: Duration,
) -> bedrock::runtime::Runtime {
    let mut env: Vec<(String, String)> = OPEN_QUOTAS
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    env.extend(settings);
    let settings = std::sync::Arc::new(bedrock::config::Settings::load_from(None, env).unwrap());
    let store = bedrock::store::Store::connect(&bedrock::store::StoreOptions {
        url: settings.database_url(),
        max_connections,
        acquire_timeout,
    })
    .await
    .unwrap();
    store.migrate().await.unwrap();
    let (runtime, _) = bedrock::runtime::Runtime::start(
        settings,
        store,
        std::sync::Arc::new(bedrock::wire::Frames),
    )
    .await
    .unwrap();
    runtime
}

/// The server's allocator (src/main.rs), so the figures are the server's; it can also
/// count the bytes Rust code holds (SQLite allocates outside it).
#[global_allocator]
static ALLOCATOR: Counting = Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static HELD: AtomicI64 = AtomicI64::new(0);

pub struct Counting;

// SAFETY: every call is passed on unchanged to mimalloc; the counters only observe sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as i64);
        // SAFETY: the caller's contract, passed on.
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as i64));
        // SAFETY: the caller's contract, passed on.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as i64);
        // SAFETY: the caller's contract, passed on.
        unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        count(new as i64 - layout.size() as i64);
        // SAFETY: the caller's contract, passed on.
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new) }
    }
}

fn count(bytes: i64) {
    if COUNTING.load(Ordering::Relaxed) {
        HELD.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Counts the bytes Rust code allocates and frees while `f` runs; what is still held after.
pub async fn heap_held_by<F: Future>(f: F) -> (F::Output, i64) {
    HELD.store(0, Ordering::Relaxed);
    COUNTING.store(true, Ordering::Relaxed);
    let out = f.await;
    COUNTING.store(false, Ordering::Relaxed);
    (out, HELD.load(Ordering::Relaxed))
}

/// A database to benchmark on; dropped at the end.
#[derive(Debug)]
pub struct BenchDb {
    pub label: &'static str,
    pub url: String,
    admin: Option<(String, String)>,
    dir: Option<std::path::PathBuf>,
}

impl BenchDb {
    pub fn sqlite() -> BenchDb {
        let dir =
            std::env::temp_dir().join(format!("bedrock-bench-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        BenchDb {
            label: "sqlite",
            url: format!("sqlite://{}?mode=rwc", dir.join("bench.db").display()),
            admin: None,
            dir: Some(dir),
        }
    }

    /// A fresh Postgres database when BEDROCK_TEST_DATABASE_URL names a server.
    pub async fn postgres() -> Option<BenchDb> {
        let admin = std::env::var("BEDROCK_TEST_DATABASE_URL")
            .ok()
            .filter(|u| !u.is_empty())?;
        let conn = Database::connect(&admin).await.ok()?;
        let name = format!("bedrock_bench_{}", uuid::Uuid::now_v7().simple());
        conn.execute_unprepared(&format!("CREATE DATABASE {name}"))
            .await
            .ok()?;
        let base = &admin[..admin.rfind('/')?];
        Some(BenchDb {
            label: "postgres",
            url: format!("{base}/{name}"),
            admin: Some((admin, name)),
            dir: None,
        })
    }

    /// SQLite, then Postgres where there is one; `BENCH_DB=sqlite` or `BENCH_DB=postgres`
    /// keeps only that one.
    pub async fn all() -> Vec<BenchDb> {
        let only = std::env::var("BENCH_DB").unwrap_or_default();
        let mut all = Vec::new();
        if only != "postgres" {
            all.push(BenchDb::sqlite());
        }
        if only != "sqlite" {
            all.extend(BenchDb::postgres().await);
        }
        all
    }

    /// Drops the database, unless `BENCH_KEEP_DB` is set (then says where it is).
    pub async fn drop_db(self) {
        if std::env::var_os("BENCH_KEEP_DB").is_some() {
            eprintln!("kept the {} database: {}", self.label, self.url);
            return;
        }
        if let Some((admin, name)) = &self.admin
            && let Ok(conn) = Database::connect(admin).await
        {
            let _ = conn
                .execute_unprepared(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .await;
        }
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A number read from the Postgres database at `url` (`sql` selects one bigint `AS n`), after
/// running the statements of `first`.
pub async fn postgres_number(url: &str, first: &[&str], sql: &str) -> i64 {
    let conn = Database::connect(url).await.expect("the database answers");
    for statement in first {
        let _ = conn.execute_unprepared(statement).await;
    }
    let row = conn
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            sql,
        ))
        .await
        .expect("the statement runs")
        .expect("a row");
    let n: i64 = row.try_get("", "n").expect("a number named n");
    let _ = conn.close().await;
    n
}

/// Each relation of the database's `public` schema with its size in bytes (tables, their
/// indexes and their TOAST tables apart), after the statements in `first`.
pub async fn postgres_relation_sizes(url: &str, first: &[&str]) -> Vec<(String, i64)> {
    let conn = Database::connect(url).await.expect("the database answers");
    for statement in first {
        let _ = conn.execute_unprepared(statement).await;
    }
    let rows = conn
        .query_all_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            "SELECT c.relname::text AS name, pg_relation_size(c.oid)::bigint AS n \
             FROM pg_class c WHERE c.relkind IN ('r', 'i', 't') \
             AND (c.relnamespace = 'public'::regnamespace OR c.relname IN \
               (SELECT 'pg_toast_' || t.oid::text FROM pg_class t \
                WHERE t.relnamespace = 'public'::regnamespace)) \
             ORDER BY 1",
        ))
        .await
        .expect("the statement runs");
    let _ = conn.close().await;
    rows.iter()
        .map(|row| {
            let name: String = row.try_get("", "name").expect("a name");
            let n: i64 = row.try_get("", "n").expect("a size");
            (name, n)
        })
        .collect()
}

/// The `p`-th percentile (0..=100) of sorted samples.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

pub fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// How long each measurement runs (BENCH_SECONDS, default 5).
pub fn seconds() -> Duration {
    Duration::from_secs(
        std::env::var("BENCH_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(5),
    )
}

/// Resident memory of this process in bytes.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}
