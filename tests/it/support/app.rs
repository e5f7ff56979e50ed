//! A real server on port 0 with a fresh database and a fake LLM, and an HTTP client.

use std::path::PathBuf;
use std::time::Duration;

use bedrock::app::{Application, create_tenant};
use bedrock::config::Settings;
use bedrock::testkit::FakeLlm;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{TestDb, WAIT, eventually};

pub struct TestApp {
    pub base: String,
    pub addr: std::net::SocketAddr,
    /// The operator listener (`GET /metrics`, `GET /status`).
    pub metrics_base: String,
    pub http: reqwest::Client,
    pub llm: FakeLlm,
    pub workspace: PathBuf,
    pub db_url: String,
    /// The API key of tenant "a" (and "b" for isolation tests).
    pub key_a: String,
    pub key_b: String,
    pub shutdown: CancellationToken,
    pub server: Option<JoinHandle<anyhow::Result<()>>>,
    pub extra: Vec<(String, String)>,
}

/// A reply: status and JSON body (Null when the body is empty).
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Reply {
    #[track_caller]
    pub fn expect(self, status: u16) -> Value {
        assert_eq!(
            self.status, status,
            "unexpected status; body: {}",
            self.body
        );
        self.body
    }

    /// Asserts the contract's error shape with this status and code.
    #[track_caller]
    pub fn expect_error(self, status: u16, code: &str) -> String {
        assert_eq!(
            self.status, status,
            "unexpected status; body: {}",
            self.body
        );
        assert_eq!(
            self.body["error"]["code"], code,
            "unexpected code; body: {}",
            self.body
        );
        let message = self.body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(!message.is_empty(), "errors carry a message");
        message
    }
}

/// A node id that stays the same across restarts of the server on `workspace`.
pub fn node_id(workspace: &std::path::Path) -> String {
    let name = workspace
        .file_name()
        .map(|n| n.to_string_lossy().into_owned());
    format!("node-{}", name.unwrap_or_default())
}

fn settings_for(
    db_url: &str,
    llm: &FakeLlm,
    workspace: &std::path::Path,
    extra: &[(String, String)],
) -> Settings {
    let mut env = super::rt::base_env(db_url, llm, workspace);
    env.extend([
        ("BEDROCK_LISTEN".into(), "127.0.0.1:0".into()),
        // The operator listener, on a port of its own (many apps run in one process).
        ("BEDROCK_METRICS__LISTEN".into(), "127.0.0.1:0".into()),
        ("BEDROCK_AUTH".into(), "required".into()),
        ("BEDROCK_SERVER__SHUTDOWN_GRACE_MS".into(), "5000".into()),
        // The same node after a restart: it takes its own conversations back at once.
        ("BEDROCK_CLUSTER__NODE_ID".into(), node_id(workspace)),
    ]);
    env.extend(extra.iter().cloned());
    Settings::load_from(None, env).expect("test settings are valid")
}

impl TestApp {
    pub async fn spawn(db: &TestDb) -> TestApp {
        Self::spawn_with(db, &[]).await
    }

    pub async fn spawn_with(db: &TestDb, extra: &[(&str, &str)]) -> TestApp {
        let llm = FakeLlm::start().await;
        let workspace = super::db::temp_dir("ws");
        let extra: Vec<(String, String)> = extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let settings = settings_for(&db.url, &llm, &workspace, &extra);
        let (_, key_a) = create_tenant(&settings, "a").await.expect("tenant a");
        let (_, key_b) = create_tenant(&settings, "b").await.expect("tenant b");
        let mut app = TestApp {
            base: String::new(),
            metrics_base: String::new(),
            addr: "127.0.0.1:0".parse().expect("an address"),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .expect("a client"),
            llm,
            workspace,
            db_url: db.url.clone(),
            key_a,
            key_b,
            shutdown: CancellationToken::new(),
            server: None,
            extra,
        };
        app.start().await;
        app
    }

    /// The settings the server runs with (for the `bedrock` commands' functions).
    pub fn settings(&self) -> Settings {
        settings_for(&self.db_url, &self.llm, &self.workspace, &self.extra)
    }

