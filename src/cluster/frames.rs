//! Frames across nodes. A conversation's actor publishes its frames into the hub of the node
//! it runs on, where its local clients get them; clients streaming it from other nodes get
//! them through Postgres.
//!
//! - Interest: a node says which conversations it has clients for and does not run, on
//!   `bedrock_watch` (`<node incarnation> <conversation id>...`): at once when a client
//!   subscribes, and again every heartbeat; each node keeps what the others said for three
//!   heartbeats ([`Interest`]).
//! - Out: while other nodes are live, every durable frame published here of a conversation
//!   another node has clients for is announced ([`announce`]): batched per conversation into notifications on `bedrock_frames`, each
//!   `<node incarnation> <conversation id> <last event id>` and then the frames themselves, one a line
//!   (`<event id> <type> <JSON text>`), sent after their commits in transactions of their own. A frame too large for a
//!   notification (8,000 bytes) is announced by its event id alone.
//! - In: each node listens ([`follow`]). A notification from another node for a
//!   conversation it has streams for is delivered to them: its frames as they are, or, when it
//!   carries none, a wake-up ([`Frame::wake`]) on which each stream reads what it has not
//!   sent yet from the stored frames. Streams drop a frame they already sent and fill a gap
//!   from the database (the resume replay), so what a client gets is in order, without gap
//!   or duplicate, whatever notifications were lost or repeated.
//! - The stored rows are the truth and notifications only carry them faster: one lost (the
//!   listener's connection dropped), or never sent (a client's interest not yet heard by a
//!   conversation's new owner), is made up for by a sweep, which reads the last event id of
//!   every conversation streamed here from another node, once a heartbeat and at once after
//!   the listener reconnects. Deltas (`text_delta`) stay on the owner's node.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::Handles;
use crate::hub::{Frame, Tapped};
use crate::store::{FRAMES_CHANNEL, WATCH_CHANNEL};

/// The most a notification's payload may hold (Postgres refuses 8,000 bytes and more).
const PAYLOAD_LIMIT: usize = 7_900;

/// How long the announcer gathers frames before it sends them.
const GATHER: Duration = Duration::from_millis(1);

/// Announces the durable frames published here (from the hub's tap) to the other nodes
/// until this one shuts down: whatever was published while one transaction of
/// notifications was sent goes in the next.
pub async fn announce(
    handles: Arc<Handles>,
    interest: Arc<Interest>,
    mut tapped: mpsc::UnboundedReceiver<Tapped>,
) {
    let origin = handles.cluster.incarnation.clone();
    let mut batch: HashMap<String, Vec<Arc<Frame>>> = HashMap::new();
    loop {
        let first = tokio::select! {
            () = handles.lifecycle.shutting_down() => return,
            tapped = tapped.recv() => tapped,
        };
        let Some((id, frame)) = first else { return };
        batch.entry(id).or_default().push(frame);
        // The rest of the commit, and those of other conversations: one notifying
        // transaction for all, not one a frame.
        tokio::time::sleep(GATHER).await;
        while let Ok((id, frame)) = tapped.try_recv() {
            batch.entry(id).or_default().push(frame);
        }
        if !handles.store.has_peers() {
            batch.clear();
            continue;
        }
        interest.keep_watched(&mut batch);
        let mut payloads = Vec::new();
        for (id, frames) in batch.drain() {
            payloads.extend(payloads_of(&origin, &id, &frames));
        }
        if let Err(error) = handles.store.notify(FRAMES_CHANNEL, &payloads).await {
            // The other nodes' sweep reads what these would have brought.
            tracing::warn!(%error, "cannot announce frames to the other nodes");
        }
    }
}

