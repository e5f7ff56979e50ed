//! Persistence (REQ-BED-007; the persistence issue): restart recovery after a real kill,
//! the database going away and coming back, the commands that manage the database.

use std::time::Duration;

use bedrock::testkit::{FakeLlm, Reply as Llm};
use serde_json::{Value, json};

use crate::support::process::{Server, command};
use crate::support::{TestApp, TestDb, WAIT, eventually, roles};

/// The node id `/readyz` shows (null on SQLite).
async fn readyz_node(server: &Server) -> Value {
    let ready: Value = reqwest::get(format!("{}/readyz", server.base))
        .await
        .expect("readyz answers")
        .json()
        .await
        .expect("a JSON answer");
    ready["node"]["id"].clone()
}

/// The server with the default settings of `[cluster]`: no node id configured.
fn start_default_node(db: &TestDb, llm: &FakeLlm, workspace: &std::path::Path) -> Server {
    let mut cmd = command(db, llm, workspace);
    cmd.env_remove("BEDROCK_CLUSTER__NODE_ID");
    Server::start_with(cmd)
}

/// A real kill -9 in the middle of a tool, then a restart on the same database: the turn is
/// closed with a synthetic result, the conversation is idle, and the next LLM request is valid.
/// With the default settings (no `cluster.node_id`): on Postgres the restarted process is
/// the same node (its id kept in the data directory), so it ends its previous run's leases
/// at once instead of waiting out the lease TTL (issue 42, item 3).
#[tokio::test]
async fn killed_mid_tool_recovers_on_restart() {
    for db in TestDb::each().await {
        let llm = FakeLlm::start().await;
        let workspace = crate::support::db::temp_dir("ws");
        bedrock::install_crypto();
        let server = start_default_node(&db, &llm, &workspace);
        let node_before = readyz_node(&server).await;
        let created = server.conversation().await;
        let id = created["id"].as_str().expect("an id").to_owned();
        let cwd = std::path::PathBuf::from(created["cwd"].as_str().expect("a cwd"));
        let sleep = crate::support::unique_sleep();
        llm.push([Llm::Tools {
            text: None,
            calls: vec![
                (
                    "call_long".into(),
                    "bash".into(),
                    json!({"command": format!("touch started; {sleep}")}),
                ),
                (
                    "call_next".into(),
                    "bash".into(),
                    json!({"command": "touch never"}),
                ),
            ],
        }]);
        server.send(&id, "long job").await;
        eventually("the tool to start", WAIT, || async {
            cwd.join("started").exists().then_some(())
        })
        .await;
        crate::support::wait_running(&sleep).await;
        server.kill_hard();
        // The sandbox ties every tool process to the server: it dies with it.
        eventually(
            "the tool's processes to die with the server",
            WAIT,
            || async { (!crate::support::running(&sleep)).then_some(()) },
        )
        .await;

        let server = start_default_node(&db, &llm, &workspace);
        let state = server
            .get(&format!("/conversations/{id}"))
            .await
            .expect("a JSON answer");
        assert_eq!(
            state["state"],
            json!({"kind": "idle"}),
            "recovered to idle at start"
        );
        let node_after = readyz_node(&server).await;
        assert_eq!(node_before, node_after, "the same node after a restart");
        if db.backend == "postgres" {
            assert!(
                node_after
                    .as_str()
                    .is_some_and(|id| id.starts_with("node-")),
                "{node_after}"
            );
        }
        let messages = server
            .get(&format!("/conversations/{id}/messages"))
            .await
            .expect("a JSON answer");
        let results: Vec<(Value, Value)> = messages["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .filter(|m| m["message_type"] == "tool")
            .map(|m| {
                (
                    m["content"]["tool_use_id"].clone(),
                    m["content"]["output"].clone(),
                )
            })
            .collect();
        assert_eq!(
            results,
            vec![
                (json!("call_long"), json!("interrupted by server restart")),
                (json!("call_next"), json!("interrupted by server restart")),
            ]
        );
        assert!(!cwd.join("never").exists());
        // The next LLM request is valid: every tool call has its result, in order.
        llm.push([Llm::text("resumed")]);
        server.send(&id, "go on").await;
        let request = eventually("the next request", WAIT, || async {
            llm.requests().get(1).cloned()
        })
        .await;
        assert_eq!(
            roles(&request),
            ["system", "user", "assistant", "tool", "tool", "user"]
        );
        server.kill_hard();
        crate::support::process::remove_workspace(&workspace);
        db.drop_db().await;
    }
}

/// Every acknowledged message survives a kill -9 that follows the 202s at once (REQ-BED-007):
/// forty sends at the same moment go through the group commit together (on SQLite, with the
/// log synced beside the next batch), and after the restart each acknowledged message is
/// stored. That a batch is answered only after it is written is checked where it happens
/// (`persistence::tests::the_writer_is_freed_once_before_the_answers`); what a power loss
/// would do to a batch answered before its sync cannot be tested here.
#[tokio::test]
async fn acknowledged_messages_survive_a_kill() {
    for db in TestDb::each().await {
        let llm = FakeLlm::start().await;
        let workspace = crate::support::db::temp_dir("ws");
        bedrock::install_crypto();
        let server = Server::start(&db, &llm, &workspace);
        // Every turn's LLM request hangs: the conversations stay busy, nothing else writes.
        llm.push(std::iter::repeat_n(Llm::Stall, 40));
        let mut ids = Vec::new();
        for _ in 0..40 {
            let created = server.conversation().await;
            ids.push(created["id"].as_str().expect("an id").to_owned());
        }
        let live = &server;
        let sends = ids.iter().map(|id| async move {
            let sent = live
                .post(
                    &format!("/conversations/{id}/messages"),
                    json!({"text": format!("keep {id}")}),
                )
                .await;
            let message = sent["message"]["id"].as_str().map(str::to_owned);
            (
                id.clone(),
                message.unwrap_or_else(|| panic!("accepted: {sent}")),
            )
        });
        let acknowledged = futures::future::join_all(sends).await;
        server.kill_hard();

        let server = Server::start(&db, &llm, &workspace);
        for (id, message) in &acknowledged {
            let stored = server
                .get(&format!("/conversations/{id}/messages"))
                .await
                .expect("a JSON answer");
            let found = stored["messages"]
                .as_array()
                .expect("messages")
                .iter()
                .any(|m| m["id"].as_str() == Some(message));
            assert!(found, "{id}: acknowledged {message}, not stored: {stored}");
        }
        server.kill_hard();
        crate::support::process::remove_workspace(&workspace);
        db.drop_db().await;
    }
}

/// SQLite: another process holds the write lock. Requests that need a write get 503, what was
/// acknowledged is kept, and the service recovers by itself once the lock is gone.
#[tokio::test]
async fn sqlite_locked_gives_503_and_recovers() {
    use sea_orm::sqlx::{Connection, SqliteConnection};
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_DATABASE__ACQUIRE_TIMEOUT_MS", "1000")]).await;
    let id = app.conversation().await;
    app.llm
        .push([Llm::bash("c1", "sleep 1; echo done"), Llm::text("finished")]);
    app.send(&id, "work").await;
    app.wait_kind(&id, "tool_executing").await;
    let mut locker = SqliteConnection::connect(&db.url)
        .await
        .expect("a second connection");
    sea_orm::sqlx::query("BEGIN EXCLUSIVE")
        .execute(&mut locker)
        .await
        .expect("the write lock");
    // Writes fail clearly while the lock is held; reads still work.
    app.post("/v1/conversations", json!({}))
        .await
        .expect_error(503, "unavailable");
    assert_eq!(
        app.get(&format!("/v1/conversations/{id}")).await.status,
        200
    );
    // The tool finishes meanwhile; its result waits for the database instead of being lost.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    sea_orm::sqlx::query("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("the lock is released");
    drop(locker);
    app.wait_kind(&id, "idle").await;
    let messages = app.messages(&id).await;
    let tool = messages
        .iter()
        .find(|m| m["message_type"] == "tool")
        .expect("the tool result was kept");
    assert_eq!(tool["content"]["output"], "done\n");
    assert_eq!(
        messages.last().expect("messages")["content"]["text"],
        "finished"
    );
    app.post("/v1/conversations", json!({})).await.expect(201);
    app.cleanup(db).await;
}

/// Postgres: the server's role loses its login and its sessions; 503 until it is granted back.
#[tokio::test]
async fn postgres_down_gives_503_and_recovers() {
    use sea_orm::{ConnectionTrait, Database};
    let Some(admin) = std::env::var("BEDROCK_TEST_DATABASE_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        return; // Postgres runs where BEDROCK_TEST_DATABASE_URL is set; SQLite is covered above.
    };
    let Some(mut db) = TestDb::postgres().await else {
        return;
    };
    let role = format!("bedrock_r_{}", uuid::Uuid::now_v7().simple());
    let name = db
        .url
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .split('?')
        .next()
        .unwrap_or_default()
        .to_owned();
    let conn = Database::connect(&admin).await.expect("admin connects");
    conn.execute_unprepared(&format!("CREATE ROLE {role} LOGIN"))
        .await
        .expect("a role");
    conn.execute_unprepared(&format!("ALTER DATABASE {name} OWNER TO {role}"))
        .await
        .expect("owner");
    let scheme_end = db.url.find("://").expect("a URL") + 3;
    let host_start = db.url[scheme_end..]
        .find('@')
        .map_or(scheme_end, |at| scheme_end + at + 1);
    db.url = format!("postgres://{role}@{}", &db.url[host_start..]);
    let app = TestApp::spawn_with(&db, &[("BEDROCK_DATABASE__ACQUIRE_TIMEOUT_MS", "1000")]).await;
    let id = app.conversation().await;
    conn.execute_unprepared(&format!("ALTER ROLE {role} NOLOGIN"))
        .await
        .expect("revoke");
    conn.execute_unprepared(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
    ))
    .await
    .expect("terminate sessions");
    app.post("/v1/conversations", json!({}))
        .await
        .expect_error(503, "unavailable");
    app.post(
        &format!("/v1/conversations/{id}/messages"),
        json!({"text": "x"}),
    )
    .await
    .expect_error(503, "unavailable");
    assert_eq!(
        app.request(reqwest::Method::GET, "/readyz", None, None)
            .await
            .status,
        503
    );
    conn.execute_unprepared(&format!("ALTER ROLE {role} LOGIN"))
        .await
        .expect("grant back");
    eventually("the service to recover", WAIT, || async {
        (app.request(reqwest::Method::GET, "/readyz", None, None)
            .await
            .status
            == 200)
            .then_some(())
    })
    .await;
    app.llm.push([Llm::text("back")]);
    app.send(&id, "again").await;
    app.wait_kind(&id, "idle").await;
    assert_eq!(
        app.messages(&id).await.len(),
        2,
        "the refused send stored nothing"
    );
    app.cleanup(db).await;
    let _ = conn
        .execute_unprepared(&format!("DROP ROLE IF EXISTS {role}"))
        .await;
}