    /// Starts (again) on the same database and workspace.
    pub async fn start(&mut self) {
        let settings = settings_for(&self.db_url, &self.llm, &self.workspace, &self.extra);
        let application = Application::build(settings)
            .await
            .expect("the application builds");
        self.addr = application.addr;
        self.base = format!("http://{}", application.addr);
        self.metrics_base = application
            .metrics_addr
            .map(|at| format!("http://{at}"))
            .unwrap_or_default();
        self.shutdown = application.shutdown_token();
        self.server = Some(tokio::spawn(application.run_until_stopped()));
    }

    /// Graceful shutdown; waits for the server to finish.
    pub async fn stop(&mut self) {
        self.shutdown.cancel();
        if let Some(server) = self.server.take() {
            tokio::time::timeout(WAIT, server)
                .await
                .expect("the server stops within the grace period")
                .expect("the server task ends")
                .expect("the server ends cleanly");
        }
    }

    pub async fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> Reply {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("the server answers");
        let status = response.status().as_u16();
        let text = response.text().await.expect("a body");
        let body = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        Reply { status, body }
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.request(reqwest::Method::GET, path, Some(&self.key_a), None)
            .await
    }

    pub async fn post(&self, path: &str, body: Value) -> Reply {
        self.request(reqwest::Method::POST, path, Some(&self.key_a), Some(body))
            .await
    }

    /// Sends a user message to a conversation of tenant a and expects it accepted.
    pub async fn send(&self, id: &str, text: &str) -> Value {
        self.post(
            &format!("/v1/conversations/{id}/messages"),
            json!({ "text": text }),
        )
        .await
        .expect(202)
    }

    /// The working directory of a conversation of tenant a.
    pub async fn cwd(&self, id: &str) -> PathBuf {
        let body = self
            .get(&format!("/v1/conversations/{id}"))
            .await
            .expect(200);
        PathBuf::from(body["cwd"].as_str().expect("a cwd"))
    }

    /// Waits until a tool has written `file` in the conversation's cwd.
    pub async fn written(&self, id: &str, file: &str) {
        let path = self.cwd(id).await.join(file);
        eventually("the tool to write its file", WAIT, || async {
            path.exists().then_some(())
        })
        .await
    }

    /// A new conversation of tenant a; returns its id.
    pub async fn conversation(&self) -> String {
        let body = self.post("/v1/conversations", json!({})).await.expect(201);
        body["id"].as_str().expect("an id").to_owned()
    }

    /// A new conversation of the tenant whose key is `key`; returns its id.
    pub async fn conversation_of(&self, key: &str) -> String {
        let body = self
            .request(
                reqwest::Method::POST,
                "/v1/conversations",
                Some(key),
                Some(json!({})),
            )
            .await
            .expect(201);
        body["id"].as_str().expect("an id").to_owned()
    }

    pub async fn state(&self, id: &str) -> Value {
        self.get(&format!("/v1/conversations/{id}"))
            .await
            .expect(200)["state"]
            .clone()
    }

    /// Waits for the conversation's state to be of `kind`; on timeout, fails with the state
    /// it is in and its last messages.
    pub async fn wait_kind(&self, id: &str, kind: &str) -> Value {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let state = self.state(id).await;
            if state["kind"] == kind {
                return state;
            }
            if tokio::time::Instant::now() > deadline {
                let messages = self.messages(id).await;
                let tail = &messages[messages.len().saturating_sub(4)..];
                panic!(
                    "timed out waiting for state {kind}: the state is {state}; the last messages: {}",
                    serde_json::to_string_pretty(tail).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
    }

    pub async fn messages(&self, id: &str) -> Vec<Value> {
        self.get(&format!("/v1/conversations/{id}/messages?limit=1000"))
            .await
            .expect(200)["messages"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The content of the tool result the conversation stored for `tool_use_id`.
    pub async fn tool_result(&self, id: &str, tool_use_id: &str) -> Value {
        self.messages(id)
            .await
            .into_iter()
            .find(|m| m["content"]["tool_use_id"] == tool_use_id)
            .map(|m| m["content"].clone())
            .unwrap_or_else(|| panic!("no result for {tool_use_id}"))
    }

    pub fn ws_url(&self, id: &str, query: &str) -> String {
        format!(
            "ws://{}/v1/conversations/{id}/ws?access_token={}{query}",
            self.addr, self.key_a
        )
    }

    pub async fn cleanup(mut self, db: TestDb) {
        self.stop().await;
        let _ = std::fs::remove_dir_all(&self.workspace);
        let _ = std::fs::remove_dir_all(format!("{}-data", self.workspace.display()));
        db.drop_db().await;
    }
}
