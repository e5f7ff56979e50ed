//! What one turn costs, counted rather than timed (issue 41): wall-clock figures move by a
//! fifth from run to run on these machines and more between machines, so they cannot gate a
//! change; instruction and system-call counts can.
//!
//! The workload: one-tool turns (the fake LLM asks for one `think` call, then answers)
//! through the real actors, the gateway's HTTP client and the persistence actor on SQLite, one
//! turn at a time (so that the group commit batches the same way in every run), in-process on
//! a current-thread runtime; the scripted fake LLM runs in a process of its own and is not
//! counted. It runs twice, with `SMALL` and with `LARGE` conversations of `TURNS` turns each,
//! and the difference divided by the difference in turns is the cost of one turn, start-up
//! and shutdown cancelled out:
//! - instructions, under `valgrind --tool=callgrind` (the same count for the same binary and
//!   inputs, whatever else the machine is doing);
//! - system calls (`strace -f -c`), without the ones that only say how threads waited for
//!   each other (futex, epoll waits, sched_yield), and the fsyncs among them; each size runs
//!   three times and the run with the fewest counts (what the moment adds only adds).
//!
//! Run:
//!
//!     cargo bench --bench turncost                     (compares with the baseline)
//!     TURNCOST_UPDATE=1 cargo bench --bench turncost   (writes the baseline)
//!
//! The baseline is benches/turncost.json. The run fails (exit 1) when a turn costs more than
//! `TOLERANCE` over it in instructions or in system calls, printing both figures; .ci/run
//! runs it. A change that buys a feature with cost updates the baseline in the same commit
//! and says why.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use bedrock::model::{NewConversation, Tenant};
use bedrock::persistence::WriteJob;
use bedrock::runtime::UserMessage;
use bedrock::state_machine::IfBusy;
use common::live::Owned;
use serde_json::{Value, json};

const ROLE: &str = "BEDROCK_TURNCOST_ROLE";
/// Turns per conversation.
const TURNS: usize = 5;
const SMALL: usize = 4;
const LARGE: usize = 24;
/// How much more a turn may cost than the baseline.
const TOLERANCE: f64 = 0.10;
/// Runs under strace per size; the one with the fewest system calls counts.
const SYSCALL_TRIES: usize = 3;
/// System calls that count how threads waited, not what a turn did: their number follows
/// the scheduling of the moment.
const WAITING: [&str; 8] = [
    "futex",
    "epoll_wait",
    "epoll_pwait",
    "epoll_pwait2",
    "sched_yield",
    "nanosleep",
    "clock_nanosleep",
    "restart_syscall",
];

fn main() {
    match std::env::var(ROLE).as_deref() {
        Ok("fake-llm") => common::live::serve_fake_llm_and(true),
        Ok("workload") => workload(),
        _ => conduct(),
    }
}

// ---------------------------------------------------------------------------------------
// The fake LLM process, and a webhook receiver that answers every delivery with a 200
// (common::live).

// ---------------------------------------------------------------------------------------
// The workload: `TURNCOST_CONVERSATIONS` conversations of `TURNS` turns, one turn at a time.

