//! `bedrock replay --all` over stored conversations (issue 40): how many steps a second it
//! re-runs on one core, and what the replay log stores per turn.
//!
//! The data: `REPLAY_TEMPLATES` conversations (20) of `REPLAY_TURNS` one-tool turns (10: the
//! fake LLM asks for one `think` call, then answers) made through the real runtime (actors,
//! gateway, persistence on SQLite), each then copied (its row, its messages, its rows of
//! frames, which carry its steps, and of steps) until there are `REPLAY_CONVERSATIONS`
//! (10,000). The replay runs as `bedrock replay
//! --all` does (`app::replay_with`: per conversation its rows of steps, the messages they
//! refer to, every step re-run and its digest compared) on a current-thread runtime, so on
//! one core; the figure is steps over the process's CPU time and over wall time.
//!
//! Run: `cargo bench --bench replay` (or the binary in target/release/deps).

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use bedrock::model::{NewConversation, Tenant};
use bedrock::persistence::WriteJob;
use bedrock::runtime::UserMessage;
use bedrock::state_machine::IfBusy;
use sea_orm::{ConnectionTrait, Database, DbBackend, Statement};
use serde_json::Value;

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    bedrock::install_crypto();
    let conversations = knob("REPLAY_CONVERSATIONS", 10_000);
    let turns = knob("REPLAY_TURNS", 10);
    let templates = knob("REPLAY_TEMPLATES", 20).min(conversations);
    let dir = std::env::temp_dir().join(format!("bedrock-replay-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.join("bedrock.db").display());

    // The templates, through the real runtime.
    let made = Instant::now();
    let ids = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(make_templates(&dir, &url, templates, turns));
    eprintln!(
        "replay bench: {templates} conversations of {turns} turns made in {:.1} s",
        made.elapsed().as_secs_f64()
    );

    // The copies.
    let copied = Instant::now();
    let per_turn = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(copy_templates(&url, &ids, conversations));
    eprintln!(
        "replay bench: copied to {conversations} conversations in {:.1} s",
        copied.elapsed().as_secs_f64()
    );

    // The replay, on one core.
    let pid = std::process::id();
    let (summary, wall, cpu) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let store = bedrock::store::Store::connect(&bedrock::store::StoreOptions {
                url: url.clone(),
                max_connections: 1,
                acquire_timeout: Duration::from_secs(60),
            })
            .await
            .unwrap();
            let target = bedrock::app::ReplayTarget {
                all: true,
                ..Default::default()
            };
            let (u0, s0) = common::live::cpu_time(pid);
            let started = Instant::now();
            let mut out = Vec::new();
            let summary = bedrock::app::replay_with(&store, &target, &mut out, false)
                .await
                .unwrap();
            let wall = started.elapsed();
            let (u1, s1) = common::live::cpu_time(pid);
            assert_eq!(summary.diverged, 0, "{}", String::from_utf8_lossy(&out));
            (summary, wall, (u1 + s1) - (u0 + s0))
        });
    let total_turns = (conversations * turns) as f64;
    let result = serde_json::json!({
        "conversations": summary.conversations,
        "turns": total_turns,
        "steps": summary.steps,
        "steps_per_turn": summary.steps as f64 / total_turns,
        "wall_s": wall.as_secs_f64(),
        "cpu_s": cpu.as_secs_f64(),
        "steps_per_s_wall": summary.steps as f64 / wall.as_secs_f64(),
        "steps_per_s_cpu": summary.steps as f64 / cpu.as_secs_f64().max(1e-9),
        "replay_log_bytes_per_turn": per_turn,
    });
    println!("{result}");
    println!(
        "replay: {} conversations, {} steps ({:.1} a turn) in {:.2} s wall, {:.2} s CPU: {:.0} steps/s (wall), {:.0} steps/s (CPU); the log stores {:.0} B a turn",
        summary.conversations,
        summary.steps,
        summary.steps as f64 / total_turns,
        wall.as_secs_f64(),
        cpu.as_secs_f64(),
        summary.steps as f64 / wall.as_secs_f64(),
        summary.steps as f64 / cpu.as_secs_f64().max(1e-9),
        per_turn,
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `templates` conversations of `turns` one-tool turns, one turn at a time each, all at
/// once; their ids.
async fn make_templates(
    dir: &std::path::Path,
    url: &str,
    templates: usize,
    turns: usize,
) -> Vec<String> {
    let llm = bedrock::testkit::FakeLlm::start().await;
    llm.forget_requests();
    llm.auto_tool_turns(
        "think",
        serde_json::json!({"thoughts": "one tool call per turn"}),
    );
    let workspace = dir.join("ws");
    std::fs::create_dir_all(&workspace).unwrap();
    let runtime = common::start_runtime(
        [
            ("BEDROCK_DATABASE_URL".into(), url.to_owned()),
            (
                "BEDROCK_DATA_DIR".into(),
                dir.join("data").display().to_string(),
            ),
            ("BEDROCK_LLM_BASE_URL".into(), llm.base_url.clone()),
            ("BEDROCK_LLM_API_KEY".into(), "k".into()),
            (
                "BEDROCK_WORKSPACE_ROOT".into(),
                workspace.display().to_string(),
            ),
            ("BEDROCK_SANDBOX__MODE".into(), "off".into()),
        ],
        4,
        Duration::from_secs(60),
    )
    .await;
    let tenant = "replay".to_owned();
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
    let mut ids = Vec::new();
    let mut work = Vec::new();
    for n in 0..templates {
        let id = uuid::Uuid::now_v7().to_string();
        runtime
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
        ids.push(id.clone());
        let conversations = runtime.conversations.clone();
        let hub = runtime.hub.clone();
        work.push(tokio::spawn(async move {
            let mut frames = hub.subscribe(&id);
            for turn in 0..turns {
                let live = conversations.get_or_start(&id).await.unwrap();
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
        }));
    }
    for task in work {
        task.await.unwrap();
    }
    runtime.shutdown(Duration::from_secs(5)).await;
    ids
}

/// The columns of `table`, in order.
async fn columns(db: &sea_orm::DatabaseConnection, table: &str) -> Vec<String> {
    db.query_all_raw(Statement::from_string(
        DbBackend::Sqlite,
        format!("PRAGMA table_info({table})"),
    ))
    .await
    .unwrap()
    .into_iter()
    .map(|row| row.try_get::<String>("", "name").unwrap())
    .collect()
}

/// Copies the templates (their rows, messages and steps) round-robin until there are
/// `conversations`; the replay log's bytes per turn of the templates.
async fn copy_templates(url: &str, ids: &[String], conversations: usize) -> f64 {
    let db = Database::connect(url).await.unwrap();
    let conv_cols = columns(&db, "conversations").await;
    let msg_cols = columns(&db, "messages").await;
    let frame_cols = columns(&db, "conversation_frames").await;
    let select = |cols: &[String], set: &[(&str, &str)]| -> (String, String) {
        let names = cols.join(", ");
        let values = cols
            .iter()
            .map(|c| {
                set.iter()
                    .find(|(name, _)| name == c)
                    .map_or_else(|| c.clone(), |(_, v)| (*v).to_owned())
            })
            .collect::<Vec<_>>()
            .join(", ");
        (names, values)
    };
    let (conv_names, conv_values) = select(
        &conv_cols,
        &[("id", "?1"), ("slug", "?1"), ("internal_key", "NULL")],
    );
    let (msg_names, msg_values) = select(
        &msg_cols,
        &[
            (
                "conversation_key",
                "(SELECT internal_key FROM conversations WHERE id = ?1)",
            ),
            ("id", "id || '-' || ?1"),
        ],
    );
    let (frame_names, frame_values) = select(
        &frame_cols,
        &[(
            "conversation_key",
            "(SELECT internal_key FROM conversations WHERE id = ?1)",
        )],
    );
    let bytes: i64 = db
        .query_one_raw(Statement::from_string(
            DbBackend::Sqlite,
            "SELECT (SELECT COALESCE(SUM(COALESCE(LENGTH(packed_steps), LENGTH(steps))), 0) \
             FROM conversation_steps) \
             + (SELECT COALESCE(SUM(COALESCE(LENGTH(packed_steps), LENGTH(steps))), 0) \
             FROM conversation_frames) AS n",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get("", "n")
        .unwrap();
    let turns: i64 = db
        .query_one_raw(Statement::from_string(
            DbBackend::Sqlite,
            "SELECT COUNT(*) AS n FROM messages WHERE message_type = 'user'",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get("", "n")
        .unwrap();
    db.execute_unprepared("BEGIN").await.unwrap();
    for n in ids.len()..conversations {
        let from = &ids[n % ids.len()];
        let id = uuid::Uuid::now_v7().to_string();
        let run = |sql: String| {
            Statement::from_sql_and_values(
                DbBackend::Sqlite,
                sql,
                [id.as_str().into(), from.as_str().into()],
            )
        };
        db.execute_raw(run(format!(
            "INSERT INTO conversations ({conv_names}) SELECT {conv_values} FROM conversations WHERE id = ?2"
        )))
        .await
        .unwrap();
        db.execute_raw(run(format!(
            "INSERT INTO messages ({msg_names}) SELECT {msg_values} FROM messages \
             WHERE conversation_key = (SELECT internal_key FROM conversations WHERE id = ?2)"
        )))
        .await
        .unwrap();
        db.execute_raw(run(format!(
            "INSERT INTO conversation_frames ({frame_names}) SELECT {frame_values} \
             FROM conversation_frames \
             WHERE conversation_key = (SELECT internal_key FROM conversations WHERE id = ?2)"
        )))
        .await
        .unwrap();
        db.execute_raw(run(
            "INSERT INTO conversation_steps (conversation_key, last_step, first_step, steps, packed_steps, created_at) \
             SELECT (SELECT internal_key FROM conversations WHERE id = ?1), last_step, first_step, steps, packed_steps, created_at \
             FROM conversation_steps WHERE conversation_key = (SELECT internal_key FROM conversations WHERE id = ?2)"
                .to_owned(),
        ))
        .await
        .unwrap();
    }
    db.execute_unprepared("COMMIT").await.unwrap();
    bytes as f64 / turns.max(1) as f64
}
