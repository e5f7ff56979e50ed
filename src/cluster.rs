//! Several nodes on one Postgres (docs/operations.md, "Scaling"). Each node registers in the
//! `nodes` table and renews its heartbeat, which keeps every lease it holds live: a
//! conversation runs only on the node holding its lease, and each of its commits carries the
//! lease's epoch, which the database checks in the same statement that writes it (migration
//! m7). A node that stops heartbeating loses its leases after the TTL; any other node then
//! takes over the conversations it left with work in flight, repairing them as a restart
//! does. SQLite is one node and has none of this.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::ClusterSettings;
use crate::runtime::Services;

/// This node.
#[derive(Debug)]
pub struct Cluster {
    pub node_id: String,
    /// The base URL other nodes reach this node's API on.
    pub advertise: String,
    pub ttl: Duration,
    pub heartbeat: Duration,
    /// Carries commands to the nodes that own their conversations.
    pub http: reqwest::Client,
    /// The epoch of each lease this process took: a lease taken again right after one of
    /// ours (`epoch - 1`) continues our own work; any other was someone else's, whose
    /// unfinished work is repaired.
    held: Mutex<HashMap<String, i64>>,
}

impl Cluster {
    /// This node as configured; `listen` is the address the API is bound to.
    pub fn new(settings: &ClusterSettings, listen: SocketAddr) -> Cluster {
        let node_id = if settings.node_id.trim().is_empty() {
            format!("node-{}", uuid::Uuid::now_v7())
        } else {
            settings.node_id.trim().to_owned()
        };
        let advertise = if settings.advertise.is_empty() {
            format!("http://{listen}")
        } else {
            settings.advertise.trim_end_matches('/').to_owned()
        };
        Cluster {
            node_id,
            advertise,
            ttl: Duration::from_millis(settings.lease_ttl_ms),
            heartbeat: Duration::from_millis(settings.heartbeat_ms),
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap_or_default(),
            held: Mutex::default(),
        }
    }

    /// Records lease `epoch` of conversation `id` as ours; true when the one before it was
    /// ours too (nobody else held it in between).
    pub fn took(&self, id: &str, epoch: i64) -> bool {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.insert(id.to_owned(), epoch) == Some(epoch - 1)
    }

    /// Whether this process took conversation `id`'s lease.
    pub fn holds(&self, id: &str) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(id)
    }

    /// Forgets a lease (the conversation is gone).
    pub fn forget(&self, id: &str) {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }
}

/// Registers the node and starts its heartbeat and its takeover of orphaned conversations.
/// Returns after the first takeover pass (start-up recovery), so the node serves repaired
/// conversations from its first request.
pub async fn start(services: &Arc<Services>) -> crate::store::Result<()> {
    let Some(cluster) = services.cluster.clone() else {
        return Ok(());
    };
    let store = &services.store;
    store
        .register_node(&cluster.node_id, &cluster.advertise)
        .await?;
    store
        .heartbeat(&cluster.node_id, &cluster.advertise, cluster.ttl)
        .await?;
    tracing::info!(node = %cluster.node_id, advertise = %cluster.advertise, "joined the cluster");
    take_over(services, &cluster).await;
    let services = services.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(cluster.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = services.shutting_down() => return,
            }
            match services
                .store
                .heartbeat(&cluster.node_id, &cluster.advertise, cluster.ttl)
                .await
            {
                Ok(_) => take_over(&services, &cluster).await,
                Err(error) => {
                    tracing::warn!(node = %cluster.node_id, %error, "heartbeat failed; leases expire if it goes on")
                }
            }
        }
    });
    Ok(())
}

/// Conversations left with work in flight by a node that is gone: take each (its lease, a
/// repair of its chain, its actor here).
async fn take_over(services: &Arc<Services>, cluster: &Cluster) {
    let orphans = match services
        .store
        .orphaned_conversations(&cluster.node_id, cluster.ttl, 200)
        .await
    {
        Ok(orphans) => orphans,
        Err(error) => {
            tracing::warn!(%error, "cannot look for orphaned conversations");
            return;
        }
    };
    for id in orphans {
        if services.registry.contains(&id) || cluster.holds(&id) {
            continue;
        }
        match services.registry.get_or_start(services, &id).await {
            Ok(_) => tracing::info!(conversation = %id, node = %cluster.node_id, "took over"),
            Err(error) => {
                tracing::debug!(conversation = %id, %error, "not taken over")
            }
        }
    }
}