fn workload() {
    bedrock::install_crypto();
    // Logs as a node writes them (JSON, the default filter), to nowhere: formatting a turn's
    // lines and spans is part of its cost, the write to stderr is not counted.
    {
        use tracing_subscriber::layer::SubscriberExt as _;
        use tracing_subscriber::util::SubscriberInitExt as _;
        tracing_subscriber::registry()
            .with(bedrock::telemetry::filter())
            .with(bedrock::telemetry::log_layer(true, std::io::sink))
            .init();
    }
    let conversations: usize = std::env::var("TURNCOST_CONVERSATIONS")
        .unwrap()
        .parse()
        .unwrap();
    let llm = std::env::var("TURNCOST_LLM").unwrap();
    let dir = PathBuf::from(std::env::var("TURNCOST_DIR").unwrap());
    // The variant with a subscribed endpoint (`turn.completed`, on the receiver).
    let hook = std::env::var("TURNCOST_HOOK").ok();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async move {
            let workspace = dir.join("ws");
            std::fs::create_dir_all(&workspace).unwrap();
            let runtime = common::start_runtime(
                [
                    (
                        "BEDROCK_DATABASE_URL".into(),
                        format!("sqlite://{}?mode=rwc", dir.join("bedrock.db").display()),
                    ),
                    (
                        "BEDROCK_DATA_DIR".into(),
                        dir.join("data").display().to_string(),
                    ),
                    ("BEDROCK_LLM_BASE_URL".into(), llm),
                    ("BEDROCK_LLM_API_KEY".into(), "k".into()),
                    (
                        "BEDROCK_WORKSPACE_ROOT".into(),
                        workspace.display().to_string(),
                    ),
                    (
                        "BEDROCK_CONVERSATIONS__IDLE_TIMEOUT_MS".into(),
                        "3600000".into(),
                    ),
                    // valgrind knows no Landlock system calls; the `think` tool runs no process.
                    ("BEDROCK_SANDBOX__MODE".into(), "off".into()),
                    // The receiver is on loopback. The dispatcher's idle poll is a cost of
                    // time, not of turns: it is left out (a turn's end wakes it).
                    ("BEDROCK_EGRESS__ALLOW".into(), r#"["127.0.0.1"]"#.into()),
                    ("BEDROCK_WEBHOOKS__POLL_MS".into(), "3600000".into()),
                ],
                4,
                Duration::from_secs(60),
            )
            .await;
            let services = &runtime;
            let tenant = "turncost".to_owned();
            services
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
            let hook_id = format!("wh_{}", uuid::Uuid::now_v7().simple());
            if let Some(url) = &hook {
                let now = chrono::Utc::now().timestamp_millis();
                services
                    .persistence
                    .write(WriteJob::CreateWebhook(Box::new(bedrock::model::Webhook {
                        id: hook_id.clone(),
                        tenant_id: tenant.clone(),
                        url: url.clone(),
                        events: vec![bedrock::webhooks::TURN_COMPLETED.into()],
                        description: None,
                        enabled: true,
                        disabled_reason: None,
                        secret: bedrock::webhooks::new_secret().into(),
                        previous_secret: None,
                        previous_secret_until: None,
                        failing_since: None,
                        created_at: now,
                        updated_at: now,
                    })))
                    .await
                    .unwrap();
                services.webhooks.refresh(&services.store).await.unwrap();
            }
            for n in 0..conversations {
                let id = uuid::Uuid::now_v7().to_string();
                services
                    .persistence
                    .write(WriteJob::CreateConversation(NewConversation::user(
                        &id,
                        &tenant,
                        workspace.display().to_string(),
                        "fake",
                        chrono::Utc::now(),
                    )))
                    .await
                    .unwrap();
                let mut frames = services.hub.subscribe(&id);
                for turn in 0..TURNS {
                    let live = services.conversations.get_or_start(&id).await.unwrap();
                    let message = UserMessage {
                        text: format!("turn {turn} of conversation {n}"),
                        images: vec![],
                        client_message_id: None,
                        if_busy: IfBusy::Reject,
                    };
                    let sent = live.send(message, Duration::from_secs(120)).await;
                    assert!(matches!(sent, Ok(Ok(_))), "{sent:?}");
                    loop {
                        let frame = frames.recv().await.unwrap();
                        if frame.kind != "state" {
                            continue;
                        }
                        let value: Value = serde_json::from_str(&frame.json).unwrap();
                        match value["state"]["kind"].as_str() {
                            Some("idle") => break,
                            Some("error") => panic!("a turn failed: {value}"),
                            _ => {}
                        }
                    }
                }
            }
            if hook.is_some() {
                // Every turn's event delivered and its result written (the receiver answers
                // each with a 200): then the run ends.
                loop {
                    let (outbox, pending) = services.store.webhook_backlog().await.unwrap();
                    if outbox == 0 && pending == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let delivered = services
                    .store
                    .webhook_deliveries(&tenant, &hook_id, Some("succeeded"), None, 100_000)
                    .await
                    .unwrap();
                assert_eq!(
                    delivered.len(),
                    conversations * TURNS,
                    "every turn's event delivered"
                );
            }
            runtime.shutdown(Duration::from_secs(5)).await;
        });
}

// ---------------------------------------------------------------------------------------
// The conductor.

/// What a turn costs.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
struct Cost {
    instructions: f64,
    syscalls: f64,
    fsyncs: f64,
}

fn this_binary(role: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(ROLE, role);
    cmd
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs the workload of `conversations` under `wrapper` in a fresh directory.
fn run(wrapper: &[String], conversations: usize, peers: &Peers, scratch: &Path) {
    let dir = scratch.join(format!("run-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = Command::new(&wrapper[0]);
    if let Some(hook) = &peers.hook {
        cmd.env("TURNCOST_HOOK", hook);
    }
    let status = cmd
        .args(&wrapper[1..])
        .arg(std::env::current_exe().unwrap())
        .env(ROLE, "workload")
        .env("TURNCOST_CONVERSATIONS", conversations.to_string())
        .env("TURNCOST_LLM", &peers.llm)
        .env("TURNCOST_DIR", &dir)
        // The default filter (info), as a node logs unless told otherwise.
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(
        status.success(),
        "the workload under {wrapper:?} failed: {status}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The instructions of one run, from callgrind's output file.
fn instructions(conversations: usize, peers: &Peers, scratch: &Path) -> u64 {
    let variant = if peers.hook.is_some() {
        "-subscribed"
    } else {
        ""
    };
    let out = scratch.join(format!("callgrind-{conversations}{variant}.out"));
    run(
        &[
            "valgrind".into(),
            "--tool=callgrind".into(),
            "--quiet".into(),
            format!("--callgrind-out-file={}", out.display()),
        ],
        conversations,
        peers,
        scratch,
    );
    let text = std::fs::read_to_string(&out).unwrap();
    text.lines()
        .find_map(|line| {
            line.strip_prefix("summary:")
                .or_else(|| line.strip_prefix("totals:"))
        })
        .and_then(|n| n.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no total in {}", out.display()))
}

/// The run with the fewest system calls of `SYSCALL_TRIES`: what a run adds beyond its work
/// (a thread woken once more, a retried read) depends on the moment, and only adds.
fn fewest_syscalls(conversations: usize, peers: &Peers, scratch: &Path) -> (u64, u64) {
    (0..SYSCALL_TRIES)
        .map(|_| syscalls(conversations, peers, scratch))
        .min()
        .unwrap()
}

/// The system calls of one run (without the waiting ones) and its fsyncs, from strace's
/// summary.
fn syscalls(conversations: usize, peers: &Peers, scratch: &Path) -> (u64, u64) {
    let out = scratch.join(format!("strace-{conversations}.txt"));
    run(
        &[
            "strace".into(),
            "-f".into(),
            "-c".into(),
            "-o".into(),
            out.display().to_string(),
        ],
        conversations,
        peers,
        scratch,
    );
    let text = std::fs::read_to_string(&out).unwrap();
    let (mut calls, mut fsyncs) = (0, 0);
    for line in text.lines() {
        // % time, seconds, usecs/call, calls, [errors], syscall
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(&name) = fields.last() else { continue };
        if fields.len() < 5 || name == "total" || name == "syscall" || WAITING.contains(&name) {
            continue;
        }
        let Ok(n) = fields[3].parse::<u64>() else {
            continue;
        };
        calls += n;
        if matches!(name, "fsync" | "fdatasync") {
            fsyncs += n;
        }
    }
    (calls, fsyncs)
}

fn baseline_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/turncost.json")
}

/// The processes a workload talks to: the fake LLM, and the receiver of its tenant's
/// webhook (`None`: the tenant has no endpoint).
struct Peers {
    llm: String,
    hook: Option<String>,
}

/// What a turn of the workload with `peers` costs: the runs of `SMALL` and `LARGE`
/// conversations, the difference divided by the difference in turns.
fn cost_of(name: &str, peers: &Peers, scratch: &Path) -> Cost {
    let turns = ((LARGE - SMALL) * TURNS) as f64;
    let (small, large) = (
        instructions(SMALL, peers, scratch),
        instructions(LARGE, peers, scratch),
    );
    let ((small_calls, small_fsyncs), (large_calls, large_fsyncs)) = (
        fewest_syscalls(SMALL, peers, scratch),
        fewest_syscalls(LARGE, peers, scratch),
    );
    let per_turn = |small: u64, large: u64| (large as f64 - small as f64) / turns;
    let cost = Cost {
        instructions: per_turn(small, large),
        syscalls: per_turn(small_calls, large_calls),
        fsyncs: per_turn(small_fsyncs, large_fsyncs),
    };
    println!(
        "{name}: per turn {:.0} instructions, {:.1} system calls ({:.2} fsyncs); runs of {} and {} turns: {small} and {large} instructions, {small_calls} and {large_calls} system calls",
        cost.instructions,
        cost.syscalls,
        cost.fsyncs,
        SMALL * TURNS,
        LARGE * TURNS
    );
    cost
}

fn conduct() {
    for tool in ["valgrind", "strace"] {
        if !have(tool) {
            eprintln!("turncost: SKIPPED: {tool} is not installed");
            return;
        }
    }
    let mut fake = this_binary("fake-llm")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(fake.stdout.take().unwrap()).lines();
    let mut next_line = || lines.next().unwrap().unwrap().trim().to_owned();
    let (llm, hook) = (next_line(), next_line());
    let _fake = Owned(fake);
    let scratch = std::env::temp_dir().join(format!(
        "bedrock-turncost-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&scratch).unwrap();
    let cost = cost_of(
        "turncost",
        &Peers {
            llm: llm.clone(),
            hook: None,
        },
        &scratch,
    );
    // With `TURNCOST_WEBHOOK=1`, the turn of a tenant with an endpoint subscribed to
    // `turn.completed` too, each event delivered (issue 39): what the subscription adds.
    if std::env::var("TURNCOST_WEBHOOK").is_ok_and(|v| v == "1") {
        let subscribed = cost_of(
            "turncost (subscribed)",
            &Peers {
                llm,
                hook: Some(hook),
            },
            &scratch,
        );
        println!(
            "turncost: a subscribed tenant's turn costs {:+.1}% instructions and {:+.1}% system calls ({:+.2} fsyncs) over one without",
            (subscribed.instructions / cost.instructions - 1.0) * 100.0,
            (subscribed.syscalls / cost.syscalls - 1.0) * 100.0,
            subscribed.fsyncs - cost.fsyncs
        );
        println!("{}", json!({"turncost_subscribed": subscribed}));
    }
    // `TURNCOST_KEEP=1` keeps callgrind's files (for `callgrind_annotate`).
    if std::env::var("TURNCOST_KEEP").is_ok_and(|v| v == "1") {
        println!("turncost: callgrind's files kept in {}", scratch.display());
    } else {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    println!("{}", json!({"turncost": cost}));
    let path = baseline_path();
    if std::env::var("TURNCOST_UPDATE").is_ok_and(|v| v == "1") {
        std::fs::write(&path, serde_json::to_string_pretty(&cost).unwrap() + "\n").unwrap();
        println!("turncost: baseline written to {}", path.display());
        return;
    }
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!(
            "turncost: no baseline at {}; TURNCOST_UPDATE=1 writes one",
            path.display()
        );
        std::process::exit(1);
    };
    let baseline: Cost = serde_json::from_str(&text).unwrap();
    let mut over = Vec::new();
    for (what, now, then) in [
        ("instructions", cost.instructions, baseline.instructions),
        ("system calls", cost.syscalls, baseline.syscalls),
    ] {
        let ratio = now / then;
        println!(
            "turncost: {what} per turn {now:.1}, baseline {then:.1} ({:+.1}%)",
            (ratio - 1.0) * 100.0
        );
        if ratio > 1.0 + TOLERANCE {
            over.push(what);
        }
    }
    if !over.is_empty() {
        eprintln!(
            "turncost: FAILED: a turn costs more than {:.0}% over the baseline in {} (benches/turncost.json; a change that buys a feature with cost updates it with TURNCOST_UPDATE=1 and says why)",
            TOLERANCE * 100.0,
            over.join(" and ")
        );
        std::process::exit(1);
    }
}