/// The notifications from `origin` (this node's incarnation) that carry a conversation's
/// `frames` (in order).
fn payloads_of(origin: &str, id: &str, frames: &[Arc<Frame>]) -> Vec<String> {
    let mut payloads = Vec::new();
    let mut lines: Vec<String> = Vec::new();
    let mut size = 0;
    let mut last = 0;
    let flush = |payloads: &mut Vec<String>, lines: &mut Vec<String>, last: i64| {
        if !lines.is_empty() {
            payloads.push(format!("{origin} {id} {last}\n{}", lines.join("\n")));
            lines.clear();
        }
    };
    for frame in frames {
        let Some(event_id) = frame.event_id else {
            continue;
        };
        let line = format!("{event_id} {} {}", frame.kind, frame.json);
        let header = origin.len() + id.len() + 22;
        if header + line.len() + 1 > PAYLOAD_LIMIT {
            // Too large to carry: its event id alone, and the streams read it.
            flush(&mut payloads, &mut lines, last);
            size = 0;
            payloads.push(format!("{origin} {id} {event_id}"));
            continue;
        }
        if header + size + line.len() + 1 > PAYLOAD_LIMIT {
            flush(&mut payloads, &mut lines, last);
            size = 0;
        }
        size += line.len() + 1;
        lines.push(line);
        last = event_id;
    }
    flush(&mut payloads, &mut lines, last);
    payloads
}

/// What the other nodes said they have clients for: conversation, until when.
#[derive(Debug)]
pub struct Interest {
    watched: Mutex<HashMap<String, Instant>>,
    /// How long a node's word lasts (three heartbeats: it says it again every one).
    lasts: Duration,
}

impl Interest {
    pub fn new(heartbeat: Duration) -> Interest {
        Interest {
            watched: Mutex::new(HashMap::new()),
            lasts: heartbeat * 3,
        }
    }

    fn watched(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.watched.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn note<'a>(&self, ids: impl Iterator<Item = &'a str>) {
        let until = Instant::now() + self.lasts;
        let mut watched = self.watched();
        for id in ids {
            watched.insert(id.to_owned(), until);
        }
    }

    /// Keeps in `batch` only conversations another node has clients for.
    fn keep_watched<T>(&self, batch: &mut HashMap<String, T>) {
        let now = Instant::now();
        let watched = self.watched();
        batch.retain(|id, _| watched.get(id).is_some_and(|until| *until > now));
    }

    /// Forgets what nobody said again.
    fn prune(&self) {
        let now = Instant::now();
        self.watched().retain(|_, until| *until > now);
    }
}

/// The notifications in which node `origin` says it has clients for `ids`.
fn interest_payloads(origin: &str, ids: &[&str]) -> Vec<String> {
    let mut payloads = Vec::new();
    let mut payload = String::new();
    for id in ids {
        if !payload.is_empty() && payload.len() + 1 + id.len() > PAYLOAD_LIMIT {
            payloads.push(std::mem::take(&mut payload));
        }
        if payload.is_empty() {
            payload.push_str(origin);
        }
        payload.push(' ');
        payload.push_str(id);
    }
    if !payload.is_empty() {
        payloads.push(payload);
    }
    payloads
}

/// Tells the other nodes this node has clients for `ids`.
async fn say_interest(handles: &Handles, ids: &[&str]) {
    if ids.is_empty() || !handles.store.has_peers() {
        return;
    }
    let payloads = interest_payloads(&handles.cluster.incarnation, ids);
    if let Err(error) = handles.store.notify(WATCH_CHANNEL, &payloads).await {
        tracing::warn!(%error, "cannot tell the other nodes which conversations have clients here");
    }
}

/// What the listener heard.
enum Heard {
    /// A notification of frames.
    Notified(String),
    /// A node's word of the conversations it has clients for.
    Watching(String),
    /// Its connection was lost (and is made again): notifications may have been missed.
    Lost,
}

