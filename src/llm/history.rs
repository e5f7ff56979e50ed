//! A conversation's history as the backend gets it, kept between its LLM steps so a step
//! reads only the messages added since the last one. The conversation actor owns it (a
//! [`HistoryHandle`] it hands to every request), so it lives exactly as long as the
//! conversation is activated and goes when it passivates. Messages are append-only and
//! numbered, so "every message after the last sequence id held" is always the rest. Each is
//! held in its wire form (request.rs), made once.
//!
//! The bytes all histories hold are counted; past `llm.history_cache_bytes` a history is
//! emptied after its request, and its next request reads it back from the database.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use super::request::{Wire, starts_turn, wire};
use crate::config::Provider;
use crate::metrics::Metrics;
use crate::model::ConversationCommit;

/// A conversation's history as the backend gets it.
#[derive(Debug, Default)]
pub struct History {
    /// The sequence id of the last message held (0: none).
    last: i64,
    pub messages: Vec<Wire>,
    /// Where the turn in progress starts in `messages`: after the last user-role message.
    pub turn_from: usize,
    /// The bytes `messages` holds, as counted in [`Held`].
    bytes: usize,
    held: Option<Arc<Held>>,
    /// The API its pieces are in.
    provider: Provider,
}

impl History {
    fn push(&mut self, content: &crate::state_machine::MessageContent) {
        let piece = match self.provider {
            Provider::Openai => wire(content),
            Provider::Anthropic => super::anthropic::wire(content),
        };
        self.bytes += piece.bytes();
        self.messages.push(piece);
        if starts_turn(content) {
            self.turn_from = self.messages.len();
        }
    }

    /// Forgets every message (and its bytes); the next request reads them back.
    fn clear(&mut self) {
        if let Some(held) = &self.held {
            held.release(self.bytes);
        }
        self.last = 0;
        self.messages = Vec::new();
        self.turn_from = 0;
        self.bytes = 0;
    }
}

impl Drop for History {
    fn drop(&mut self) {
        if let Some(held) = &self.held {
            held.release(self.bytes);
        }
    }
}

/// The bytes every history of the process holds.
#[derive(Debug)]
pub struct Held {
    bytes: AtomicUsize,
    budget: usize,
}

impl Held {
    pub fn new(budget: usize) -> Arc<Held> {
        Arc::new(Held {
            bytes: AtomicUsize::new(0),
            budget,
        })
    }

