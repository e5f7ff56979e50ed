//! The event hub: per-conversation fan-out of frames to connected clients.
//!
//! Frames are serialised once and shared by every subscriber. Each subscriber has its own
//! bounded queue (a tokio mpsc channel, whose memory grows with what is waiting in it, not
//! with its bound), so an idle client costs a few hundred bytes here whatever the bound. A
//! subscriber that falls more than the bound behind is cut off: it gets what was queued,
//! then [`RecvError::Lagged`], and must reconnect with its last event_id; a slow client never
//! blocks a publisher.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

/// The `kind` of a [`Frame::wake`]; no frame type of the contract is empty.
const WAKE: &str = "";

/// One frame as sent to clients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Set on durable frames: the conversation's event id.
    pub event_id: Option<i64>,
    /// The frame's `type`.
    pub kind: String,
    /// The frame as its clients get it (JSON text), made once and shared by every
    /// subscriber without a copy. The hub never reads it.
    pub json: Arc<str>,
}

impl Frame {
    /// A frame from its JSON text, its `type` and, when durable, its event id.
    pub fn new(kind: impl Into<String>, event_id: Option<i64>, json: Arc<str>) -> Frame {
        Frame {
            event_id,
            kind: kind.into(),
            json,
        }
    }

    /// Not a frame for clients but a wake-up from another node: the conversation's durable
    /// frames up to `until` are stored, and a stream that has not seen them reads them from
    /// the database (see `cluster::frames`).
    pub fn wake(until: i64) -> Arc<Frame> {
        Arc::new(Frame::new(WAKE, Some(until), Arc::from("")))
    }

    /// Whether this is a [`Frame::wake`].
    pub fn is_wake(&self) -> bool {
        self.kind == WAKE
    }
}

/// Why a subscription yields no more frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvError {
    /// It fell more than the hub's bound behind and was cut off.
    Lagged,
    /// The hub dropped it (the conversation's subscribers were all gone).
    Closed,
}

/// What [`Subscription::try_recv`] found instead of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TryRecvError {
    /// Nothing is waiting now.
    Empty,
    /// As in [`RecvError`].
    Ended(RecvError),
}

/// One subscriber's end: the frames published for its conversation since it subscribed.
#[derive(Debug)]
pub struct Subscription {
    frames: mpsc::Receiver<Arc<Frame>>,
    lagged: Arc<AtomicBool>,
}

impl Subscription {
    fn ended(&self) -> RecvError {
        if self.lagged.load(Ordering::Acquire) {
            RecvError::Lagged
        } else {
            RecvError::Closed
        }
    }

    /// The next frame (cancel safe).
    pub async fn recv(&mut self) -> Result<Arc<Frame>, RecvError> {
        match self.frames.recv().await {
            Some(frame) => Ok(frame),
            None => Err(self.ended()),
        }
    }

    /// Stops taking frames: from now on the hub counts it as gone (see
    /// [`EventHub::release`]), even before it is dropped.
    pub fn close(&mut self) {
        self.frames.close();
    }

    /// The next frame if one is waiting.
    pub fn try_recv(&mut self) -> Result<Arc<Frame>, TryRecvError> {
        match self.frames.try_recv() {
            Ok(frame) => Ok(frame),
            Err(mpsc::error::TryRecvError::Empty) => Err(TryRecvError::Empty),
            Err(mpsc::error::TryRecvError::Disconnected) => Err(TryRecvError::Ended(self.ended())),
        }
    }
}

/// The hub's end of a subscription.
#[derive(Debug)]
struct Subscriber {
    frames: mpsc::Sender<Arc<Frame>>,
    lagged: Arc<AtomicBool>,
}

impl Subscriber {
    /// Queues `frame`; false when the subscriber is gone or has just been cut off for lag.
    fn offer(&self, frame: &Arc<Frame>) -> bool {
        match self.frames.try_send(Arc::clone(frame)) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.lagged.store(true, Ordering::Release);
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }
}

/// A durable frame published here, as the tap passes it on: its conversation and itself.
pub type Tapped = (String, Arc<Frame>);

#[derive(Debug)]
pub struct EventHub {
    channels: Mutex<HashMap<String, Vec<Subscriber>>>,
    capacity: usize,
    /// On a cluster: every durable frame published here also goes to the node's announcer,
    /// which passes it on to the other nodes (see `cluster::frames`).
    tap: std::sync::OnceLock<(mpsc::UnboundedSender<Tapped>, Arc<AtomicBool>)>,
    /// On a cluster: the conversation of every new subscription, for the node to tell the
    /// others it has a client for it (see `cluster::frames`).
    subscribed: std::sync::OnceLock<mpsc::UnboundedSender<String>>,
}

