//! Tenants' webhooks (docs/api.md, "Webhooks"; issue 39): a backend with no open socket is
//! told when a turn ends, a request waits or a budget is spent.
//!
//! An event is written to the outbox in the transaction of the change that caused it: a
//! turn's end with the conversation's commit (runtime/conversation.rs), a request to the
//! client with its row. Only tenants with an enabled endpoint write events ([`Subscribers`],
//! read without I/O on the commit path). The dispatcher (dispatch.rs) fans the outbox out
//! into deliveries, claims due ones, and sends each signed as Standard Webhooks sign, under
//! the egress policy, retrying with backoff until it is answered with a 2xx or runs out.

mod dispatch;

pub use dispatch::{Dispatcher, retry_delay_ms};

use std::collections::HashSet;
use std::sync::RwLock;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use serde_json::json;

use crate::model::OutboxEvent;
use crate::state_machine::{ErrorKind, TurnEnd, TurnOutcome};
use crate::store::Store;

/// The events an endpoint may subscribe to.
pub const EVENTS: [&str; 6] = [
    TURN_COMPLETED,
    TURN_FAILED,
    TURN_CANCELLED,
    REQUEST_CREATED,
    CONTEXT_EXHAUSTED,
    BUDGET_EXHAUSTED,
];
pub const TURN_COMPLETED: &str = "turn.completed";
pub const TURN_FAILED: &str = "turn.failed";
pub const TURN_CANCELLED: &str = "turn.cancelled";
pub const REQUEST_CREATED: &str = "request.created";
pub const CONTEXT_EXHAUSTED: &str = "conversation.context_exhausted";
pub const BUDGET_EXHAUSTED: &str = "budget.exhausted";

/// The most of an error's message an event carries.
const MAX_MESSAGE_BYTES: usize = 1000;

/// The tenants that have an enabled endpoint: only their conversations write events. Kept
/// in memory (a commit reads it with no I/O), refreshed by the dispatcher every second and
/// at once when an endpoint is made on this node.
#[derive(Debug, Default)]
pub struct Subscribers {
    tenants: RwLock<HashSet<String>>,
    /// Outbox rows were written on this node: the dispatcher looks now.
    wake: tokio::sync::Notify,
}

impl Subscribers {
    /// The tenants with endpoints, as stored.
    pub async fn load(store: &Store) -> crate::store::Result<Subscribers> {
        let subscribers = Subscribers::default();
        subscribers.replace(store.webhook_tenants().await?);
        Ok(subscribers)
    }

    /// Whether the tenant has an enabled endpoint.
    pub fn has(&self, tenant_id: &str) -> bool {
        self.tenants
            .read()
            .is_ok_and(|tenants| tenants.contains(tenant_id))
    }

    /// No tenant has an enabled endpoint.
    pub fn is_empty(&self) -> bool {
        self.tenants.read().is_ok_and(|tenants| tenants.is_empty())
    }

    pub fn add(&self, tenant_id: &str) {
        if let Ok(mut tenants) = self.tenants.write() {
            tenants.insert(tenant_id.to_owned());
        }
    }

    pub fn replace(&self, now: Vec<String>) {
        if let Ok(mut tenants) = self.tenants.write() {
            *tenants = now.into_iter().collect();
        }
    }

    /// Events were stored: the dispatcher fans them out now, not at its next poll.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    pub(crate) async fn woken(&self) {
        self.wake.notified().await;
    }
}

/// The events of a turn's end: its outcome, and a spent budget or an exhausted context
/// besides. `event_id` is the conversation's last durable frame once the end is stored (a
/// client resumes its stream after it).
pub fn turn_events(
    tenant_id: &str,
    conversation_id: &str,
    end: &TurnEnd,
    event_id: i64,
    at: DateTime<Utc>,
) -> Vec<OutboxEvent> {
    let mut data = json!({
        "conversation_id": conversation_id,
        "turn_id": end.turn.0,
        "event_id": event_id,
    });
    let event = |event_type: &'static str, data: &serde_json::Value| OutboxEvent {
        tenant_id: tenant_id.to_owned(),
        conversation_id: conversation_id.to_owned(),
        event_type,
        payload: data.to_string(),
        at,
    };
    match &end.outcome {
        TurnOutcome::Completed => {
            data["state"] = json!("idle");
            vec![event(TURN_COMPLETED, &data)]
        }
        TurnOutcome::Cancelled => {
            data["state"] = json!("idle");
            vec![event(TURN_CANCELLED, &data)]
        }
        TurnOutcome::ContextExhausted => {
            data["state"] = json!("context_exhausted");
            vec![
                event(TURN_COMPLETED, &data),
                event(CONTEXT_EXHAUSTED, &data),
            ]
        }
        TurnOutcome::Failed {
            error_kind,
            message,
        } => {
            data["state"] = json!("error");
            data["error_kind"] = serde_json::to_value(error_kind).unwrap_or_default();
            data["message"] = json!(crate::tools::preview(message, MAX_MESSAGE_BYTES));
            let mut events = vec![event(TURN_FAILED, &data)];
            if *error_kind == ErrorKind::Budget {
                events.push(event(BUDGET_EXHAUSTED, &data));
            }
            events
        }
    }
}