/// Follows the other nodes' frames until the node shuts down. `sweep`: how often the last
/// event ids of the conversations streamed here are read in case a notification was missed.
pub async fn follow(
    handles: Arc<Handles>,
    interest: Arc<Interest>,
    mut subscribed: mpsc::UnboundedReceiver<String>,
    sweep: Duration,
) {
    let (heard_tx, mut heard) = mpsc::channel(1024);
    // The listener runs in a task of its own, which only ever waits on its connection (its
    // receive is not known to be cancel safe, so it is never raced against anything else).
    let listener = tokio::spawn(listen(handles.clone(), heard_tx, sweep));
    let mut tick = tokio::time::interval(sweep);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = handles.lifecycle.shutting_down() => break,
            _ = tick.tick() => {
                sweep_streams(&handles).await;
                interest.prune();
            }
            Some(id) = subscribed.recv() => {
                // Every subscription waiting (a wave of reconnections), in one notification.
                let mut ids = vec![id];
                while let Ok(id) = subscribed.try_recv() {
                    ids.push(id);
                }
                ids.retain(|id| !handles.conversations.contains(id));
                let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
                say_interest(&handles, &ids).await;
            }
            heard = heard.recv() => match heard {
                Some(Heard::Notified(payload)) => deliver(&handles, &payload),
                Some(Heard::Watching(payload)) => {
                    let mut words = payload.split(' ');
                    let origin = words.next().unwrap_or_default();
                    let ours = handles.cluster.incarnation == origin;
                    if !ours {
                        interest.note(words.filter(|id| !id.is_empty()));
                    }
                }
                Some(Heard::Lost) => sweep_streams(&handles).await,
                None => break,
            },
        }
    }
    listener.abort();
}

/// Delivers another node's notification to this node's streams of its conversation, if
/// it has any. (A frame of a conversation that has moved here since is dropped by the
/// streams as one they have, or taken as what they missed.)
fn deliver(handles: &Handles, payload: &str) {
    let Some((origin, id, last, frames)) = parse(payload) else {
        tracing::warn!(payload, "a notification that is not one of frames");
        return;
    };
    let ours = handles.cluster.incarnation == origin;
    if ours || handles.hub.subscribers(id) == 0 {
        return;
    }
    let mut carried = 0;
    for line in frames {
        let Some((event_id, kind, json)) = carried_frame(line) else {
            break;
        };
        handles.hub.deliver(
            id,
            Arc::new(Frame::new(kind, Some(event_id), Arc::from(json))),
        );
        carried += 1;
    }
    if carried == 0 {
        handles.hub.deliver(id, Frame::wake(last));
    }
}

/// A carried frame's line: its event id, type and JSON text.
fn carried_frame(line: &str) -> Option<(i64, &str, &str)> {
    let (event_id, rest) = line.split_once(' ')?;
    let (kind, json) = rest.split_once(' ')?;
    Some((event_id.parse().ok()?, kind, json))
}

/// A notification: the node incarnation it comes from, its conversation, last event id,
/// and the frames it carries.
fn parse(payload: &str) -> Option<(&str, &str, i64, std::str::Lines<'_>)> {
    let mut lines = payload.lines();
    let (origin, rest) = lines.next()?.split_once(' ')?;
    let (id, last) = rest.rsplit_once(' ')?;
    Some((origin, id, last.parse().ok()?, lines))
}

/// Hears `bedrock_frames` and passes on what it hears; reconnects after an error.
async fn listen(handles: Arc<Handles>, heard: mpsc::Sender<Heard>, retry: Duration) {
    loop {
        let mut listener = match handles.store.frames_listener().await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(%error, "cannot listen for other nodes' frames; retrying");
                tokio::time::sleep(retry).await;
                continue;
            }
        };
        // Whatever was committed before this connection listened.
        if heard.send(Heard::Lost).await.is_err() {
            return;
        }
        loop {
            let next = match listener.try_recv().await {
                Ok(Some(notification)) if notification.channel() == WATCH_CHANNEL => {
                    Heard::Watching(notification.payload().to_owned())
                }
                Ok(Some(notification)) => Heard::Notified(notification.payload().to_owned()),
                Ok(None) => Heard::Lost,
                Err(error) => {
                    tracing::warn!(%error, "lost the listener for other nodes' frames");
                    break;
                }
            };
            if heard.send(next).await.is_err() {
                return;
            }
        }
    }
}

