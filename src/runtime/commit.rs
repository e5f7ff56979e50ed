//! Turns one transition into one commit: the new state, the messages with their sequence
//! ids, and the durable frames with their event ids, all numbered from the conversation's
//! counters with no gaps. Used by the conversation actor and by restart recovery.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde_json::json;
use uuid::Uuid;

use crate::hub::Frame;
use crate::model::{ConversationCommit, ConversationRecord, EventRecord, MessageRecord};
use crate::state_machine::{Effect, MessageContent, TransitionResult, Usage};
use crate::wire;

/// What a transition writes, and what is done after the commit.
#[derive(Debug)]
pub struct Plan {
    /// `None` when the transition changed nothing that is stored. Shared: the persistence
    /// actor writes it while the conversation keeps it to apply once it is stored.
    pub commit: Option<Arc<ConversationCommit>>,
    /// Durable frames to publish once committed, in event-id order.
    pub frames: Vec<Arc<Frame>>,
    /// Effects to carry out after the commit.
    pub dispatch: Vec<Effect>,
}

/// Numbers the effects of `result` from `conv`'s counters.
pub fn plan(
    conv: &ConversationRecord,
    result: TransitionResult,
    context_window: u64,
    at: DateTime<Utc>,
    client_message_id: Option<String>,
) -> Plan {
    let mut next_seq = conv.next_sequence_id;
    let mut next_event = conv.next_event_id;
    let mut messages = Vec::new();
    let mut events = Vec::new();
    let mut dispatch = Vec::new();
    let mut usage_totals = None;
    let mut pending_usage: Option<Usage> = None;
    let mut client_key = client_message_id;

    let mut push_event = |payload: serde_json::Value, events: &mut Vec<EventRecord>| {
        let event_id = next_event;
        next_event += 1;
        let mut payload = payload;
        if let Some(object) = payload.as_object_mut() {
            object.insert("event_id".into(), json!(event_id));
        }
        events.push(EventRecord {
            conversation_id: conv.id.clone(),
            event_id,
            event_type: payload["type"].as_str().unwrap_or_default().to_owned(),
            payload,
            dedup_key: None,
            created_at: at,
        });
    };

    for effect in result.effects {
        match effect {
            Effect::PersistMessage(content) => {
                // An LLM response's usage belongs to the agent message it produced; a client's
                // idempotency key to the user message it sent.
                let usage = matches!(content, MessageContent::Agent { .. })
                    .then(|| pending_usage.take())
                    .flatten();
                let client_message_id = matches!(content, MessageContent::User { .. })
                    .then(|| client_key.take())
                    .flatten();
                let message = MessageRecord {
                    id: Uuid::now_v7().to_string(),
                    conversation_id: conv.id.clone(),
                    sequence_id: next_seq,
                    content,
                    usage,
                    client_message_id,
                    created_at: at,
                };
                next_seq += 1;
                push_event(
                    json!({"type": "message", "message": wire::message(&message, context_window)}),
                    &mut events,
                );
                messages.push(message);
            }
            Effect::RecordUsage { usage } => {
                pending_usage = Some(usage);
                usage_totals = Some(usage_totals.unwrap_or(conv.usage).plus(usage));
            }
            Effect::NotifyRetrying {
                attempt,
                delay_ms,
                error_kind,
            } => push_event(
                json!({
                    "type": "retrying",
                    "attempt": attempt,
                    "delay_ms": delay_ms,
                    "error_kind": error_kind.as_str(),
                }),
                &mut events,
            ),
            Effect::WarnContext {
                context_tokens,
                context_window,
                ratio,
            } => push_event(
                json!({
                    "type": "context_warning",
                    "context_tokens": context_tokens,
                    "context_window": context_window,
                    "ratio": ratio,
                }),
                &mut events,
            ),
            other @ (Effect::Continue { .. }
            | Effect::RequestLlm { .. }
            | Effect::AbortLlm { .. }
            | Effect::ScheduleRetry { .. }
            | Effect::ExecuteTool { .. }
            | Effect::CancelTool { .. }
            | Effect::SpawnSubAgents { .. }
            | Effect::StopSubAgents { .. }
            | Effect::ReportToParent { .. }) => dispatch.push(other),
        }
    }
    let state_changed = result.new_state != conv.state;
    if wire::state(&result.new_state) != wire::state(&conv.state) {
        push_event(
            json!({"type": "state", "state": wire::state(&result.new_state)}),
            &mut events,
        );
    }
    let frames = events
        .iter()
        .map(|e| Arc::new(Frame::from_value(&e.payload)))
        .collect();
    let commit =
        (state_changed || !messages.is_empty() || !events.is_empty() || usage_totals.is_some())
            .then(|| {
                Arc::new(ConversationCommit {
                    conversation_id: conv.id.clone(),
                    state: state_changed.then(|| result.new_state.clone()),
                    messages,
                    events,
                    usage: usage_totals,
                    expected_next_sequence_id: conv.next_sequence_id,
                    expected_next_event_id: conv.next_event_id,
                    next_sequence_id: next_seq,
                    next_event_id: next_event,
                    at,
                })
            });
    Plan {
        commit,
        frames,
        dispatch,
    }
}

/// A commit of durable frames alone (client requests, system events), numbered from `conv`'s
/// counters. `frames` are `(payload without event_id, dedup key)`.
pub fn plan_frames(
    conv: &ConversationRecord,
    frames: Vec<(serde_json::Value, Option<String>)>,
    at: DateTime<Utc>,
) -> Plan {
    let mut next_event = conv.next_event_id;
    let mut events = Vec::with_capacity(frames.len());
    for (mut payload, dedup_key) in frames {
        if let Some(object) = payload.as_object_mut() {
            object.insert("event_id".into(), json!(next_event));
        }
        events.push(EventRecord {
            conversation_id: conv.id.clone(),
            event_id: next_event,
            event_type: payload["type"].as_str().unwrap_or_default().to_owned(),
            payload,
            dedup_key,
            created_at: at,
        });
        next_event += 1;
    }
    let frames = events
        .iter()
        .map(|e| Arc::new(Frame::from_value(&e.payload)))
        .collect();
    Plan {
        commit: (!events.is_empty()).then(|| {
            Arc::new(ConversationCommit {
                conversation_id: conv.id.clone(),
                state: None,
                messages: Vec::new(),
                events,
                usage: None,
                expected_next_sequence_id: conv.next_sequence_id,
                expected_next_event_id: conv.next_event_id,
                next_sequence_id: conv.next_sequence_id,
                next_event_id: next_event,
                at,
            })
        }),
        frames,
        dispatch: Vec::new(),
    }
}

/// Brings the in-memory record up to date after `commit` was stored.
pub fn apply(conv: &mut ConversationRecord, commit: &ConversationCommit) {
    if let Some(state) = &commit.state {
        conv.state = state.clone();
    }
    if let Some(usage) = commit.usage {
        conv.usage = usage;
    }
    conv.next_sequence_id = commit.next_sequence_id;
    conv.next_event_id = commit.next_event_id;
    conv.updated_at = commit.at;
}
