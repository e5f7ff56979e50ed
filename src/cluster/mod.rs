//! Several nodes on one Postgres (docs/operations.md, "Scaling"). Each node registers in the
//! `nodes` table and renews its heartbeat, which keeps every lease it holds live: a
//! conversation runs only on the node holding its lease, and each of its commits carries the
//! lease's epoch, which the database checks in the same statement that writes it (migration
//! m7). A node that stops heartbeating loses its leases after the TTL; any other node then
//! takes over the conversations it left with work in flight, repairing them as a restart
//! does. SQLite is one node and has none of this.

pub mod frames;

use std::sync::Arc;

pub use crate::node::Cluster;

use crate::hub::EventHub;
use crate::runtime::{Conversations, Lifecycle, Runtime};
use crate::store::Store;

/// What the node's part in a cluster uses: the store's leases and notifications, the hub's
/// frames, the conversations it takes over or wakes, and the node's life.
#[derive(Clone, Debug)]
pub struct Handles {
    /// This node.
    pub cluster: Arc<Cluster>,
    pub store: Store,
    pub hub: Arc<EventHub>,
    pub conversations: Conversations,
    pub lifecycle: Lifecycle,
}

impl Handles {
    /// The handles of `runtime`'s node; `None` when it is the only node.
    pub fn of(runtime: &Runtime) -> Option<Arc<Handles>> {
        Some(Arc::new(Handles {
            cluster: runtime.cluster.clone()?,
            store: runtime.store.clone(),
            hub: runtime.hub.clone(),
            conversations: runtime.conversations.clone(),
            lifecycle: runtime.lifecycle.clone(),
        }))
    }
}

/// Registers the node and starts its heartbeat and its takeover of orphaned conversations.
/// Returns after the first takeover pass (start-up recovery), so the node serves repaired
/// conversations from its first request.
pub async fn start(handles: &Arc<Handles>) -> crate::store::Result<()> {
    let cluster = handles.cluster.clone();
    handles
        .store
        .heartbeat(cluster.node(), &cluster.advertise)
        .await?;
    tracing::info!(node = %cluster.node_id, advertise = %cluster.advertise, "joined the cluster");
    // Frames across nodes first: the repairs of the start-up takeover are announced too.
    let interest = Arc::new(frames::Interest::new(cluster.heartbeat));
    if let (Some(tapped), Some(subscribed)) = (
        handles.hub.tap(handles.store.peers()),
        handles.hub.subscriptions(),
    ) {
        tokio::spawn(frames::announce(handles.clone(), interest.clone(), tapped));
        tokio::spawn(frames::follow(
            handles.clone(),
            interest,
            subscribed,
            cluster.heartbeat,
        ));
    }
    // Start-up recovery: also conversations nobody holds (rows from before leases).
    take_over(handles, &cluster, true).await;
    let handles = handles.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(cluster.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = handles.lifecycle.shutting_down() => return,
            }
            match handles
                .store
                .heartbeat(cluster.node(), &cluster.advertise)
                .await
            {
                Ok(_) => {
                    take_over(&handles, &cluster, false).await;
                    if let Err(error) = handles.store.clear_dead_nodes(cluster.node()).await {
                        tracing::warn!(%error, "cannot clear dead nodes");
                    }
                }
                Err(error) => {
                    tracing::warn!(node = %cluster.node_id, %error, "heartbeat failed; leases expire if it goes on")
                }
            }
        }
    });
    Ok(())
}

/// Conversations left with work in flight by a node that is gone (and, `unowned`, by no
/// node): take each (its lease, a repair of its chain, its actor here), a batch at a time.
async fn take_over(handles: &Arc<Handles>, cluster: &Cluster, unowned: bool) {
    const BATCH: u64 = 200;
    loop {
        let orphans = match handles
            .store
            .orphaned_conversations(cluster.node(), unowned, BATCH)
            .await
        {
            Ok(orphans) => orphans,
            Err(error) => {
                tracing::warn!(%error, "cannot look for orphaned conversations");
                return;
            }
        };
        let full = orphans.len() as u64 == BATCH;
        let mut taken = 0;
        for id in orphans {
            if handles.conversations.contains(&id) {
                continue;
            }
            match handles.conversations.get_or_start(&id).await {
                Ok(_) => {
                    taken += 1;
                    tracing::info!(conversation = %id, node = %cluster.node_id, "took over");
                }
                Err(error) => tracing::debug!(conversation = %id, %error, "not taken over"),
            }
        }
        if !full || taken == 0 {
            return;
        }
    }
}