    fn add(&self, bytes: usize) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn release(&self, bytes: usize) {
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// The bytes held now.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// A conversation's history, owned by its actor and lent to each of its LLM requests.
pub type HistoryHandle = Arc<AsyncMutex<History>>;

/// A new, empty history for a conversation.
pub fn new_history() -> HistoryHandle {
    Arc::default()
}

/// The conversation's whole history through sequence id `through` (its last stored
/// message), held until the guard drops (a conversation has one LLM request at a time, so
/// this never waits on another). Messages the conversation handed over in `recent` (stored
/// commits, in order) are taken from there; the database is read only for what they do not
/// cover: a history that was never filled or was emptied, or messages stored while no
/// actor was running.
// The request's parts, each needed; bundling them would only rename them.
#[allow(clippy::too_many_arguments)]
pub async fn current(
    handle: &HistoryHandle,
    held: &Arc<Held>,
    records: &dyn super::Records,
    metrics: &Metrics,
    id: &str,
    recent: &[Arc<ConversationCommit>],
    through: i64,
    provider: Provider,
) -> Result<OwnedMutexGuard<History>, String> {
    let mut history = Arc::clone(handle).lock_owned().await;
    if history.held.is_none() {
        history.held = Some(Arc::clone(held));
    }
    // Pieces are made for one API (a conversation's model, and so its provider, is fixed;
    // a changed configuration starts over).
    if history.provider != provider {
        history.clear();
        history.provider = provider;
    }
    let before = history.bytes;
    for message in recent.iter().flat_map(|commit| &commit.messages) {
        if message.sequence_id == history.last + 1 {
            history.push(&message.content);
            history.last = message.sequence_id;
        } else if message.sequence_id > history.last {
            break; // a gap: the database has what came between
        }
    }
    if history.last < through {
        metrics.history_read();
        let newer = records.messages_after(id, history.last).await?;
        if let Some(last) = newer.last() {
            history.last = last.sequence_id;
        }
        for record in &newer {
            history.push(&record.content);
        }
    }
    held.add(history.bytes - before);
    Ok(history)
}

/// Called once a request is done with the history: over the process's budget, it is
/// emptied (its next request reads it back).
pub fn settle(history: &mut History, held: &Held) {
    if held.bytes() > held.budget {
        history.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::MessageRecord;
    use crate::state_machine::MessageContent;
    use std::sync::Mutex;
    use std::sync::atomic::AtomicBool;

    use chrono::{DateTime, Utc};
    use futures::future::BoxFuture;

    fn at() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap_or_default()
    }

    /// Stored messages of conversation `c`, as the runtime's records read them; once
    /// closed, a read fails (as the store's would after its pool is closed).
    #[derive(Debug, Default)]
    struct Recorded {
        messages: Mutex<Vec<MessageRecord>>,
        closed: AtomicBool,
    }

    impl super::super::Records for Recorded {
        fn messages_after<'a>(
            &'a self,
            _conversation_id: &'a str,
            after: i64,
        ) -> BoxFuture<'a, Result<Vec<MessageRecord>, String>> {
            Box::pin(async move {
                if self.closed.load(Ordering::Relaxed) {
                    return Err("closed".to_owned());
                }
                let messages = self.messages.lock().map_err(|e| e.to_string())?;
                Ok(messages
                    .iter()
                    .filter(|m| m.sequence_id > after)
                    .cloned()
                    .collect())
            })
        }

        fn image<'a>(&'a self, _: &'a str, _: &'a str) -> BoxFuture<'a, Option<(String, Vec<u8>)>> {
            Box::pin(async { None })
        }
    }

    fn user(seq: i64) -> MessageRecord {
        MessageRecord {
            id: format!("m{seq}"),
            conversation_id: "c".into(),
            sequence_id: seq,
            content: MessageContent::User {
                text: format!("message {seq}"),
                images: Vec::new(),
            },
            usage: None,
            client_message_id: None,
            created_at: at(),
        }
    }

    /// Stores messages `from..=to` of conversation `c` as one commit.
    fn store_messages(store: &Recorded, from: i64, to: i64) -> Arc<ConversationCommit> {
        let commit = Arc::new(ConversationCommit {
            conversation_id: "c".into(),
            state: None,
            messages: (from..=to).map(user).collect(),
            events: Vec::new(),
            usage: None,
            expected_next_sequence_id: from,
            expected_next_event_id: 1,
            next_sequence_id: to + 1,
            next_event_id: 1,
            at: at(),
            lease: None,
            deliveries: Vec::new(),
            steps: Vec::new(),
        });
        if let Ok(mut messages) = store.messages.lock() {
            messages.extend(commit.messages.iter().cloned());
        }
        commit
    }

    fn texts(history: &History) -> Vec<String> {
        history
            .messages
            .iter()
            .map(|m| match m {
                Wire::Json(json) => json.get().to_owned(),
                other @ (Wire::Skip | Wire::Images(_) | Wire::Thought { .. }) => {
                    format!("{other:?}")
                }
            })
            .collect()
    }

    /// The history is the same whether it comes from the commits the conversation hands
    /// over or from the database, and the records are read only for what those commits do
    /// not cover (once they are closed, a read fails).
    #[tokio::test]
    async fn handed_over_messages_spare_the_database_read() {
        let store = Recorded::default();
        let (held, metrics) = (Held::new(usize::MAX), Metrics::default());
        let (mine, reference) = (new_history(), new_history());
        store_messages(&store, 1, 2);
        // Cold: read from the database.
        let first = texts(
            &current(
                &mine,
                &held,
                &store,
                &metrics,
                "c",
                &[],
                2,
                Provider::Openai,
            )
            .await
            .expect("read"),
        );
        assert_eq!(first.len(), 2);

        let recent = store_messages(&store, 3, 4);
        let from_db = texts(
            &current(
                &reference,
                &held,
                &store,
                &metrics,
                "c",
                &[],
                4,
                Provider::Openai,
            )
            .await
            .expect("read"),
        );
        let stored = store_messages(&store, 5, 6);
        let gap = Arc::new(ConversationCommit {
            messages: vec![user(6)],
            ..(*stored).clone()
        });
        store.closed.store(true, Ordering::Relaxed);

        let handed = texts(
            &current(
                &mine,
                &held,
                &store,
                &metrics,
                "c",
                std::slice::from_ref(&recent),
                4,
                Provider::Openai,
            )
            .await
            .expect("no database read needed"),
        );
        assert_eq!(handed, from_db);
        // Message 5 is missing from what was handed over: only the database has it.
        assert!(
            current(
                &mine,
                &held,
                &store,
                &metrics,
                "c",
                &[gap],
                6,
                Provider::Openai
            )
            .await
            .is_err()
        );
    }

    /// Every history's bytes are counted and given back when it goes; past the budget a
    /// history is emptied after its request, and its next request reads it back whole.
    #[tokio::test]
    async fn histories_hold_their_bytes_within_the_budget() {
        let store = Recorded::default();
        let metrics = Metrics::default();
        store_messages(&store, 1, 3);
        let roomy = Held::new(usize::MAX);
        let history = new_history();
        let bytes = {
            let mut guard = current(
                &history,
                &roomy,
                &store,
                &metrics,
                "c",
                &[],
                3,
                Provider::Openai,
            )
            .await
            .expect("read");
            settle(&mut guard, &roomy);
            assert_eq!(guard.messages.len(), 3, "kept under the budget");
            roomy.bytes()
        };
        assert!(bytes > 0);
        drop(history);
        assert_eq!(roomy.bytes(), 0, "a history that goes gives its bytes back");

        let tight = Held::new(bytes - 1);
        let history = new_history();
        let mut guard = current(
            &history,
            &tight,
            &store,
            &metrics,
            "c",
            &[],
            3,
            Provider::Openai,
        )
        .await
        .expect("read");
        assert_eq!(guard.messages.len(), 3);
        settle(&mut guard, &tight);
        assert!(guard.messages.is_empty(), "emptied over the budget");
        assert_eq!(tight.bytes(), 0);
        drop(guard);
        let again = current(
            &history,
            &tight,
            &store,
            &metrics,
            "c",
            &[],
            3,
            Provider::Openai,
        )
        .await
        .expect("read back");
        assert_eq!(again.messages.len(), 3, "read back whole");
    }
}
