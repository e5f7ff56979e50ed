//! Chaos (issue 27): turns run while faults are injected at random, from a seed the test
//! prints (`CHAOS_SEED=N` replays it; `CHAOS_ROUNDS=N` runs more rounds, 3 by default):
//! kill -9 and restart of the server, the database refusing writes for seconds (SQLite:
//! another connection holds its write lock; Postgres: the server's role made NOLOGIN and
//! its connections ended), the data dir's disk full (a small tmpfs, where the test may
//! mount one), and an LLM that errs, rate-limits, stalls, cuts its streams and sends bad
//! tool JSON, all the time.
//!
//! After each round, once the faults stop: every acknowledged message is stored, every
//! stored chain is valid, every conversation comes to rest (idle or error), and no tool
//! process is left behind.

use std::path::PathBuf;
use std::time::Duration;

use bedrock::state_machine::{MessageContent, validate_chain};
use bedrock::store::{Store, StoreOptions};
use bedrock::testkit::{FakeLlm, Reply as Llm};
use sea_orm::{ConnectionTrait, Database, TransactionTrait};
use serde_json::json;

use crate::support::process::{Server, command};
use crate::support::{TestDb, WAIT, eventually, running_containing};

/// A small deterministic generator (xorshift64*), so a seed replays a run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// The LLM's faults alone.
    None,
    KillAndRestart,
    DatabaseRefuses,
    DiskFull,
}

/// A tmpfs for the data dir (and SQLite's file), where this process may mount one.
struct SmallDisk {
    dir: PathBuf,
}

impl SmallDisk {
    fn mount() -> Result<SmallDisk, String> {
        let dir = crate::support::db::temp_dir("chaos-disk");
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=24m", "tmpfs"])
            .arg(&dir)
            .stderr(std::process::Stdio::piped())
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !status.status.success() {
            let _ = std::fs::remove_dir(&dir);
            return Err(String::from_utf8_lossy(&status.stderr).trim().to_owned());
        }
        Ok(SmallDisk { dir })
    }

    /// Fills the disk until writes fail; the filler goes when dropped.
    fn fill(&self) -> Filler {
        let path = self.dir.join("filler");
        if let Ok(mut file) = std::fs::File::create(&path) {
            let block = vec![0u8; 1 << 20];
            while std::io::Write::write_all(&mut file, &block).is_ok() {}
            let _ = file.sync_all();
        }
        Filler(path)
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.dir).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Filler(PathBuf);

impl Drop for Filler {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// What an LLM request gets this round: mostly answers, a third faults.
fn llm_reply(rng: &mut Rng, marker: &str, n: u64) -> Llm {
    match rng.below(20) {
        0..=6 => Llm::text("done"),
        7..=11 => Llm::bash(&format!("call_{n}"), &format!("sleep 0.3; echo {marker}")),
        12 => Llm::status(500, "the model is down"),
        13 => Llm::status(429, "slow down"),
        14 => Llm::Stall,
        15 => Llm::StallAfterFirstChunk,
        16 => Llm::raw(
            "text/event-stream",
            b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"cut\"}}]}\n\n",
            16,
        ),
        17 => Llm::tool(&format!("call_{n}"), "bash", json!("not an object")),
        _ => Llm::text("fine"),
    }
}

/// Fields drop in order: the server goes before its disk is unmounted.
struct Chaos {
    server: Option<Server>,
    db: TestDb,
    /// The server's database URL (Postgres: as its own role).
    url: String,
    /// Postgres: the server's role, made NOLOGIN to refuse it.
    role: Option<String>,
    llm: FakeLlm,
    workspace: PathBuf,
    disk: Option<SmallDisk>,
}

impl Chaos {
    async fn start(db: TestDb) -> Chaos {
        let llm = FakeLlm::start().await;
        let workspace = crate::support::db::temp_dir("chaos-ws");
        let disk = if db.backend == "sqlite" {
            match SmallDisk::mount() {
                Ok(disk) => Some(disk),
                Err(why) => {
                    #[allow(clippy::print_stderr)]
                    {
                        eprintln!(
                            "chaos: SKIPPED the disk-full fault: no tmpfs could be mounted ({why})"
                        );
                    }
                    None
                }
            }
        } else {
            #[allow(clippy::print_stderr)]
            {
                eprintln!(
                    "chaos: the disk-full fault runs on SQLite only (Postgres's disk is not ours to fill)"
                );
            }
            None
        };
        let (url, role) = match db.backend {
            "postgres" => {
                let role = format!("chaos_{}", uuid::Uuid::now_v7().simple());
                let admin = Database::connect(&db.url).await.expect("the test database");
                for sql in [
                    format!("CREATE ROLE {role} LOGIN"),
                    format!("GRANT ALL ON SCHEMA public TO {role}"),
                ] {
                    admin
                        .execute_unprepared(&sql)
                        .await
                        .expect("the role is made");
                }
                let name = db.url.rsplit('/').next().unwrap_or_default().to_owned();
                let name = name.split('?').next().unwrap_or_default().to_owned();
                admin
                    .execute_unprepared(&format!("ALTER DATABASE {name} OWNER TO {role}"))
                    .await
                    .expect("the role owns the database");
                let _ = admin.close().await;
                let mut url = url::Url::parse(&db.url).expect("a database URL");
                url.set_username(&role).expect("a user in the URL");
                let _ = url.set_password(None);
                (url.to_string(), Some(role))
            }
            _ => match &disk {
                Some(disk) => (
                    format!(
                        "sqlite://{}?mode=rwc",
                        disk.dir.join("bedrock.db").display()
                    ),
                    None,
                ),
                None => (db.url.clone(), None),
            },
        };
        let mut chaos = Chaos {
            db,
            url,
            role,
            llm,
            workspace,
            disk,
            server: None,
        };
        chaos.boot();
        chaos
    }

