//! The tool sandbox (the sandbox issue, REQ-BED-010 and docs/security.md): escape attempts
//! fail, the conversation goes on, ordinary work still works, and the server refuses to
//! start where the sandbox cannot be had.

use bedrock::testkit::Reply as Llm;
use serde_json::{Value, json};

use crate::support::process::{Server, command};
use crate::support::{TestApp, TestDb, WAIT, eventually};

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

/// Runs one bash command as a tool of conversation `id` (tenant `key`) and returns the
/// result the LLM saw: (ok, output).
pub async fn bash_as(app: &TestApp, key: &str, id: &str, input: Value) -> (bool, String) {
    tool_as(app, key, id, "bash", input).await
}

/// Runs one call of `tool` in conversation `id` (tenant `key`) and returns the result the
/// LLM saw: (ok, output).
pub async fn tool_as(
    app: &TestApp,
    key: &str,
    id: &str,
    tool: &str,
    input: Value,
) -> (bool, String) {
    let call = format!(
        "call_{}",
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    app.llm
        .push([Llm::tool(&call, tool, input), Llm::text("done")]);
    app.request(
        reqwest::Method::POST,
        &format!("/v1/conversations/{id}/messages"),
        Some(key),
        Some(json!({"text": "go"})),
    )
    .await
    .expect(202);
    let result = eventually("the tool result", WAIT, || async {
        let messages = app
            .request(
                reqwest::Method::GET,
                &format!("/v1/conversations/{id}/messages"),
                Some(key),
                None,
            )
            .await
            .expect(200);
        let messages = messages["messages"].as_array().cloned().unwrap_or_default();
        let done = messages
            .last()
            .is_some_and(|m| m["message_type"] == "agent" && m["content"]["text"] == "done");
        messages
            .iter()
            .find(|m| m["message_type"] == "tool" && m["content"]["tool_use_id"] == call.as_str())
            .filter(|_| done)
            .map(|m| m["content"].clone())
    })
    .await;
    (
        result["ok"].as_bool().unwrap_or(false),
        result["output"].as_str().unwrap_or_default().to_owned(),
    )
}

async fn bash(app: &TestApp, id: &str, command: &str) -> (bool, String) {
    bash_as(app, &app.key_a, id, json!({ "command": command })).await
}

/// A server on SQLite with one conversation of tenant A.
async fn start() -> (TestDb, TestApp, String) {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    (db, app, id)
}

/// Asserts the conversation still works after an escape attempt.
async fn goes_on(app: &TestApp, id: &str) {
    let (ok, output) = bash(app, id, "echo still-here").await;
    assert!(ok && output.contains("still-here"), "{output}");
    app.get("/healthz").await.expect(200);
}

/// Ordinary work: git, a C compiler, python3, a local server on the sandbox's own loopback.
#[tokio::test]
async fn ordinary_work_runs_in_the_sandbox() {
    let (db, app, id) = start().await;
    let (ok, output) = bash(
        &app,
        &id,
        "git init -q . && git -c user.name=t -c user.email=t@t commit -q --allow-empty -m first && git log --oneline | wc -l",
    )
    .await;
    assert!(ok && output.trim() == "1", "git: {output}");
    let (ok, output) = bash(
        &app,
        &id,
        r#"printf '#include <stdio.h>\nint main(void){puts("compiled");return 0;}\n' > hello.c && gcc -O1 -o hello hello.c && ./hello"#,
    )
    .await;
    assert!(ok && output.contains("compiled"), "gcc: {output}");
    let (ok, output) = bash(
        &app,
        &id,
        r#"python3 -c 'import tempfile,os,socket; f=tempfile.NamedTemporaryFile(); s=socket.socket(); s.bind(("127.0.0.1",0)); s.listen(); c=socket.create_connection(s.getsockname()); print("python", os.getcwd() == os.environ["HOME"])'"#,
    )
    .await;
    assert!(ok && output.contains("python True"), "python3: {output}");
    // Signals are the tool's own: none blocked and none ignored, though the server ignores
    // SIGPIPE and blocks every signal while it starts a run.
    let (ok, output) = bash(
        &app,
        &id,
        "sh -c 'kill -PIPE $$; echo pipe-survived'; sh -c 'kill -TERM $$; echo term-survived'; echo checked",
    )
    .await;
    assert!(
        ok && output.contains("checked") && !output.contains("survived"),
        "signals: {output}"
    );
    // A tool runs below the server's CPU priority (sandbox.nice, 10 by default), and so do
    // the processes it starts, so a CPU-bound tool cannot starve the server.
    let (ok, output) = bash(&app, &id, "nice; sh -c nice").await;
    assert!(ok && output.trim() == "10\n10", "nice: {output:?}");
    // It runs in the idle scheduling class too (sandbox.idle_scheduling, on by default): a
    // server thread that wakes takes the CPU from it at once (REQ-BED-005's prompt cancel).
    // The processes it starts inherit the class.
    let (ok, output) = bash(
        &app,
        &id,
        r#"python3 -c 'import os; print(os.sched_getscheduler(0) == os.SCHED_IDLE)'"#,
    )
    .await;
    assert!(
        ok && output.trim() == "True",
        "scheduling class: {output:?}"
    );
    // The files are the conversation's: the host sees them in its cwd.
    assert!(app.cwd(&id).await.join("hello").exists());
    app.cleanup(db).await;
}

/// Another tenant's workspace does not exist for a tool.
#[tokio::test]
async fn another_tenants_workspace_is_out_of_reach() {
    let (db, app, id) = start().await;
    let other = app
        .request(
            reqwest::Method::POST,
            "/v1/conversations",
            Some(&app.key_b),
            Some(json!({})),
        )
        .await
        .expect(201);
    let other_cwd = std::path::PathBuf::from(other["cwd"].as_str().expect("a cwd"));
    std::fs::write(other_cwd.join("secret.txt"), "tenant-b-secret").expect("written");
    let (ok, output) = bash(
        &app,
        &id,
        &format!("cat {0}/secret.txt; ls {0}", other_cwd.display(),),
    )
    .await;
    assert!(!ok, "{output}");
    assert!(!output.contains("tenant-b-secret"), "{output}");
    assert!(output.contains("No such file or directory"), "{output}");
    goes_on(&app, &id).await;
    app.cleanup(db).await;
}

/// Writes land only in cwd and the private /tmp; nothing outside changes.
#[tokio::test]
async fn writes_outside_cwd_fail() {
    let (db, app, id) = start().await;
    let outside = app.workspace.join("escape.txt");
    for command in [
        format!("echo x > {}", outside.display()),
        "echo x > /etc/bedrock-escape".to_owned(),
        "touch /usr/bedrock-escape".to_owned(),
        "mkdir /bedrock-escape".to_owned(),
        format!("echo x > ../escape.txt && ls {}", app.workspace.display()),
    ] {
        let (ok, output) = bash(&app, &id, &command).await;
        assert!(!ok, "{command}: {output}");
    }
    assert!(!outside.exists());
    assert!(!std::path::Path::new("/etc/bedrock-escape").exists());
    assert!(!std::path::Path::new("/usr/bedrock-escape").exists());
    assert!(!std::path::Path::new("/bedrock-escape").exists());
    let cwd = app.cwd(&id).await;
    assert!(!cwd.parent().expect("a parent").join("escape.txt").exists());
    // The private /tmp is writable, and private: it is gone after the run.
    let (ok, output) = bash(
        &app,
        &id,
        "echo t > /tmp/mine && cat /tmp/mine && echo c > in-cwd",
    )
    .await;
    assert!(ok, "{output}");
    assert!(cwd.join("in-cwd").exists());
    let (ok, output) = bash(&app, &id, "test ! -e /tmp/mine && echo fresh").await;
    assert!(
        ok && output.contains("fresh"),
        "a fresh /tmp per run: {output}"
    );
    goes_on(&app, &id).await;
    app.cleanup(db).await;
}

/// The server's database file, data dir and config are not there for a tool.
#[tokio::test]
async fn server_files_are_invisible() {
    let (db, app, id) = start().await;
    let db_file = db.dir.as_ref().expect("a SQLite dir").join("bedrock.db");
    assert!(db_file.exists());
    let data_dir = format!("{}-data", app.workspace.display());
    let config = std::path::Path::new(&data_dir).join("bedrock.toml");
    std::fs::write(&config, "[llm]\napi_key = \"config-secret\"\n").expect("written");
    let (ok, output) = bash(
        &app,
        &id,
        &format!(
            "cat /etc/shadow; cat {}; cat {}; ls {}",
            db_file.display(),
            config.display(),
            data_dir
        ),
    )
    .await;
    assert!(!ok, "{output}");
    assert!(!output.contains("config-secret"), "{output}");
    assert!(!output.contains("SQLite format"), "{output}");
    assert!(!output.contains("root:"), "/etc/shadow is hidden: {output}");
    goes_on(&app, &id).await;
    app.cleanup(db).await;
}

/// A symlink planted in cwd that points outside leads nowhere: not for bash, not for patch,
/// not for keyword_search.
#[tokio::test]
async fn symlinks_out_of_cwd_lead_nowhere() {
    let (db, app, id) = start().await;
    let cwd = app.cwd(&id).await;
    let secret_dir = crate::support::db::temp_dir("secret");
    std::fs::write(secret_dir.join("secret.txt"), "planted-secret").expect("written");
    std::os::unix::fs::symlink(secret_dir.join("secret.txt"), cwd.join("link")).expect("link");
    std::os::unix::fs::symlink(&secret_dir, cwd.join("dirlink")).expect("dirlink");
    let (ok, output) = bash(&app, &id, "cat link; ls dirlink/; echo x > dirlink/new").await;
    assert!(!ok, "{output}");
    assert!(!output.contains("planted-secret"), "{output}");
    assert!(!secret_dir.join("new").exists());

    app.llm.push([
        Llm::tool(
            "patch_1",
            "patch",
            json!({"path": "link", "edits": [{"old_text": "planted", "new_text": "changed"}]}),
        ),
        Llm::tool(
            "patch_2",
            "patch",
            json!({"path": "dirlink/new.txt", "edits": [{"old_text": "", "new_text": "x"}]}),
        ),
        Llm::tool(
            "search_1",
            "keyword_search",
            json!({"query": "planted", "path": "dirlink"}),
        ),
        Llm::text("done"),
    ]);
    app.send(&id, "try").await;
    let messages = eventually("the three results", WAIT, || async {
        let messages = app.messages(&id).await;
        let results = messages
            .iter()
            .filter(|m| {
                ["patch_1", "patch_2", "search_1"]
                    .iter()
                    .any(|call| m["content"]["tool_use_id"] == *call)
            })
            .count();
        (results == 3).then_some(messages)
    })
    .await;
    for call in ["patch_1", "patch_2", "search_1"] {
        let result = messages
            .iter()
            .find(|m| m["content"]["tool_use_id"] == call)
            .map(|m| m["content"].clone())
            .expect("a result");
        assert_eq!(result["ok"], false, "{call}: {result}");
        assert!(
            result["output"]
                .as_str()
                .unwrap_or_default()
                .contains("leaves the working directory"),
            "{call}: {result}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(secret_dir.join("secret.txt")).expect("read"),
        "planted-secret"
    );
    assert!(!secret_dir.join("new.txt").exists());
    app.wait_kind(&id, "idle").await;
    goes_on(&app, &id).await;
    let _ = std::fs::remove_dir_all(&secret_dir);
    app.cleanup(db).await;
}

/// A TCP connect from bash; prints CONNECTED when it got through.
fn connect(port: u16) -> String {
    format!("timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}' && echo CONNECTED-{port}")
}

/// Network off (the default): the server's own port and the database's are unreachable.
#[tokio::test]
async fn the_host_loopback_is_unreachable() {
    let (db, app, id) = start().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a listener");
    let other = listener.local_addr().expect("an address").port();
    for port in [app.addr.port(), 5432, other] {
        let (ok, output) = bash(&app, &id, &connect(port)).await;
        assert!(!ok, "port {port}: {output}");
        assert!(!output.contains("CONNECTED"), "port {port}: {output}");
    }
    goes_on(&app, &id).await;
    app.cleanup(db).await;
}

/// Network on for a tenant: only the configured TCP ports, never the server's or the
/// database's; other tenants stay off and may not ask for it.
#[tokio::test]
async fn network_is_per_tenant_and_port_limited() {
    let db = TestDb::sqlite();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a listener");
    let allowed = listener.local_addr().expect("an address").port();
    let ports = format!("[{allowed}]");
    let app = TestApp::spawn_with(
        &db,
        &[
            ("BEDROCK_SANDBOX__NETWORK__TENANTS", "[\"a\"]"),
            ("BEDROCK_SANDBOX__NETWORK__TCP_PORTS", &ports),
        ],
    )
    .await;
    let id = app.conversation().await;
    let accepted = tokio::spawn(async move { listener.accept().await.is_ok() });
    let (ok, output) = bash(&app, &id, &connect(allowed)).await;
    assert!(ok && output.contains("CONNECTED"), "{output}");
    assert!(accepted.await.expect("accepts"));
    for port in [app.addr.port(), 5432] {
        let (ok, output) = bash(&app, &id, &connect(port)).await;
        assert!(
            !ok && !output.contains("CONNECTED"),
            "port {port}: {output}"
        );
    }
    // Tenant b: off, and it may not turn it on.
    app.request(
        reqwest::Method::POST,
        "/v1/conversations",
        Some(&app.key_b),
        Some(json!({"network": true})),
    )
    .await
    .expect_error(403, "network_not_allowed");
    let b = app
        .request(
            reqwest::Method::POST,
            "/v1/conversations",
            Some(&app.key_b),
            Some(json!({})),
        )
        .await
        .expect(201);
    let b = b["id"].as_str().expect("an id");
    let (ok, output) = bash_as(&app, &app.key_b, b, json!({"command": connect(allowed)})).await;
    assert!(!ok && !output.contains("CONNECTED"), "{output}");
    app.cleanup(db).await;
}

/// A conversation may ask for network where the tenant is allowed to.
#[tokio::test]
async fn network_can_be_asked_for_per_conversation() {
    let db = TestDb::sqlite();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
    let allowed = listener.local_addr().expect("an address").port();
    let ports = format!("[{allowed}]");
    let app = TestApp::spawn_with(
        &db,
        &[
            (
                "BEDROCK_SANDBOX__NETWORK__PER_CONVERSATION_TENANTS",
                "[\"a\"]",
            ),
            ("BEDROCK_SANDBOX__NETWORK__TCP_PORTS", &ports),
        ],
    )
    .await;
    let on = app
        .post("/v1/conversations", json!({"network": true}))
        .await
        .expect(201);
    assert_eq!(on["network"], true);
    let on = on["id"].as_str().expect("an id");
    let off = app.conversation().await;
    let (ok, output) = bash(&app, on, &connect(allowed)).await;
    assert!(ok && output.contains("CONNECTED"), "{output}");
    let (ok, output) = bash(&app, &off, &connect(allowed)).await;
    assert!(!ok && !output.contains("CONNECTED"), "{output}");
    drop(listener);
    app.cleanup(db).await;
}

/// A fork bomb hits the per-run process limit and ends as a failed result; the server and
/// the conversation carry on, and nothing of the bomb is left.
#[tokio::test]
async fn a_fork_bomb_is_contained() {
    let (db, app, id) = start().await;
    let (ok, output) = bash_as(
        &app,
        &app.key_a,
        &id,
        json!({"command": "bomb() { bomb | bomb & }; bomb; sleep 10", "timeout_ms": 4000}),
    )
    .await;
    assert!(!ok, "{output}");
    assert!(
        output.contains("Resource temporarily unavailable") || output.contains("timed out"),
        "{output}"
    );
    goes_on(&app, &id).await;
    eventually("the bomb's processes to be gone", WAIT, || async {
        (!crate::support::running_containing("bomb() { bomb | bomb & }")).then_some(())
    })
    .await;
    app.cleanup(db).await;
}

/// 10 GB of memory: refused under the address-space limit; a failed result.
#[tokio::test]
async fn a_memory_hog_fails() {
    let (db, app, id) = start().await;
    let (ok, output) = bash(
        &app,
        &id,
        "python3 -c 'b = bytearray(10 * 1024 ** 3); print(len(b))'",
    )
    .await;
    assert!(!ok, "{output}");
    assert!(output.contains("MemoryError"), "{output}");
    goes_on(&app, &id).await;
    app.cleanup(db).await;
}

/// 1 GB of output: the run is killed at sandbox.max_output_bytes; the result keeps the
/// head and tail and says why.
#[tokio::test]
async fn a_gigabyte_of_output_is_cut_off() {
    let (db, app, id) = start().await;
    let (ok, output) = bash(&app, &id, "head -c 1073741824 /dev/zero | tr '\\0' a").await;
    assert!(!ok);
    assert!(
        output.contains("output limit exceeded"),
        "{}",
        &output[output.len().saturating_sub(300)..]
    );
    assert!(
        output.len() < 100_000,
        "the kept output is capped: {}",
        output.len()
    );
    goes_on(&app, &id).await;
    app.cleanup(db).await;
}

/// The LLM key is in the server's environment; a tool sees neither it (clean environment)
/// nor the server's /proc (its own PID namespace, no /proc mounted).
#[tokio::test]
async fn secrets_of_the_server_are_out_of_reach() {
    let db = TestDb::sqlite();
    let llm = bedrock::testkit::FakeLlm::start().await;
    let workspace = crate::support::db::temp_dir("ws");
    let mut cmd = command(&db, &llm, &workspace);
    cmd.env("BEDROCK_LLM_API_KEY", "sk-server-secret-4711")
        .env("OPENAI_API_KEY", "sk-server-secret-4711")
        .env("DATABASE_PASSWORD", "db-secret-4711");
    let server = Server::start_with(cmd);
    let created = server.conversation().await;
    let id = created["id"].as_str().expect("an id").to_owned();
    llm.push([
        Llm::bash(
            "call_env",
            "env; cat /proc/self/environ /proc/1/environ; ls /proc; for p in /proc/[0-9]*; do cat $p/environ; done; cat /dev/fd/*; true",
        ),
        Llm::text("done"),
    ]);
    server.send(&id, "look around").await;
    let output = eventually("the tool result", WAIT, || async {
        let body = server.get(&format!("/conversations/{id}/messages")).await?;
        body["messages"].as_array()?.iter().find_map(|m| {
            (m["message_type"] == "tool").then(|| {
                m["content"]["output"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
        })
    })
    .await;
    assert!(output.contains("PATH="), "the tool ran: {output}");
    assert!(!output.contains("4711"), "{output}");
    assert!(!output.contains("BEDROCK_"), "{output}");
    server.terminate();
    crate::support::process::remove_workspace(&workspace);
}

/// Fail closed: where the sandbox cannot be set up (here: a user namespace in which no
/// further user namespace may be made and the tool user does not exist), `bedrock serve`
/// refuses to start and says why; with the sandbox off explicitly it starts, warns, and
/// /readyz says so.
#[tokio::test]
async fn serve_refuses_to_start_without_the_sandbox() {
    let db = TestDb::sqlite();
    let llm = bedrock::testkit::FakeLlm::start().await;
    let workspace = crate::support::db::temp_dir("ws");
    let confined = |mode: &str| {
        let inner = command(&db, &llm, &workspace);
        let mut cmd = std::process::Command::new("unshare");
        cmd.args(["--user", "--map-root-user", "sh", "-c"])
            .arg("echo 0 > /proc/sys/user/max_user_namespaces && exec \"$0\" \"$@\"")
            .arg(inner.get_program());
        cmd.env_clear();
        for (name, value) in inner.get_envs() {
            if let Some(value) = value {
                cmd.env(name, value);
            }
        }
        cmd.env("BEDROCK_SANDBOX__MODE", mode);
        cmd
    };
    let out = tokio::task::spawn_blocking({
        let mut cmd = confined("enforce");
        move || cmd.arg("serve").output()
    })
    .await
    .expect("joins")
    .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("the tool sandbox cannot start"), "{stderr}");
    assert!(stderr.contains("self-test"), "says what failed: {stderr}");
    assert!(
        stderr.contains("sandbox.mode"),
        "says how to opt out: {stderr}"
    );

    let server = Server::start_with(confined("off"));
    let logs = server.logs.lock().map(|l| l.join("\n")).unwrap_or_default();
    assert!(logs.contains("sandbox.mode is off"), "{logs}");
    let ready: Value = reqwest::get(format!("{}/readyz", server.base))
        .await
        .expect("readyz")
        .json()
        .await
        .expect("json");
    assert_eq!(ready["sandbox"]["mode"], "off", "{ready}");
    assert!(ready["sandbox"]["warning"].is_string(), "{ready}");
    server.terminate();
    crate::support::process::remove_workspace(&workspace);
}

/// /readyz reports the enforced sandbox, and only its mode: the details (Landlock ABI, the
/// tools' user) are the operator listener's /status.
#[tokio::test]
async fn readyz_reports_the_sandbox() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let ready = app.get("/readyz").await.expect(200);
    assert_eq!(
        ready["sandbox"],
        serde_json::json!({"mode": "enforce"}),
        "{ready}"
    );
    let status: Value = reqwest::get(format!("{}/status", app.metrics_base))
        .await
        .expect("status")
        .json()
        .await
        .expect("json");
    assert_eq!(status["sandbox"]["mode"], "enforce", "{status}");
    assert!(
        status["sandbox"]["landlock_abi"].as_i64().unwrap_or(0) >= 4,
        "{status}"
    );
    app.cleanup(db).await;
}
