//! Shared by the benches that run `bedrock serve` as a process and drive it over HTTP and
//! WebSocket (e2e, cluster): the server process, and reading a turn off a WebSocket.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;
use tokio_tungstenite::tungstenite::Message;

pub type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Waits on the WebSocket for the state that ends the turn of the user message `ours`
/// picks out, and checks the answer (`done: <text>`, the fake's auto tool turns).
pub async fn answer(
    socket: &mut Socket,
    text: &str,
    ours: impl Fn(&Value) -> bool,
) -> Result<(), String> {
    let expected = format!("done: {text}");
    let (mut seen_ours, mut answered) = (false, false);
    loop {
        let frame = next_frame(socket).await?;
        match frame["type"].as_str() {
            Some("message") if !seen_ours && ours(&frame["message"]) => seen_ours = true,
            Some("message")
                if seen_ours
                    && frame["message"]["message_type"] == "agent"
                    && frame["message"]["content"]["tool_uses"]
                        .as_array()
                        .is_some_and(Vec::is_empty) =>
            {
                if frame["message"]["content"]["text"] != expected.as_str() {
                    return Err(format!("wrong answer: {frame}"));
                }
                answered = true;
            }
            Some("state") if seen_ours => match frame["state"]["kind"].as_str() {
                Some("idle") if answered => return Ok(()),
                Some("idle" | "error") => return Err(format!("the turn ended: {frame}")),
                _ => {}
            },
            Some("rejected") => return Err(format!("refused: {frame}")),
            _ => {}
        }
    }
}

/// The next text frame, as JSON; an error after 60 s without one or when the socket closes.
pub async fn next_frame(socket: &mut Socket) -> Result<Value, String> {
    loop {
        match tokio::time::timeout(Duration::from_secs(60), socket.next()).await {
            Err(_) => return Err("no frame for 60 s".into()),
            Ok(None) => return Err("the WebSocket closed".into()),
            Ok(Some(Err(e))) => return Err(format!("WebSocket: {e}")),
            Ok(Some(Ok(Message::Text(text)))) => {
                return serde_json::from_str(&text).map_err(|e| e.to_string());
            }
            Ok(Some(Ok(_))) => {}
        }
    }
}

/// A child process of ours, killed (by its own pid) when dropped.
pub struct Owned(pub Child);

impl Drop for Owned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `bedrock serve` as a child process.
pub struct ServerProcess {
    pub process: Owned,
    pub base: String,
    /// The operator listener (`GET /metrics`), on a port of its own.
    pub metrics_base: String,
}

impl ServerProcess {
    /// Starts the release binary on `db_url` with the fake LLM at `llm_base`, its
    /// workspaces under `workspace` and its data in `workspace`/data, on a free loopback
    /// port; `env` are further settings. Settings given to the bench as `BEDROCK_*`
    /// variables reach it too (those here win). `BENCH_SERVER_WRAP`: a command it runs under
    /// (e.g. `heaptrack -o /tmp/h`; CPU and RSS figures are then the wrapper's).
    pub fn start(
        db_url: &str,
        llm_base: &str,
        workspace: &Path,
        env: &[(&str, String)],
    ) -> ServerProcess {
        std::fs::create_dir_all(workspace).unwrap();
        let wrap = std::env::var("BENCH_SERVER_WRAP").unwrap_or_default();
        let mut words = wrap.split_whitespace();
        let mut command = match words.next() {
            Some(wrapper) => {
                let mut command = Command::new(wrapper);
                command.args(words).arg(env!("CARGO_BIN_EXE_bedrock"));
                command
            }
            None => Command::new(env!("CARGO_BIN_EXE_bedrock")),
        };
        let settings = std::env::vars().filter(|(name, _)| {
            name.starts_with("BEDROCK_") && name != "BEDROCK_TEST_DATABASE_URL"
        });
        let mut child = command
            .arg("serve")
            .env_clear()
            .envs(super::OPEN_QUOTAS)
            .envs(settings)
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("BEDROCK_DATABASE_URL", db_url)
            .env("BEDROCK_LLM_BASE_URL", llm_base)
            .env("BEDROCK_LLM_API_KEY", "k")
            .env("BEDROCK_WORKSPACE_ROOT", workspace.join("ws"))
            .env("BEDROCK_DATA_DIR", workspace.join("data"))
            .env("BEDROCK_AUTH", "dev")
            .env("BEDROCK_LISTEN", "127.0.0.1:0")
            .env("BEDROCK_METRICS__LISTEN", "127.0.0.1:0")
            .env("BEDROCK_LOG_FORMAT", "json")
            .envs(env.iter().map(|(name, value)| (name, value)))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut told = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if !told
                    && let Ok(value) = serde_json::from_str::<Value>(&line)
                    && let Some(addr) = value["fields"]["addr"].as_str()
                {
                    let metrics = value["fields"]["metrics_addr"].as_str().unwrap_or_default();
                    let _ = tx.send((addr.to_owned(), metrics.to_owned()));
                    told = true;
                } else if line.contains("\"ERROR\"") {
                    eprintln!("server: {line}");
                }
            }
        });
        let (addr, metrics) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the server logs its address");
        ServerProcess {
            process: Owned(child),
            base: format!("http://{addr}"),
            metrics_base: format!("http://{metrics}"),
        }
    }

    pub fn pid(&self) -> u32 {
        self.process.0.id()
    }

    /// SIGTERM to our own child, then waits for it.
    pub fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.pid()).unwrap());
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let _ = self.process.0.wait();
    }

    /// SIGKILL to our own child, then waits for it.
    pub fn kill(mut self) {
        let _ = self.process.0.kill();
        let _ = self.process.0.wait();
    }
}

/// The process's CPU time so far, user and system (all threads), from /proc.
pub fn cpu_time(pid: u32) -> (Duration, Duration) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    let time =
        |field: &str| Duration::from_secs_f64(field.parse::<u64>().unwrap() as f64 / per_second);
    (time(fields[11]), time(fields[12]))
}

/// The fake LLM as a process of its own (the benches' `fake-llm` role): serves it on a
/// loopback port, asking for one `think` call per turn, prints its base URL, and runs until
/// stdin closes (the conductor going away, whatever the way).
pub fn serve_fake_llm() {
    serve_fake_llm_and(false);
}

/// [`serve_fake_llm`], and with `receiver` a webhook receiver too that answers every
/// delivery with a 200: its URL is the second line printed.
pub fn serve_fake_llm_and(receiver: bool) {
    use std::io::Write as _;
    bedrock::install_crypto();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async move {
            let llm = bedrock::testkit::FakeLlm::start().await;
            llm.forget_requests();
            llm.auto_tool_turns(
                "think",
                serde_json::json!({"thoughts": "one tool call per turn"}),
            );
            println!("{}", llm.base_url);
            if receiver {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                println!("http://{}/hook", listener.local_addr().unwrap());
                let router =
                    axum::Router::new().route("/hook", axum::routing::post(|| async { "ok" }));
                tokio::spawn(async move { axum::serve(listener, router).await });
            }
            std::io::stdout().flush().unwrap();
            tokio::task::spawn_blocking(|| {
                let mut line = String::new();
                while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {}
            })
            .await
            .unwrap();
        });
}
