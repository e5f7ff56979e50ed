//! The event hub: per-conversation broadcast of frames to connected clients.
//!
//! Frames are serialised once and shared by every subscriber. A subscriber that falls more
//! than the channel's capacity behind is told so (`Lagged`) and must reconnect with its last
//! event_id; a slow client never blocks a publisher.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

use crate::wire::{self, ServerFrame};

/// One frame as sent to clients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Set on durable frames: the conversation's event id.
    pub event_id: Option<i64>,
    /// The frame's `type`.
    pub kind: String,
    /// The frame, serialised.
    pub json: Arc<str>,
    /// The same text as a WebSocket payload, shared by every client without a copy.
    pub ws: axum::extract::ws::Utf8Bytes,
}

impl Frame {
    /// A frame from its JSON text, its `type` and, when durable, its event id.
    pub fn new(kind: impl Into<String>, event_id: Option<i64>, json: Arc<str>) -> Frame {
        Frame {
            event_id,
            kind: kind.into(),
            ws: json.as_ref().into(),
            json,
        }
    }

    /// A frame as the wire types make it.
    pub fn of(frame: &ServerFrame<'_>) -> Frame {
        Frame::new(frame.kind(), frame.event_id(), wire::to_json(frame).into())
    }
}

#[derive(Debug)]
pub struct EventHub {
    channels: Mutex<HashMap<String, broadcast::Sender<Arc<Frame>>>>,
    capacity: usize,
}

impl EventHub {
    /// `capacity`: frames a subscriber may fall behind before it lags.
    pub fn new(capacity: usize) -> Self {
        Self {
            channels: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
        }
    }

    fn channels(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, broadcast::Sender<Arc<Frame>>>> {
        // A poisoned lock only means another thread panicked mid-insert; the map is intact.
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Receives every frame published for the conversation from now on.
    pub fn subscribe(&self, conversation_id: &str) -> broadcast::Receiver<Arc<Frame>> {
        self.channels()
            .entry(conversation_id.to_owned())
            .or_insert_with(|| broadcast::channel(self.capacity).0)
            .subscribe()
    }

    /// Sends a frame to the conversation's subscribers, if it has any.
    pub fn publish(&self, conversation_id: &str, frame: Arc<Frame>) {
        let mut channels = self.channels();
        if let Some(sender) = channels.get(conversation_id)
            && sender.send(frame).is_err()
        {
            // Nobody listens any more.
            channels.remove(conversation_id);
        }
    }

    /// Drops the conversation's channel once nobody watches it. A stream calls it after its
    /// receiver is gone, so a conversation that is never active again keeps nothing here.
    pub fn release(&self, conversation_id: &str) {
        let mut channels = self.channels();
        if channels
            .get(conversation_id)
            .is_some_and(|sender| sender.receiver_count() == 0)
        {
            channels.remove(conversation_id);
        }
    }

    /// How many conversations have a channel.
    pub fn channel_count(&self) -> usize {
        self.channels().len()
    }

    /// How many clients watch the conversation.
    pub fn subscribers(&self, conversation_id: &str) -> usize {
        self.channels()
            .get(conversation_id)
            .map_or(0, broadcast::Sender::receiver_count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(n: i64) -> Arc<Frame> {
        Arc::new(Frame::of(&ServerFrame::State {
            state: wire::State::Idle,
            event_id: n,
        }))
    }

    #[test]
    fn channels_go_when_the_last_watcher_goes() {
        let hub = EventHub::new(4);
        let first = hub.subscribe("c");
        let mut second = hub.subscribe("c");
        drop(first);
        hub.release("c");
        assert_eq!(hub.channel_count(), 1, "one watcher is left");
        hub.publish("c", frame(1));
        assert_eq!(second.try_recv().map(|f| f.event_id), Ok(Some(1)));
        drop(second);
        hub.release("c");
        assert_eq!(hub.channel_count(), 0);
        // Publishing with nobody watching keeps nothing either.
        hub.publish("d", frame(1));
        assert_eq!(hub.channel_count(), 0);
    }

    #[test]
    fn a_slow_watcher_lags_and_the_publisher_never_waits() {
        let hub = EventHub::new(2);
        let mut slow = hub.subscribe("c");
        for n in 1..=5 {
            hub.publish("c", frame(n));
        }
        assert!(matches!(
            slow.try_recv(),
            Err(broadcast::error::TryRecvError::Lagged(3))
        ));
    }
}
