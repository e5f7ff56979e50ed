//! Several nodes on one Postgres (docs/operations.md, "Scaling"). Each node registers in the
//! `nodes` table and renews its heartbeat, which keeps every lease it holds live: a
//! conversation runs only on the node holding its lease, and each of its commits carries the
//! lease's epoch, which the database checks in the same statement that writes it (migration
//! m7). A node that stops heartbeating loses its leases after the TTL; any other node then
//! takes over the conversations it left with work in flight, repairing them as a restart
//! does. SQLite is one node and has none of this.

pub mod frames;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::config::ClusterSettings;
use crate::runtime::Services;
use crate::store::Node;

/// This node.
#[derive(Debug)]
pub struct Cluster {
    pub node_id: String,
    /// This process's run of the node (a fresh id at every start): the owner of the leases
    /// it takes, so that a restarted node finds those of its previous run ended.
    pub incarnation: String,
    /// The base URL other nodes reach this node's API on.
    pub advertise: String,
    pub ttl: Duration,
    pub heartbeat: Duration,
    /// Carries commands to the nodes that own their conversations.
    pub http: reqwest::Client,
}

impl Cluster {
    /// This node as configured; `listen` is the address the API is bound to.
    pub fn new(settings: &ClusterSettings, listen: SocketAddr) -> Cluster {
        let incarnation = uuid::Uuid::now_v7().to_string();
        let node_id = if settings.node_id.trim().is_empty() {
            format!("node-{incarnation}")
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
            incarnation,
            advertise,
            ttl: Duration::from_millis(settings.lease_ttl_ms),
            heartbeat: Duration::from_millis(settings.heartbeat_ms),
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap_or_default(),
        }
    }

    /// This node, as the store's lease statements name it.
    pub fn node(&self) -> Node<'_> {
        Node {
            id: &self.node_id,
            incarnation: &self.incarnation,
            ttl: self.ttl,
        }
    }
}

/// Registers the node and starts its heartbeat and its takeover of orphaned conversations.
/// Returns after the first takeover pass (start-up recovery), so the node serves repaired
/// conversations from its first request.
pub async fn start(services: &Arc<Services>) -> crate::store::Result<()> {
    let Some(cluster) = services.cluster.clone() else {
        return Ok(());
    };
    services
        .store
        .heartbeat(cluster.node(), &cluster.advertise)
        .await?;
    tracing::info!(node = %cluster.node_id, advertise = %cluster.advertise, "joined the cluster");
    // Frames across nodes first: the repairs of the start-up takeover are announced too.
    let interest = Arc::new(frames::Interest::new(cluster.heartbeat));
    if let (Some(tapped), Some(subscribed)) = (
        services.hub.tap(services.store.peers()),
        services.hub.subscriptions(),
    ) {
        tokio::spawn(frames::announce(services.clone(), interest.clone(), tapped));
        tokio::spawn(frames::follow(
            services.clone(),
            interest,
            subscribed,
            cluster.heartbeat,
        ));
    }
    // Start-up recovery: also conversations nobody holds (rows from before leases).
    take_over(services, &cluster, true).await;
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
                .heartbeat(cluster.node(), &cluster.advertise)
                .await
            {
                Ok(_) => {
                    take_over(&services, &cluster, false).await;
                    if let Err(error) = services.store.clear_dead_nodes(cluster.node()).await {
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
async fn take_over(services: &Arc<Services>, cluster: &Cluster, unowned: bool) {
    const BATCH: u64 = 200;
    loop {
        let orphans = match services
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
            if services.registry.contains(&id) {
                continue;
            }
            match services.registry.get_or_start(services, &id).await {
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
