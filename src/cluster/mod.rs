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
    /// The data directory's node id file, locked while this process runs (see `kept_id`).
    _kept: Option<std::fs::File>,
}

/// The file in the data directory that keeps a node's generated id between starts.
const NODE_ID_FILE: &str = "node-id";

/// The node id kept in `data_dir` when none is configured: read from its `node-id` file, or
/// made and written there at the first start, so a restarted node is the same node and ends
/// its previous run's leases at once (not after the lease TTL). The file stays locked while
/// the process runs; a second process on the same data directory (which finds it locked)
/// gets an id of its own. `None` when the file cannot be used: a fresh id then.
fn kept_id(data_dir: &std::path::Path) -> Option<(String, std::fs::File)> {
    use std::io::{Read, Seek, Write};
    let path = data_dir.join(NODE_ID_FILE);
    let opened = std::fs::create_dir_all(data_dir).and_then(|()| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
    });
    let mut file = match opened {
        Ok(file) => file,
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "cannot keep the node id; a new one at every start");
            return None;
        }
    };
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            tracing::info!(path = %path.display(), "another process runs on this data directory's node id; this one gets its own");
            return None;
        }
        Err(std::fs::TryLockError::Error(error)) => {
            tracing::warn!(path = %path.display(), %error, "cannot lock the node id file; a new id at every start");
            return None;
        }
    }
    let mut kept = String::new();
    // At most 128 bytes count (the limit of a configured id); more is not ours.
    let _ = Read::by_ref(&mut file).take(256).read_to_string(&mut kept);
    let kept = kept.trim();
    let valid = !kept.is_empty()
        && kept.len() <= 128
        && kept
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if valid {
        return Some((kept.to_owned(), file));
    }
    let id = format!("node-{}", uuid::Uuid::now_v7());
    let written = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(format!("{id}\n").as_bytes()))
        .and_then(|()| file.sync_all());
    match written {
        Ok(()) => Some((id, file)),
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "cannot write the node id; a new one at every start");
            None
        }
    }
}

impl Cluster {
    /// This node as configured; `listen` is the address the API is bound to. Without a
    /// configured id, the one kept in `data_dir` (made there at the first start).
    pub fn new(
        settings: &ClusterSettings,
        listen: SocketAddr,
        data_dir: &std::path::Path,
    ) -> Cluster {
        let incarnation = uuid::Uuid::now_v7().to_string();
        let (node_id, kept) = if settings.node_id.trim().is_empty() {
            match kept_id(data_dir) {
                Some((id, file)) => (id, Some(file)),
                None => (format!("node-{incarnation}"), None),
            }
        } else {
            (settings.node_id.trim().to_owned(), None)
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
            _kept: kept,
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
