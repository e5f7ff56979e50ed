//! The histories of conversations the gateway is serving, kept between their LLM steps so a
//! step reads only the messages added since the last one. Messages are append-only and
//! numbered, so "every message after the last sequence id held" is always the rest. Each is
//! held in its wire form (request.rs), made once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use super::request::{Wire, starts_turn, wire};
use crate::metrics::Metrics;
use crate::model::ConversationCommit;
use crate::store::{Store, StoreError};

/// A conversation's history as the backend gets it.
#[derive(Debug, Default)]
pub struct History {
    /// The sequence id of the last message held (0: none).
    last: i64,
    pub messages: Vec<Wire>,
    /// Where the turn in progress starts in `messages`: after the last user-role message.
    pub turn_from: usize,
}

impl History {
    fn push(&mut self, content: &crate::state_machine::MessageContent) {
        self.messages.push(wire(content));
        if starts_turn(content) {
            self.turn_from = self.messages.len();
        }
    }
}

type Entry = Arc<AsyncMutex<History>>;

#[derive(Debug)]
pub struct HistoryCache {
    /// Conversation id -> its history, and when it was last used.
    entries: Mutex<HashMap<String, (Entry, Instant)>>,
    /// Conversations kept at most; the least recently used goes first.
    capacity: usize,
}

impl HistoryCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
        }
    }

    /// The conversation's whole history through sequence id `through` (its last stored
    /// message), held until the guard drops (a conversation has one LLM request at a time,
    /// so this never waits on another). Messages the conversation handed over in `recent`
    /// (stored commits, in order) are taken from there; the database is read only for what
    /// they do not cover: a cold cache, or messages stored while no actor was running.
    pub async fn current(
        &self,
        store: &Store,
        metrics: &Metrics,
        id: &str,
        recent: &[Arc<ConversationCommit>],
        through: i64,
    ) -> Result<OwnedMutexGuard<History>, StoreError> {
        let entry = {
            let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            match entries.get_mut(id) {
                Some((entry, used)) => {
                    *used = Instant::now();
                    entry.clone()
                }
                None => {
                    if entries.len() >= self.capacity
                        && let Some(oldest) = entries
                            .iter()
                            .min_by_key(|(_, (_, used))| *used)
                            .map(|(k, _)| k.clone())
                    {
                        entries.remove(&oldest);
                    }
                    let entry: Entry = Arc::default();
                    entries.insert(id.to_owned(), (entry.clone(), Instant::now()));
                    entry
                }
            }
        };
        let mut history = entry.lock_owned().await;
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
            let newer = store
                .messages_after(id, history.last, u64::MAX >> 1)
                .await?;
            if let Some(last) = newer.last() {
                history.last = last.sequence_id;
            }
            for record in &newer {
                history.push(&record.content);
            }
        }
        Ok(history)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::MessageRecord;
    use crate::state_machine::MessageContent;
    use crate::store::testing::{at, sqlite_store};

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
    async fn store_messages(store: &Store, from: i64, to: i64) -> Arc<ConversationCommit> {
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
        });
        store
            .commit_batch(std::slice::from_ref(&commit))
            .await
            .expect("commits");
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
    /// over or from the database, and the database is read only for what those commits do
    /// not cover (after the pool is closed, a read would fail).
    #[tokio::test]
    async fn handed_over_messages_spare_the_database_read() {
        let (store, dir) = sqlite_store("history", &["c"]).await;

        let (cache, metrics) = (HistoryCache::new(4), Metrics::default());
        store_messages(&store, 1, 2).await;
        // Cold: read from the database.
        let first = texts(
            &cache
                .current(&store, &metrics, "c", &[], 2)
                .await
                .expect("read"),
        );
        assert_eq!(first.len(), 2);

        let recent = store_messages(&store, 3, 4).await;
        let reference = HistoryCache::new(4);
        let from_db = texts(
            &reference
                .current(&store, &metrics, "c", &[], 4)
                .await
                .expect("read"),
        );
        let stored = store_messages(&store, 5, 6).await;
        let gap = Arc::new(ConversationCommit {
            messages: vec![user(6)],
            ..(*stored).clone()
        });
        store.clone().close().await.expect("closes");

        let handed = texts(
            &cache
                .current(&store, &metrics, "c", std::slice::from_ref(&recent), 4)
                .await
                .expect("no database read needed"),
        );
        assert_eq!(handed, from_db);
        // Message 5 is missing from what was handed over: only the database has it.
        assert!(
            cache
                .current(&store, &metrics, "c", &[gap], 6)
                .await
                .is_err()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
