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
        Ok("fake-llm") => common::live::serve_fake_llm(),
        Ok("workload") => workload(),
        _ => conduct(),
    }
}

// ---------------------------------------------------------------------------------------
// The fake LLM process.

// ---------------------------------------------------------------------------------------
// The workload: `TURNCOST_CONVERSATIONS` conversations of `TURNS` turns, one turn at a time.

fn workload() {
    bedrock::install_crypto();
    let conversations: usize = std::env::var("TURNCOST_CONVERSATIONS")
        .unwrap()
        .parse()
        .unwrap();
    let llm = std::env::var("TURNCOST_LLM").unwrap();
    let dir = PathBuf::from(std::env::var("TURNCOST_DIR").unwrap());
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
fn run(wrapper: &[String], conversations: usize, llm: &str, scratch: &Path) {
    let dir = scratch.join(format!("run-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let status = Command::new(&wrapper[0])
        .args(&wrapper[1..])
        .arg(std::env::current_exe().unwrap())
        .env(ROLE, "workload")
        .env("TURNCOST_CONVERSATIONS", conversations.to_string())
        .env("TURNCOST_LLM", llm)
        .env("TURNCOST_DIR", &dir)
        .env("RUST_LOG", "warn")
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
fn instructions(conversations: usize, llm: &str, scratch: &Path) -> u64 {
    let out = scratch.join(format!("callgrind-{conversations}.out"));
    run(
        &[
            "valgrind".into(),
            "--tool=callgrind".into(),
            "--quiet".into(),
            format!("--callgrind-out-file={}", out.display()),
        ],
        conversations,
        llm,
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
fn fewest_syscalls(conversations: usize, llm: &str, scratch: &Path) -> (u64, u64) {
    (0..SYSCALL_TRIES)
        .map(|_| syscalls(conversations, llm, scratch))
        .min()
        .unwrap()
}

/// The system calls of one run (without the waiting ones) and its fsyncs, from strace's
/// summary.
fn syscalls(conversations: usize, llm: &str, scratch: &Path) -> (u64, u64) {
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
        llm,
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
    let mut line = String::new();
    BufReader::new(fake.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let llm = line.trim().to_owned();
    let _fake = Owned(fake);
    let scratch = std::env::temp_dir().join(format!(
        "bedrock-turncost-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&scratch).unwrap();
    let turns = ((LARGE - SMALL) * TURNS) as f64;
    let (small, large) = (
        instructions(SMALL, &llm, &scratch),
        instructions(LARGE, &llm, &scratch),
    );
    let ((small_calls, small_fsyncs), (large_calls, large_fsyncs)) = (
        fewest_syscalls(SMALL, &llm, &scratch),
        fewest_syscalls(LARGE, &llm, &scratch),
    );
    let _ = std::fs::remove_dir_all(&scratch);
    let per_turn = |small: u64, large: u64| (large as f64 - small as f64) / turns;
    let cost = Cost {
        instructions: per_turn(small, large),
        syscalls: per_turn(small_calls, large_calls),
        fsyncs: per_turn(small_fsyncs, large_fsyncs),
    };
    println!(
        "turncost: per turn {:.0} instructions, {:.1} system calls ({:.2} fsyncs); runs of {} and {} turns: {small} and {large} instructions, {small_calls} and {large_calls} system calls",
        cost.instructions,
        cost.syscalls,
        cost.fsyncs,
        SMALL * TURNS,
        LARGE * TURNS
    );
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