/// The event of a request to the client (an approval, a question, a client tool's call):
/// `kind` is its type (`confirm`, `prompt`, `select`, `custom`, `client_tool`).
pub fn request_created(
    tenant_id: &str,
    conversation_id: &str,
    request_id: &str,
    kind: &str,
    tool_use_id: &str,
    at: DateTime<Utc>,
) -> OutboxEvent {
    OutboxEvent {
        tenant_id: tenant_id.to_owned(),
        conversation_id: conversation_id.to_owned(),
        event_type: REQUEST_CREATED,
        payload: json!({
            "conversation_id": conversation_id,
            "request_id": request_id,
            "kind": kind,
            "tool_use_id": tool_use_id,
        })
        .to_string(),
        at,
    }
}

/// A new signing secret: `whsec_` and the base64 of 32 random bytes (Standard Webhooks'
/// form).
pub fn new_secret() -> String {
    let key: [u8; 32] = rand::random();
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(key)
    )
}

/// The HMAC key of a secret: a Standard Webhooks `whsec_` secret's base64 (at least 16
/// bytes of key), or the secret's bytes. `None` for a `whsec_` secret that is not base64
/// or holds less.
pub fn hook_key(secret: &str) -> Option<Vec<u8>> {
    match secret.strip_prefix("whsec_") {
        Some(encoded) => base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .ok()
            .filter(|key| key.len() >= 16),
        None => Some(secret.as_bytes().to_vec()),
    }
}

/// The `webhook-signature` of `body` sent as message `id` at `timestamp` (seconds).
pub fn signature(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    let Ok(mut mac) = Hmac::<sha2::Sha256>::new_from_slice(key) else {
        return String::new();
    };
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state_machine::TurnId;

    /// The signature of Standard Webhooks' own example (its specification's test vector).
    #[test]
    fn signatures_are_standard_webhooks() {
        let key = hook_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").expect("a key");
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            signature(&key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        assert_eq!(hook_key("whsec_!!"), None);
        assert_eq!(hook_key("whsec_c2hvcnQ="), None);
        assert_eq!(
            hook_key("plain-secret-16b"),
            Some(b"plain-secret-16b".to_vec())
        );
        let secret = new_secret();
        assert_eq!(hook_key(&secret).map(|k| k.len()), Some(32));
        assert_ne!(secret, new_secret());
    }

    #[test]
    fn a_turns_end_makes_its_events_small_and_without_secrets() {
        let at = DateTime::from_timestamp(1_800_000_000, 0).expect("a time");
        let end = |outcome| TurnEnd {
            turn: TurnId::new("t1"),
            outcome,
        };
        let types = |events: Vec<OutboxEvent>| -> Vec<&'static str> {
            events.iter().map(|e| e.event_type).collect()
        };
        assert_eq!(
            types(turn_events("t", "c", &end(TurnOutcome::Completed), 7, at)),
            [TURN_COMPLETED]
        );
        assert_eq!(
            types(turn_events("t", "c", &end(TurnOutcome::Cancelled), 7, at)),
            [TURN_CANCELLED]
        );
        assert_eq!(
            types(turn_events(
                "t",
                "c",
                &end(TurnOutcome::ContextExhausted),
                7,
                at
            )),
            [TURN_COMPLETED, CONTEXT_EXHAUSTED]
        );
        let failed = turn_events(
            "t",
            "c",
            &end(TurnOutcome::Failed {
                error_kind: ErrorKind::Budget,
                message: "x".repeat(5000),
            }),
            7,
            at,
        );
        assert_eq!(types(failed.clone()), [TURN_FAILED, BUDGET_EXHAUSTED]);
        let data: serde_json::Value = serde_json::from_str(&failed[0].payload).expect("JSON");
        assert_eq!(data["error_kind"], "budget");
        assert_eq!(data["state"], "error");
        assert_eq!(data["event_id"], 7);
        assert_eq!(data["turn_id"], "t1");
        assert!(
            failed[0].payload.len() < 1200,
            "{}",
            failed[0].payload.len()
        );
    }
}
