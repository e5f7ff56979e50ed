//! Frames across nodes. A conversation's actor publishes its frames into the hub of the node
//! it runs on; a client streaming it from another node is fed from the database instead.
//! Every commit made while other nodes are live notifies them (`NOTIFY bedrock_frames` with
//! the conversation's id and last event id); this node turns each notification for a
//! conversation it has streams for, and does not run itself, into a wake-up in its hub
//! ([`Frame::wake`]), and each stream reads the stored frames it has not sent yet (the same
//! replay as a resume: in order, without gaps or duplicates). The stored rows are the truth
//! and the notification only a wake-up: one that is lost (the listener's connection dropped)
//! is made up for by a sweep, which reads the last event id of every conversation streamed
//! here from another node, once a heartbeat and at once after the listener reconnects.
//! Deltas (`text_delta`) stay on the owner's node.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::hub::Frame;
use crate::runtime::Services;

/// What the listener heard.
enum Heard {
    /// A commit: the conversation and its last event id.
    Commit(String, i64),
    /// Its connection was lost (and is made again): notifications may have been missed.
    Lost,
}

/// Follows other nodes' commits until the node shuts down. `sweep`: how often the last event
/// ids of the conversations streamed here are read in case a notification was missed.
pub async fn follow(services: Arc<Services>, sweep: Duration) {
    let (heard_tx, mut heard) = mpsc::channel(1024);
    // The listener runs in a task of its own, which only ever waits on its connection (its
    // receive is not known to be cancel safe, so it is never raced against anything else).
    let listener = tokio::spawn(listen(services.clone(), heard_tx, sweep));
    let mut tick = tokio::time::interval(sweep);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = services.shutting_down() => break,
            _ = tick.tick() => sweep_streams(&services).await,
            heard = heard.recv() => match heard {
                Some(Heard::Commit(id, last)) => {
                    if !services.registry.contains(&id) {
                        services.hub.publish(&id, Frame::wake(last));
                    }
                }
                Some(Heard::Lost) => sweep_streams(&services).await,
                None => break,
            },
        }
    }
    listener.abort();
}

/// Hears `bedrock_frames` and passes on what it hears; reconnects after an error.
async fn listen(services: Arc<Services>, heard: mpsc::Sender<Heard>, retry: Duration) {
    loop {
        let mut listener = match services.store.frames_listener().await {
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
                Ok(Some(notification)) => match parse(notification.payload()) {
                    Some((id, last)) => Heard::Commit(id.to_owned(), last),
                    None => {
                        tracing::warn!(
                            payload = notification.payload(),
                            "a notification that is not a commit's"
                        );
                        continue;
                    }
                },
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

/// A notification's payload: `<conversation id> <last event id>`.
fn parse(payload: &str) -> Option<(&str, i64)> {
    let (id, last) = payload.rsplit_once(' ')?;
    Some((id, last.parse().ok()?))
}

/// Wakes every stream here of a conversation another node runs, up to its last stored
/// event; a stream that has it already does nothing.
async fn sweep_streams(services: &Services) {
    const CHUNK: usize = 1000;
    let watched: Vec<String> = services
        .hub
        .watched()
        .into_iter()
        .filter(|id| !services.registry.contains(id))
        .collect();
    for chunk in watched.chunks(CHUNK) {
        let ids: Vec<&str> = chunk.iter().map(String::as_str).collect();
        match services.store.last_event_ids(&ids).await {
            Ok(lasts) => {
                for (id, last) in lasts {
                    services.hub.publish(&id, Frame::wake(last));
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
    use super::parse;

    #[test]
    fn payloads_name_a_conversation_and_its_last_event() {
        assert_eq!(parse("c_01 42"), Some(("c_01", 42)));
        assert_eq!(parse("c_01"), None);
        assert_eq!(parse("c_01 x"), None);
    }
}
