//! A WebSocket test client that reads frames with a deadline.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tokio_tungstenite::tungstenite::Message;

pub type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

pub struct Ws {
    pub socket: Socket,
}

/// What the next read produced.
#[derive(Debug)]
pub enum Next {
    Frame(Value),
    Closed(Option<u16>, String),
}

impl Ws {
    pub async fn connect(url: &str) -> Ws {
        let (socket, _) = tokio_tungstenite::connect_async(url)
            .await
            .expect("the WebSocket connects");
        Ws { socket }
    }

    pub async fn send(&mut self, value: &Value) {
        self.socket
            .send(Message::Text(value.to_string().into()))
            .await
            .expect("a frame is sent");
    }

    pub async fn send_text(&mut self, text: &str) {
        self.socket
            .send(Message::Text(text.to_owned().into()))
            .await
            .expect("a frame is sent");
    }

    pub async fn next(&mut self, timeout: Duration) -> Option<Next> {
        loop {
            let message = tokio::time::timeout(timeout, self.socket.next())
                .await
                .ok()??;
            match message {
                Ok(Message::Text(text)) => {
                    return Some(Next::Frame(
                        serde_json::from_str(&text).expect("JSON frames"),
                    ));
                }
                Ok(Message::Close(frame)) => {
                    return Some(Next::Closed(
                        frame.as_ref().map(|f| u16::from(f.code)),
                        frame.map(|f| f.reason.to_string()).unwrap_or_default(),
                    ));
                }
                Ok(_) => continue,
                Err(_) => return Some(Next::Closed(None, "connection error".into())),
            }
        }
    }

    /// The next frame, failing the test on a close or a timeout.
    pub async fn frame(&mut self) -> Value {
        match self.next(super::WAIT).await {
            Some(Next::Frame(frame)) => frame,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    /// Frames until one satisfies `until` (inclusive).
    pub async fn frames_until(&mut self, until: impl Fn(&Value) -> bool) -> Vec<Value> {
        let mut frames = Vec::new();
        loop {
            let frame = self.frame().await;
            let done = until(&frame);
            frames.push(frame);
            if done {
                return frames;
            }
        }
    }

    /// The next frame of `kind` (its `type`), skipping others.
    pub async fn frame_of(&mut self, kind: &str) -> Value {
        let frames = self.frames_until(|f| f["type"] == kind).await;
        frames
            .into_iter()
            .next_back()
            .expect("frames_until ends with a match")
    }
}

/// Whether a frame is the state frame of `kind`.
pub fn is_state(frame: &Value, kind: &str) -> bool {
    frame["type"] == "state" && frame["state"]["kind"] == kind
}