/// `bedrock migrate`, `bedrock tenant create` and `bedrock config` on a fresh data dir.
#[tokio::test]
async fn commands_manage_the_database() {
    let db = TestDb::sqlite();
    let llm = FakeLlm::start().await;
    let workspace = crate::support::db::temp_dir("ws");
    let migrate = command(&db, &llm, &workspace)
        .arg("migrate")
        .output()
        .expect("migrate runs");
    assert!(
        migrate.status.success(),
        "{}",
        String::from_utf8_lossy(&migrate.stderr)
    );
    let created = command(&db, &llm, &workspace)
        .args(["tenant", "create", "acme"])
        .output()
        .expect("tenant create runs");
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let printed: Value = serde_json::from_slice(&created.stdout).expect("JSON on stdout");
    let key = printed["api_key"].as_str().expect("a key");
    assert!(key.starts_with("bk_") && printed["tenant_id"].is_string());
    let again = command(&db, &llm, &workspace)
        .args(["tenant", "create", "acme"])
        .output()
        .expect("runs");
    assert!(
        !again.status.success(),
        "a second tenant of the same name is refused"
    );
    // Its own budget and rate (issue 25), printed as they now apply.
    let budget = command(&db, &llm, &workspace)
        .args([
            "tenant", "budget", "acme", "--tokens", "5000", "--period", "day",
        ])
        .output()
        .expect("tenant budget runs");
    assert!(
        budget.status.success(),
        "{}",
        String::from_utf8_lossy(&budget.stderr)
    );
    let printed: Value = serde_json::from_slice(&budget.stdout).expect("JSON on stdout");
    assert_eq!(printed["budget"]["limit"], 5000);
    assert_eq!(printed["budget"]["period"], "day");
    assert_eq!(printed["budget"]["used"], 0);
    let back = command(&db, &llm, &workspace)
        .args(["tenant", "budget", "acme", "--default"])
        .output()
        .expect("runs");
    let printed: Value = serde_json::from_slice(&back.stdout).expect("JSON on stdout");
    assert_eq!(printed["budget"], Value::Null, "the default is no budget");
    let rate = command(&db, &llm, &workspace)
        .args([
            "tenant",
            "rate",
            "acme",
            "--per-second",
            "2.5",
            "--burst",
            "10",
        ])
        .output()
        .expect("tenant rate runs");
    let printed: Value = serde_json::from_slice(&rate.stdout).expect("JSON on stdout");
    assert_eq!(
        (printed["per_second"].as_f64(), printed["burst"].as_u64()),
        (Some(2.5), Some(10))
    );
    let unknown = command(&db, &llm, &workspace)
        .args(["tenant", "budget", "nobody", "--tokens", "1"])
        .output()
        .expect("runs");
    assert!(!unknown.status.success());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no tenant is named"));
    let config = command(&db, &llm, &workspace)
        .env("BEDROCK_LLM_API_KEY", "sekrit")
        .arg("config")
        .output()
        .expect("config runs");
    let shown = String::from_utf8_lossy(&config.stdout);
    assert!(
        shown.contains("[llm]")
            && shown.contains("api_key = \"********\"")
            && !shown.contains("sekrit"),
        "{shown}"
    );
    let bad = command(&db, &llm, &workspace)
        .env("BEDROCK_TURN__MAX_LLM_STEPS", "lots")
        .arg("config")
        .output()
        .expect("runs");
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("turn.max_llm_steps"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    // The key is stored hashed, never in clear.
    let raw = std::fs::read(db.dir.as_ref().expect("a dir").join("bedrock.db"))
        .expect("the database file");
    assert!(
        !raw.windows(key.len()).any(|w| w == key.as_bytes()),
        "the key is not stored in clear"
    );
    crate::support::process::remove_workspace(&workspace);
    db.drop_db().await;
}
