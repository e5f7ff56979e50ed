//! The histories of conversations the gateway is serving, kept between their LLM steps so a
//! step reads only the messages added since the last one. Messages are append-only and
//! numbered, so "every message after the last sequence id held" is always the rest.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use crate::model::MessageRecord;
use crate::store::{Store, StoreError};

type Entry = Arc<AsyncMutex<Vec<MessageRecord>>>;

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
    ) -> Result<OwnedMutexGuard<Vec<MessageRecord>>, StoreError> {
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
        let after = history.last().map_or(0, |m| m.sequence_id);
        let newer = store.messages_after(id, after, u64::MAX >> 1).await?;
        history.extend(newer);
        Ok(history)
    }
}
