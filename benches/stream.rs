//! Frame delivery to 1,000 connected WebSocket clients (the API issue): 10 conversations with
//! 100 clients each, 100 frames/s per conversation = 100,000 deliveries/s, plus one client
//! that never reads. Prints the delivery latency p50/p99 from the frames' own timestamps.
//!
//!     cargo bench --bench stream            (BENCH_SECONDS=5 by default)

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bedrock::app::Application;
use bedrock::config::Settings;
use bedrock::hub::Frame;
use bedrock::testkit::FakeLlm;
use common::{BenchDb, ms, percentile, seconds};
use futures::StreamExt;
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;

const CONVERSATIONS: usize = 10;
const CLIENTS_PER_CONVERSATION: usize = 100;
const FRAMES_PER_SECOND: u64 = 100;

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[tokio::main]
async fn main() {
    bedrock::install_crypto();
    let duration = seconds();
    let db = BenchDb::sqlite();
    let llm = FakeLlm::start().await;
    let workspace = std::env::temp_dir().join(format!(
        "bedrock-bench-ws-{}",
        uuid::Uuid::now_v7().simple()
    ));
    let mut env: Vec<(String, String)> = common::OPEN_QUOTAS
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    env.extend([
        ("BEDROCK_LISTEN".into(), "127.0.0.1:0".into()),
        ("BEDROCK_METRICS__LISTEN".into(), "off".into()),
        ("BEDROCK_AUTH".into(), "dev".into()),
        ("BEDROCK_DATABASE_URL".into(), db.url.clone()),
        ("BEDROCK_LLM_BASE_URL".into(), llm.base_url.clone()),
        (
            "BEDROCK_WORKSPACE_ROOT".into(),
            workspace.display().to_string(),
        ),
        (
            "BEDROCK_CONVERSATIONS__IDLE_TIMEOUT_MS".into(),
            "3600000".into(),
        ),
    ]);
    let app = Application::build(Settings::load_from(None, env).unwrap())
        .await
        .unwrap();
    let addr = app.addr;
    let hub = app.runtime.hub.clone();
    let token = app.shutdown_token();
    let server = tokio::spawn(app.run_until_stopped());
    let http = reqwest::Client::new();
    let mut conversations = Vec::new();
    for _ in 0..CONVERSATIONS {
        let created: serde_json::Value = http
            .post(format!("http://{addr}/v1/conversations"))
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        conversations.push(created["id"].as_str().unwrap().to_owned());
    }
    // One client that connects and never reads.
    let (slow, _) = tokio_tungstenite::connect_async(format!(
        "ws://{addr}/v1/conversations/{}/ws",
        conversations[0]
    ))
    .await
    .unwrap();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut clients = Vec::new();
    for conversation in &conversations {
        for _ in 0..CLIENTS_PER_CONVERSATION {
            // Clients read with a small buffer, as the server does: tungstenite zero-fills
            // the whole read buffer before every read.
            let (socket, _) = tokio_tungstenite::connect_async_with_config(
                format!("ws://{addr}/v1/conversations/{conversation}/ws"),
                Some(
                    tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
                        .read_buffer_size(4096),
                ),
                false,
            )
            .await
            .unwrap();
            let mut stop = stop_rx.clone();
            clients.push(tokio::spawn(async move {
                let (_sink, mut stream) = socket.split();
                let mut latencies = Vec::new();
                loop {
                    let message = tokio::select! {
                        _ = stop.changed() => break,
                        message = stream.next() => match message {
                            Some(Ok(message)) => message,
                            _ => break,
                        },
                    };
                    if let Message::Text(text) = message
                        && let Some(at) = text.find("\"t\":")
                    {
                        let digits: String = text[at + 4..]
                            .chars()
                            .take_while(char::is_ascii_digit)
                            .collect();
                        if let Ok(sent) = digits.parse::<u64>() {
                            latencies.push(Duration::from_nanos(now_nanos().saturating_sub(sent)));
                        }
                    }
                }
                latencies
            }));
        }
    }
    // Let every client get its snapshot first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let mut published = 0u64;
    let mut tick = tokio::time::interval(Duration::from_nanos(1_000_000_000 / FRAMES_PER_SECOND));
    let text = "x".repeat(64);
    while started.elapsed() < duration {
        tick.tick().await;
        for conversation in &conversations {
            let frame = json!({"type": "delta", "text": text, "t": now_nanos()});
            hub.publish(
                conversation,
                Arc::new(Frame::new("delta", None, frame.to_string().into())),
            );
            published += 1;
        }
    }
    let elapsed = started.elapsed();
    // Let the last frames arrive, then stop the clients.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = stop_tx.send(true);
    let mut all = Vec::new();
    for client in clients {
        all.extend(client.await.unwrap());
    }
    all.sort();
    let expected = published * CLIENTS_PER_CONVERSATION as u64;
    println!(
        "# stream: {} WebSocket clients, {} frames/s per conversation, {} conversations",
        CONVERSATIONS * CLIENTS_PER_CONVERSATION,
        FRAMES_PER_SECOND,
        CONVERSATIONS
    );
    println!(
        "deliveries: {} of {} ({:.0}/s)",
        all.len(),
        expected,
        all.len() as f64 / elapsed.as_secs_f64()
    );
    println!(
        "delivery latency: p50 {} p99 {} max {}",
        ms(percentile(&all, 50.0)),
        ms(percentile(&all, 99.0)),
        ms(all.last().copied().unwrap_or_default())
    );
    drop(slow);
    token.cancel();
    let _ = server.await;
    let _ = std::fs::remove_dir_all(&workspace);
    db.drop_db().await;
}
