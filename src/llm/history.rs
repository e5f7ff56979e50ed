//! The histories of conversations the gateway is serving, kept between their LLM steps so a
//! step reads only the messages added since the last one. Messages are append-only and
//! numbered, so "every message after the last sequence id held" is always the rest. Each is
//! held in its wire form (request.rs), made once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use super::request::{Wire, wire};
use crate::store::{Store, StoreError};

/// A conversation's history as the backend gets it.
#[derive(Debug, Default)]
pub struct History {
    /// The sequence id of the last message held (0: none).
    last: i64,
    pub messages: Vec<Wire>,
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

    /// The conversation's whole history, brought up to date, held until the guard drops (a
    /// conversation has one LLM request at a time, so this never waits on another).
    pub async fn current(
        &self,
        store: &Store,
        id: &str,
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
        let newer = store
            .messages_after(id, history.last, u64::MAX >> 1)
            .await?;
        if let Some(last) = newer.last() {
            history.last = last.sequence_id;
        }
        history
            .messages
            .extend(newer.iter().map(|record| wire(&record.content)));
        Ok(history)
    }
}