/// Wakes every stream here of a conversation another node runs, up to its last stored
/// event (a stream that has it already does nothing), and says again that this node has
/// clients for them.
async fn sweep_streams(handles: &Handles) {
    const CHUNK: usize = 1000;
    let watched: Vec<String> = handles
        .hub
        .watched()
        .into_iter()
        .filter(|id| !handles.conversations.contains(id))
        .collect();
    for chunk in watched.chunks(CHUNK) {
        let ids: Vec<&str> = chunk.iter().map(String::as_str).collect();
        say_interest(handles, &ids).await;
        match handles.store.last_event_ids(&ids).await {
            Ok(lasts) => {
                for (id, last) in lasts {
                    handles.hub.deliver(&id, Frame::wake(last));
                }
            }
            Err(error) => {
                tracing::warn!(%error, "cannot read the last event ids of streamed conversations");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(event_id: i64, text_len: usize) -> Arc<Frame> {
        let json = format!(
            r#"{{"type":"state","state":"{}","event_id":{event_id}}}"#,
            "x".repeat(text_len)
        );
        Arc::new(Frame::new("state", Some(event_id), json.into()))
    }

    #[test]
    fn notifications_carry_frames_in_order_within_the_limit() {
        let frames = [frame(1, 10), frame(2, 5000), frame(3, 5000), frame(4, 9000)];
        let payloads = payloads_of("n-1", "c_1", &frames);
        assert_eq!(payloads.len(), 3, "{payloads:?}");
        assert!(payloads.iter().all(|p| p.len() <= PAYLOAD_LIMIT));
        let read: Vec<(i64, Vec<i64>)> = payloads
            .iter()
            .map(|p| {
                let (origin, id, last, lines) = parse(p).expect("a notification");
                assert_eq!((origin, id), ("n-1", "c_1"));
                let ids = lines
                    .map(|l| {
                        let (event_id, kind, json) = carried_frame(l).expect("a frame");
                        assert_eq!(kind, "state");
                        assert!(json.ends_with(&format!(r#""event_id":{event_id}}}"#)));
                        event_id
                    })
                    .collect();
                (last, ids)
            })
            .collect();
        // Two frames fit the first; the third its own; the fourth is too large to carry.
        assert_eq!(read, [(2, vec![1, 2]), (3, vec![3]), (4, vec![])]);
    }

    #[test]
    fn interest_is_said_within_the_limit_and_kept_three_heartbeats() {
        let ids: Vec<String> = (0..1000).map(|i| format!("conversation-{i:04}")).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let payloads = interest_payloads("n-1", &refs);
        assert!(payloads.len() > 1 && payloads.iter().all(|p| p.len() <= PAYLOAD_LIMIT));
        let said: Vec<&str> = payloads
            .iter()
            .flat_map(|p| {
                let mut words = p.split(' ');
                assert_eq!(words.next(), Some("n-1"));
                words
            })
            .collect();
        assert_eq!(said, refs);

        let interest = Interest::new(Duration::from_secs(1));
        interest.note(["a", "b"].into_iter());
        let mut batch: HashMap<String, ()> = ["a", "c"].map(|id| (id.to_owned(), ())).into();
        interest.keep_watched(&mut batch);
        assert_eq!(batch.keys().collect::<Vec<_>>(), ["a"]);
        let gone = Interest::new(Duration::ZERO);
        gone.note(["a"].into_iter());
        gone.prune();
        assert!(gone.watched().is_empty());
    }

    #[test]
    fn a_bare_notification_names_a_conversation_and_its_last_event() {
        let (origin, id, last, mut lines) = parse("n-1 c_01 42").expect("parsed");
        assert_eq!((origin, id, last, lines.next()), ("n-1", "c_01", 42, None));
        assert!(parse("n-1 c_01").is_none());
        assert!(parse("n-1 c_01 x").is_none());
    }
}