    fn boot(&mut self) {
        let mut cmd = command(&self.db, &self.llm, &self.workspace);
        cmd.env("BEDROCK_DATABASE_URL", &self.url)
            .env("BEDROCK_LLM__FIRST_BYTE_TIMEOUT_MS", "1500")
            .env("BEDROCK_LLM__IDLE_TIMEOUT_MS", "1500")
            .env("BEDROCK_LLM__TOTAL_TIMEOUT_MS", "8000")
            .env("BEDROCK_DATABASE__ACQUIRE_TIMEOUT_MS", "1000");
        if let Some(disk) = &self.disk {
            cmd.env("BEDROCK_DATA_DIR", disk.dir.join("data"));
        }
        self.server = Some(Server::start_with(cmd));
    }

    fn server(&self) -> &Server {
        self.server.as_ref().expect("the server runs")
    }

    /// The database refuses the server for `for_ms`.
    async fn refuse_database(&self, for_ms: u64) {
        match &self.role {
            Some(role) => {
                let admin_url = self.db.url.clone();
                let admin = Database::connect(&admin_url).await.expect("admin");
                admin
                    .execute_unprepared(&format!("ALTER ROLE {role} NOLOGIN"))
                    .await
                    .expect("NOLOGIN");
                admin
                    .execute_unprepared(&format!(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
                    ))
                    .await
                    .expect("its connections end");
                tokio::time::sleep(Duration::from_millis(for_ms)).await;
                admin
                    .execute_unprepared(&format!("ALTER ROLE {role} LOGIN"))
                    .await
                    .expect("LOGIN");
                let _ = admin.close().await;
            }
            None => {
                // Another connection takes SQLite's write lock and keeps it.
                let other = Database::connect(&self.url)
                    .await
                    .expect("a second connection");
                let txn = other.begin().await.expect("a transaction");
                txn.execute_unprepared("UPDATE tenants SET name = name")
                    .await
                    .expect("the write lock");
                tokio::time::sleep(Duration::from_millis(for_ms)).await;
                let _ = txn.rollback().await;
                let _ = other.close().await;
            }
        }
    }

    /// Sends `text` to `id` with a fresh message_id; the id when acknowledged.
    async fn send(&self, id: &str, text: &str) -> Option<String> {
        let key = uuid::Uuid::now_v7().to_string();
        let answer = reqwest::Client::new()
            .post(format!(
                "{}/v1/conversations/{id}/messages",
                self.server().base
            ))
            .timeout(Duration::from_secs(20))
            .json(&json!({"text": text, "message_id": key}))
            .send()
            .await
            .ok()?;
        matches!(answer.status().as_u16(), 200 | 202).then_some(key)
    }