impl EventHub {
    /// `capacity`: frames a subscriber may fall behind before it lags.
    pub fn new(capacity: usize) -> Self {
        Self {
            channels: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
            tap: std::sync::OnceLock::new(),
            subscribed: std::sync::OnceLock::new(),
        }
    }

    fn channels(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Subscriber>>> {
        // A poisoned lock only means another thread panicked mid-insert; the map is intact.
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Receives every frame published for the conversation from now on.
    pub fn subscribe(&self, conversation_id: &str) -> Subscription {
        let (tx, rx) = mpsc::channel(self.capacity);
        let lagged = Arc::new(AtomicBool::new(false));
        self.channels()
            .entry(conversation_id.to_owned())
            .or_default()
            .push(Subscriber {
                frames: tx,
                lagged: Arc::clone(&lagged),
            });
        if let Some(subscribed) = self.subscribed.get() {
            let _ = subscribed.send(conversation_id.to_owned());
        }
        Subscription { frames: rx, lagged }
    }

    /// The conversations subscribed to from now on, one for each subscription (once per
    /// hub; `None` after the first).
    pub fn subscriptions(&self) -> Option<mpsc::UnboundedReceiver<String>> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.subscribed.set(tx).ok()?;
        Some(rx)
    }

    /// The durable frames published from now on while `open` is true (once per hub;
    /// `None` after the first).
    pub fn tap(&self, open: Arc<AtomicBool>) -> Option<mpsc::UnboundedReceiver<Tapped>> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.tap.set((tx, open)).ok()?;
        Some(rx)
    }

    /// Publishes a frame of a conversation that runs here: to its subscribers, and when
    /// durable to the tap.
    pub fn publish(&self, conversation_id: &str, frame: Arc<Frame>) {
        if frame.event_id.is_some()
            && !frame.is_wake()
            && let Some((tap, open)) = self.tap.get()
            && open.load(Ordering::Relaxed)
        {
            let _ = tap.send((conversation_id.to_owned(), Arc::clone(&frame)));
        }
        self.deliver(conversation_id, frame);
    }

    /// Sends a frame to the conversation's subscribers here, if it has any; those gone or
    /// cut off for lag are dropped.
    pub fn deliver(&self, conversation_id: &str, frame: Arc<Frame>) {
        let mut channels = self.channels();
        if let Some(subscribers) = channels.get_mut(conversation_id) {
            subscribers.retain(|subscriber| subscriber.offer(&frame));
            if subscribers.is_empty() {
                channels.remove(conversation_id);
            }
        }
    }

    /// Forgets the conversation's subscribers that are gone, and the conversation once none
    /// is left. A stream calls it after its subscription is dropped, so a conversation that
    /// is never active again keeps nothing here.
    pub fn release(&self, conversation_id: &str) {
        let mut channels = self.channels();
        if let Some(subscribers) = channels.get_mut(conversation_id) {
            subscribers.retain(|subscriber| !subscriber.frames.is_closed());
            if subscribers.is_empty() {
                channels.remove(conversation_id);
            }
        }
    }

    /// The conversations that have subscribers.
    pub fn watched(&self) -> Vec<String> {
        self.channels().keys().cloned().collect()
    }

    /// How many conversations have subscribers.
    pub fn channel_count(&self) -> usize {
        self.channels().len()
    }

    /// How many clients watch the conversation.
    pub fn subscribers(&self, conversation_id: &str) -> usize {
        self.channels()
            .get(conversation_id)
            .map_or(0, |subscribers| {
                subscribers
                    .iter()
                    .filter(|subscriber| !subscriber.frames.is_closed())
                    .count()
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(n: i64) -> Arc<Frame> {
        let json = format!(r#"{{"type":"state","state":{{"kind":"idle"}},"event_id":{n}}}"#);
        Arc::new(Frame::new("state", Some(n), json.into()))
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
        // It gets what was queued, then is told it lagged.
        assert_eq!(slow.try_recv().map(|f| f.event_id), Ok(Some(1)));
        assert_eq!(slow.try_recv().map(|f| f.event_id), Ok(Some(2)));
        assert_eq!(slow.try_recv(), Err(TryRecvError::Ended(RecvError::Lagged)));
        assert_eq!(hub.subscribers("c"), 0);
        assert_eq!(hub.channel_count(), 0);
    }

    #[tokio::test]
    async fn a_watcher_that_keeps_up_never_lags() {
        let hub = EventHub::new(2);
        let mut watcher = hub.subscribe("c");
        for n in 1..=100 {
            hub.publish("c", frame(n));
            assert_eq!(watcher.recv().await.map(|f| f.event_id), Ok(Some(n)));
        }
        assert_eq!(watcher.try_recv(), Err(TryRecvError::Empty));
        assert_eq!(hub.subscribers("c"), 1);
    }
}