    /// Waits for `id` to rest (idle or error); on timeout, fails with its JSON and the
    /// server's last log lines.
    async fn wait_rest(&self, id: &str, after: &str) {
        let deadline = tokio::time::Instant::now() + WAIT * 2;
        while tokio::time::Instant::now() < deadline {
            if let Some("idle" | "error") = self.state(id).await.as_deref() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
        let conversation = self.server().get(&format!("/conversations/{id}")).await;
        let logs = self
            .server()
            .logs
            .lock()
            .map(|l| l.clone())
            .unwrap_or_default();
        let tail = logs[logs.len().saturating_sub(40)..].join("\n");
        // The whole log, for what the last lines do not show.
        let file = std::env::temp_dir().join(format!("bedrock-chaos-{id}.log"));
        let _ = std::fs::write(&file, logs.join("\n"));
        panic!(
            "{id} did not come to rest after {after}: {conversation:?}\n--- server log (last 40 lines; all of it in {})\n{tail}",
            file.display()
        );
    }

    async fn state(&self, id: &str) -> Option<String> {
        let conv = self.server().get(&format!("/conversations/{id}")).await?;
        conv["state"]["kind"].as_str().map(str::to_owned)
    }

    async fn end(mut self) {
        if let Some(server) = self.server.take() {
            server.kill_hard();
        }
        drop(self.disk.take());
        crate::support::process::remove_workspace(&self.workspace);
        let role = self.role.take();
        self.db.drop_db().await;
        // The role goes once its database has.
        if let Some(role) = role
            && let Ok(admin_url) = std::env::var("BEDROCK_TEST_DATABASE_URL")
            && let Ok(admin) = Database::connect(&admin_url).await
        {
            let _ = admin
                .execute_unprepared(&format!("DROP ROLE IF EXISTS {role}"))
                .await;
        }
    }
}

#[tokio::test]
async fn chaos_rounds_leave_every_conversation_consistent() {
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| u64::try_from(chrono::Utc::now().timestamp_micros()).unwrap_or(7) | 1);
    let rounds: u64 = std::env::var("CHAOS_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    #[allow(clippy::print_stderr)]
    {
        eprintln!("chaos: CHAOS_SEED={seed} CHAOS_ROUNDS={rounds}");
    }
    bedrock::install_crypto();
    for db in TestDb::each().await {
        let mut rng = Rng(seed);
        let backend = db.backend;
        let mut chaos = Chaos::start(db).await;
        let marker = format!("chaos-tool-{}", uuid::Uuid::now_v7().simple());
        let mut conversations = Vec::new();
        for _ in 0..4 {
            let conv = chaos.server().conversation().await;
            conversations.push(conv["id"].as_str().expect("an id").to_owned());
        }
        let mut acked: Vec<(String, String)> = Vec::new();
        for round in 0..rounds {
            for n in 0..60 {
                chaos
                    .llm
                    .push([llm_reply(&mut rng, &marker, round * 100 + n)]);
            }
            chaos.llm.fallback(Llm::text("calm again"));
            let fault = match rng.below(4) {
                0 => Fault::None,
                1 => Fault::KillAndRestart,
                2 => Fault::DatabaseRefuses,
                _ if chaos.disk.is_some() => Fault::DiskFull,
                _ => Fault::DatabaseRefuses,
            };
            #[allow(clippy::print_stderr)]
            {
                eprintln!("chaos [{backend}]: round {round}: {fault:?}");
            }
            for id in &conversations {
                if let Some(key) = chaos.send(id, "work").await {
                    acked.push((id.clone(), key));
                }
            }
            tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
            match fault {
                Fault::None => {}
                Fault::KillAndRestart => {
                    chaos.server.take().expect("the server").kill_hard();
                    chaos.boot();
                }
                Fault::DatabaseRefuses => {
                    let refuse = chaos.refuse_database(2000 + rng.below(2000));
                    let sends = async {
                        let mut got = Vec::new();
                        for id in &conversations {
                            if let Some(key) = chaos.send(id, "during").await {
                                got.push((id.clone(), key));
                            }
                        }
                        got
                    };
                    let ((), got) = tokio::join!(refuse, sends);
                    acked.extend(got);
                }
                Fault::DiskFull => {
                    let filler = chaos.disk.as_ref().map(SmallDisk::fill);
                    for id in &conversations {
                        if let Some(key) = chaos.send(id, "disk full").await {
                            acked.push((id.clone(), key));
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    drop(filler);
                }
            }
            // The faults have stopped: everything comes to rest.
            for id in &conversations {
                chaos
                    .wait_rest(id, &format!("{fault:?} (CHAOS_SEED={seed})"))
                    .await;
            }
            check(&chaos, &conversations, &acked, seed).await;
            eventually(
                &format!("no tool process left (CHAOS_SEED={seed})"),
                WAIT,
                || async { (!running_containing(&marker)).then_some(()) },
            )
            .await;
        }
        chaos.end().await;
    }
}

/// Every acknowledged message is stored and every chain is valid.
async fn check(chaos: &Chaos, conversations: &[String], acked: &[(String, String)], seed: u64) {
    let store = Store::connect(&StoreOptions {
        url: chaos.url.clone(),
        max_connections: 2,
        acquire_timeout: Duration::from_secs(5),
    })
    .await
    .expect("the database answers");
    for id in conversations {
        let messages = store
            .messages_between(id, 1, i64::MAX)
            .await
            .expect("the messages");
        let contents: Vec<&MessageContent> = messages.iter().map(|m| &m.content).collect();
        assert_eq!(
            validate_chain(contents, false),
            Ok(()),
            "the chain of {id} (CHAOS_SEED={seed})"
        );
        for (_, key) in acked.iter().filter(|(conv, _)| conv == id) {
            assert!(
                messages
                    .iter()
                    .any(|m| m.client_message_id.as_deref() == Some(key.as_str())),
                "acknowledged message {key} of {id} is stored (CHAOS_SEED={seed})"
            );
        }
    }
    let _ = store.close().await;
}
